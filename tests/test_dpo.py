"""DPO: its losses against hand-computed values, the answer log-probs that feed them (prompt and
padding never count), the loss at initialisation (log 2 with the reference = the policy), the
algo group and its pipeline, each new key's bad values refused by name; and, slow, algo=dpo end
to end (SFT -> DPO) on a reduced embedded default, ZeRO-3 with LoRA on 2 ranks against one ZeRO-0
process, and a killed DPO run resumed to the uninterrupted run's numbers."""

from __future__ import annotations

import math
import signal

import hydra
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, OPTConfig, OPTForCausalLM

from rlhf import algos
from rlhf.algos.preference import answer_logprobs, preference_terms
from rlhf.checks.validate import validated
from rlhf.config import ConfigError, DPOConfig, register_configs
from rlhf.data.collate import pair_batch
from rlhf.steps.all import compose_steps, exports
from tests.conftest import (
    CONF_DIR,
    FAST,
    cache_overrides,
    compose,
    read_metrics,
    read_summary,
    run_rlhf,
)

register_configs()

LOG2 = math.log(2.0)


# ------------------------------------------------------------------------------- the losses


def test_sigmoid_loss_and_its_label_smoothed_form_hand_computed():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    # beta (chosen - rejected) = 0.5, -1.0: -log sigmoid(z) = log(1 + e^-z)
    dpo = algos.dpo_sigmoid_loss(chosen, rejected, beta=0.5)
    assert dpo.tolist() == pytest.approx([0.474077, 1.313262], abs=1e-6)
    # cDPO, eps 0.1: 0.9 log(1 + e^-z) + 0.1 log(1 + e^z)
    cdpo = algos.dpo_sigmoid_loss(chosen, rejected, beta=0.5, label_smoothing=0.1)
    assert cdpo.tolist() == pytest.approx(
        [0.9 * 0.474077 + 0.1 * 0.974077, 0.9 * 1.313262 + 0.1 * 0.313262], abs=1e-6
    )
    # equal log-ratios (the policy still at its reference): log 2, whatever beta
    assert algos.dpo_sigmoid_loss(chosen, chosen, beta=0.5).tolist() == pytest.approx([LOG2] * 2)


def test_ipo_and_hinge_hand_computed():
    chosen, rejected = torch.tensor([1.0, 0.0, 4.0]), torch.tensor([0.0, 2.0, 0.0])
    # IPO, beta 0.5: (gap - 1 / (2 beta))^2 with target 1
    assert algos.ipo_loss(chosen, rejected, beta=0.5).tolist() == pytest.approx([0.0, 9.0, 9.0])
    # hinge, beta 0.5: max(0, 1 - 0.5 gap); the third pair is separated, no loss
    assert algos.hinge_loss(chosen, rejected, beta=0.5).tolist() == pytest.approx([0.5, 2.0, 0.0])
    with pytest.raises(ValueError, match="ipo"):
        algos.ipo_loss(chosen, rejected, beta=0.5, label_smoothing=0.1)
    with pytest.raises(ValueError, match="hinge"):
        algos.hinge_loss(chosen, rejected, beta=0.5, margin=1.0)


def test_simpo_hand_computed_is_reference_free_with_a_margin():
    # length-normalised log-probs -1.0 and -1.5, beta 2, gamma 0.5: z = 2 x 0.5 - 0.5 = 0.5
    loss = algos.simpo_loss(torch.tensor([-1.0]), torch.tensor([-1.5]), beta=2.0, margin=0.5)
    assert loss.item() == pytest.approx(0.474077, abs=1e-6)
    assert "simpo" in algos.REFERENCE_FREE and set(algos.PREFERENCE_LOSSES) == {
        "sigmoid",
        "ipo",
        "hinge",
        "simpo",
    }


def test_sequence_logprobs_count_answer_tokens_only():
    """Vocabulary 3; row 0: prompt token, two answer tokens, one pad; row 1: an empty answer.
    Token t is predicted by the logits at t - 1: p(1) = 2 / 4 under [0, ln 2, 0], p(2) = 1 / 3."""
    logits = torch.zeros(2, 4, 3)
    logits[0, 0] = torch.tensor([0.0, math.log(2.0), 0.0])
    input_ids = torch.tensor([[0, 1, 2, 0], [0, 1, 0, 0]])
    mask = torch.tensor([[False, True, True, False], [False, False, False, False]])
    total = math.log(0.5) + math.log(1 / 3)
    summed = algos.sequence_logprobs(logits, input_ids, mask, "sum")
    assert summed.tolist() == pytest.approx([total, 0.0])
    mean = algos.sequence_logprobs(logits, input_ids, mask, "mean")
    assert mean.tolist() == pytest.approx([total / 2, 0.0])
    # the logits that predict padding (and the last position's) change nothing, even huge ones
    garbage = logits.clone()
    garbage[:, 2:] = 1e4 * torch.randn(2, 2, 3)
    garbage[1] = 1e4 * torch.randn(4, 3)
    assert algos.sequence_logprobs(garbage, input_ids, mask, "sum").tolist() == pytest.approx(
        summed.tolist()
    )
    with pytest.raises(ValueError, match="reduction"):
        algos.sequence_logprobs(logits, input_ids, mask, "max")


def test_preference_terms_give_loss_rewards_accuracy_and_margin():
    """Two pairs (chosen rows first): policy answer log-probs and the reference's."""
    logprobs = torch.tensor([-4.0, -6.0, -8.0, -5.0])  # chosen 0, chosen 1, rejected 0, rejected 1
    ref = torch.tensor([-5.0, -6.0, -7.0, -5.0])
    terms = preference_terms(DPOConfig(beta=0.5), logprobs, ref)
    # log-ratios: chosen [1, 0], rejected [-1, 0]
    assert terms["chosen_reward"].tolist() == [0.5, 0.0]
    assert terms["rejected_reward"].tolist() == [-0.5, 0.0]
    assert terms["margin"].tolist() == [1.0, 0.0]
    assert terms["accuracy"].tolist() == [1.0, 0.0]  # a tie is not a win
    assert terms["loss"].tolist() == pytest.approx([math.log1p(math.exp(-1.0)), LOG2])
    assert terms["chosen_logprob"].tolist() == [-4.0, -6.0]
    assert terms["rejected_logprob"].tolist() == [-8.0, -5.0]
    # simpo ignores any reference: its rewards are beta x the policy's own log-probs
    simpo = preference_terms(DPOConfig(loss="simpo", beta=2.0), logprobs, None)
    assert simpo["margin"].tolist() == [8.0, -2.0]


def test_sigmoid_loss_is_log2_when_the_reference_is_the_policy():
    """A real model's answer log-probs, twice (the reference is a copy): every pair starts at
    log 2 whatever the answers, and no pair is counted as won."""
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=40, hidden_size=16, word_embed_proj_dim=16, num_hidden_layers=1,
        num_attention_heads=2, ffn_dim=32, max_position_embeddings=32, dropout=0.0,
    )  # fmt: skip
    policy = OPTForCausalLM(config)
    reference = OPTForCausalLM(config)
    reference.load_state_dict(policy.state_dict())
    rows = [
        {"prompt_ids": [2, 5, 6], "chosen_ids": [7, 8, 2], "rejected_ids": [9, 2]},
        {"prompt_ids": [2, 11], "chosen_ids": [12, 2], "rejected_ids": [13, 14, 15, 2]},
    ]
    batch = pair_batch(rows, pad_id=1)
    policy.train()  # the training forward: without dropout it is the reference's function
    logprobs = answer_logprobs(policy, batch, "sum")
    with torch.no_grad():
        ref_logprobs = answer_logprobs(reference.eval(), batch, "sum")
    assert logprobs[0] != logprobs[2]  # chosen and rejected answers do differ
    terms = preference_terms(DPOConfig(), logprobs, ref_logprobs)
    assert terms["loss"].tolist() == pytest.approx([LOG2, LOG2], abs=1e-6)
    assert terms["accuracy"].sum() == 0
    terms["loss"].mean().backward()  # and it trains: the gradient reaches the policy
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())


# --------------------------------------------------------------------- config and pipeline


def test_algo_group_sets_the_pipeline(tmp_path):
    assert compose([]).pipeline.steps == ["sft", "reward", "ppo"]  # algo=ppo, the default
    assert compose(["algo=dpo"]).pipeline.steps == ["sft", "dpo"]
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        config = validated(hydra.compose("config", ["algo=dpo"]))
        steps = compose_steps(config, ["algo=dpo"], "config", tmp_path)
        assert list(steps) == ["sft", "dpo"]
        dpo = steps["dpo"]
        assert dpo.step.name == "dpo"
        assert dpo.model.path == str(tmp_path / "sft" / "model")  # policy and reference
        assert dpo.model.dropout == 0.0  # conf/step/dpo.yaml: log-ratios start at 0
        assert steps["sft"].model.dropout is None
        gold = ["ppo.reward.function=toy_gold", "ppo.reward.normalize=false"]
        config = validated(hydra.compose("config", gold))
        assert list(compose_steps(config, gold, "config", tmp_path)) == ["sft", "ppo"]
    assert exports(tmp_path, ["sft", "dpo"]) == (
        tmp_path / "sft" / "model",
        tmp_path / "dpo" / "model",
    )


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["dpo.loss=kto"], "dpo.loss='kto': expected one of sigmoid, ipo, hinge, simpo"),
        (["dpo.beta=0"], "dpo.beta=0.0: expected a float > 0"),
        (["dpo.label_smoothing=0.5"], "dpo.label_smoothing=0.5: expected a float in [0, 0.5)"),
        (["dpo.margin=-1"], "dpo.margin=-1.0: expected a float >= 0"),
        (["dpo.loss=ipo", "dpo.label_smoothing=0.1"], "dpo.label_smoothing=0.1: expected 0.0"),
        (["dpo.loss=hinge", "dpo.margin=0.5"], "dpo.margin=0.5: expected 0.0 with loss=hinge"),
        (["dpo.reduction=max"], "dpo.reduction='max': expected null or one of sum, mean"),
        (["pipeline.steps=[sft,dpo,ppo]"], "pipeline.steps=['sft', 'dpo', 'ppo']: expected"),
        (["algo=dpo", "pipeline.steps=[dpo]"], "pipeline.steps=['dpo']"),
    ],
)
def test_bad_values_are_refused_by_name(overrides, named, tmp_path):
    with pytest.raises(ConfigError) as err:
        validated(compose(["step=dpo", f"model.path={tmp_path}", *overrides]))
    assert named in str(err.value)


def test_step_dpo_needs_the_sft_export_and_refuses_a_reward_model(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path=None: expected the SFT export"):
        validated(compose(["step=dpo"]))
    reward = tmp_path / "reward"
    reward.mkdir()
    (reward / "config.json").write_text('{"architectures": ["OPTForSequenceClassification"]}')
    proc = run_rlhf(
        ["step=dpo", f"model.path={reward}"],
        run_dir=tmp_path / "run",
        check=False,
        timeout=120,
        extra_env={"HYDRA_FULL_ERROR": "0"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "a reward model (OPTForSequenceClassification" in proc.stderr
    assert "step=dpo trains a causal LM" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------- runs (slow)

SMALL = [*FAST, "ppo.eval.prompts=16", "ppo.rollout.max_new_tokens=16"]


@pytest.fixture(scope="module")
def pipeline(cache_dir, tmp_path_factory):
    """algo=dpo on FAST sizes: 30 steps of SFT, then 30 of DPO, a row every step."""
    run_dir = tmp_path_factory.mktemp("dpo-all")
    overrides = [
        "algo=dpo",
        *SMALL,
        "step.max_steps=30",
        "step.log_interval=1",
        "dpo.beta=0.5",  # 5x the default's step on the implicit rewards: clear in 30 steps
        *cache_overrides(cache_dir),
    ]
    run_rlhf(overrides, run_dir=run_dir)
    return run_dir


@pytest.mark.slow
def test_algo_dpo_runs_sft_then_dpo_and_exports_a_causal_lm(pipeline):
    sub_runs = [p.name for p in pipeline.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert sorted(sub_runs) == ["dpo", "sft"]  # no reward model, no PPO
    for step in ("sft", "dpo"):
        assert (pipeline / step / "model" / "model.safetensors").is_file(), step
    summary = read_summary(pipeline)
    assert summary["sft/train/steps"] == summary["dpo/train/steps"] == 30
    for key in ("loss", "accuracy", "margin", "chosen_logprob", "rejected_logprob", "kl"):
        assert math.isfinite(summary[f"dpo/eval/{key}"]), key
    for key in ("gold_accuracy", "gold_correct", "gold_clean"):  # greedy and sampled, as PPO's
        assert 0.0 <= summary[f"dpo/eval/{key}"] <= 1.0
        assert 0.0 <= summary[f"dpo/eval/{key}_sampled"] <= 1.0
    tokenizer = AutoTokenizer.from_pretrained(pipeline / "dpo" / "model")
    model = AutoModelForCausalLM.from_pretrained(pipeline / "dpo" / "model")
    ids = tokenizer("What is 2 plus 3?", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] > ids.shape[1]


@pytest.mark.slow
def test_dpo_starts_at_log2_and_learns_the_preferences(pipeline):
    dpo = pipeline / "dpo"
    summary = read_summary(dpo)
    # before training the policy is its reference: every log-ratio, reward and KL is 0
    assert summary["initial/eval/loss"] == pytest.approx(LOG2, abs=1e-5)
    assert summary["initial/eval/margin"] == pytest.approx(0.0, abs=1e-5)
    assert summary["initial/eval/kl"] == pytest.approx(0.0, abs=1e-5)
    train = [r for r in read_metrics(dpo) if "dpo/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert train[0]["dpo/loss"] == pytest.approx(LOG2, abs=1e-5)  # measured before the update
    # then it learns the held-out preferences: the chosen answer's implicit reward pulls ahead
    assert summary["eval/loss"] < LOG2 - 0.01
    assert summary["eval/margin"] > 0.02
    assert summary["eval/accuracy"] > 0.5
    assert summary["eval/kl"] != 0  # the policy has left its reference (k1 may be < 0 on samples)
    assert summary["dpo/loss"] < LOG2


def _dpo(pipeline, cache_dir) -> list[str]:
    return [
        "step=dpo",
        *SMALL,
        f"model.path={pipeline / 'sft' / 'model'}",
        "step.max_steps=6",
        "step.log_interval=1",
        "step.checkpoint_interval=3",
        "step.eval_at_start=false",
        "step.save_model=false",
        "ppo.eval.prompts=8",
        "optim.lr=1e-3",  # every one of the 6 updates moves the loss visibly
        "model.dtype=fp32",
        "lora=r8",  # LoRA on top of the full weights: it starts at the reference too
        *cache_overrides(cache_dir),
    ]


def _losses(run_dir) -> list[float]:
    rows = [r for r in read_metrics(run_dir) if "dpo/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    return [r["dpo/loss"] for r in rows]


@pytest.fixture(scope="module")
def zero0(pipeline, cache_dir, tmp_path_factory):
    """One process, ZeRO-0, the whole global batch (16 pairs) in one micro batch."""
    run_dir = tmp_path_factory.mktemp("dpo-zero0")
    run_rlhf([*_dpo(pipeline, cache_dir), "zero=stage0"], run_dir=run_dir)
    return run_dir


@pytest.mark.slow
def test_zero3_two_ranks_with_lora_matches_zero0_one_process(zero0, pipeline, cache_dir, tmp_path):
    reference = _losses(zero0)
    assert reference[0] == pytest.approx(LOG2, abs=1e-5)  # LoRA's B = 0: policy = reference
    assert len(set(reference)) == 6 and reference[-1] < reference[0]  # the loss moves
    overrides = [
        *_dpo(pipeline, cache_dir),
        "zero=stage3",
        "zero.stage3_param_persistence_threshold=0",  # partition every parameter
        # 4 pairs x 2 micro batches a rank (more with optim.dynamic_batch's token budget): the
        # micro batches' weights must add up to the global batch's mean
        "optim.micro_batch_size=4",
        "optim.grad_accum=2",
    ]
    run_rlhf(overrides, run_dir=tmp_path / "zero3", nproc=2)
    assert _losses(tmp_path / "zero3") == pytest.approx(reference, rel=1e-4)
    zero3 = read_summary(tmp_path / "zero3")
    assert zero3["eval/loss"] == pytest.approx(read_summary(zero0)["eval/loss"], rel=1e-4)


@pytest.mark.slow
def test_a_killed_dpo_run_resumes_to_the_uninterrupted_numbers(
    zero0, pipeline, cache_dir, tmp_path
):
    run_dir = tmp_path / "run"
    overrides = [*_dpo(pipeline, cache_dir), "zero=stage0"]
    killed = run_rlhf([*overrides, "debug.kill_at_step=4"], run_dir=run_dir, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run_rlhf(overrides, run_dir=run_dir)  # resumes from step 3

    def comparable(path):
        return [
            {k: v for k, v in row.items() if not k.startswith("perf/")}
            for row in read_metrics(path)
        ]

    assert comparable(run_dir) == comparable(zero0)
    assert read_summary(run_dir)["eval/gold_accuracy"] == read_summary(zero0)["eval/gold_accuracy"]

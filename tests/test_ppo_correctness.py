"""PPO correctness where the CPU suite used to be blind (issue 16), on tiny models built here:

1. the hybrid engine: rollouts switch the *engine* to eval (its inference kernels) and back to
   train before any log-prob is taken; the installed DeepSpeed / transformers pair is refused
   with a message naming the layer that does not fit;
2. no dropout in PPO's trained models (model or LoRA): refused from the config and from the
   loaded model;
3. the EMA of the actor is sliced over the ranks and checkpointed per rank;
4. PTX rows: each rank's position follows from a counter every rank shares, so a resume
   cannot hand rank 0's rows to the others;
5. the reward model's end-of-text token must be the actor's;
6. the missing-EOS and short-answer penalties land where they should, after the clip;
7. sampler / trainer log-probs: recomputed by default outside fp32, their gap measured; a
   model's saved generation_config changes neither sampling nor greedy decoding;
8. the log-ratio is clamped before exp; the entropy graph exists only when it is trained.

The 2-rank ZeRO-3 kill-and-resume run with EMA and PTX is marked slow.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig, OPTConfig, OPTForCausalLM, OPTForSequenceClassification

from rlhf import algos
from rlhf.checks.ppo_launch import dropout_problems
from rlhf.config import (
    ConfigError,
    LoraConfig,
    ModelConfig,
    PPOConfig,
    PPOKLConfig,
    PPORolloutConfig,
    register_configs,
    to_config,
)
from rlhf.config.resolve import Facts, uses_rollout_logprobs
from rlhf.data.collate import left_pad, right_pad
from rlhf.modeling.compatibility import causal_lm_class, end_of_text_problem, hybrid_engine_problem
from rlhf.modeling.loading import ValueModel
from rlhf.modeling.peft_lora import apply_lora
from rlhf.rl import ema as ema_module
from rlhf.rl import ptx as ptx_module
from rlhf.rl.collector import Collector, LogprobGap
from rlhf.rl.ema import EMA
from rlhf.rl.experience import make_experience
from rlhf.rl.experience_batch import rollout_metrics
from rlhf.rl.generation import Rollout, Sampling, generate
from rlhf.rl.ppo_models import active_dropouts, refuse_dropout
from rlhf.rl.rollouts import HFDecoder
from rlhf.rl.shaping import Shaping, penalised_scores
from tests.conftest import compose, read_metrics
from tests.test_ppo import Trained

register_configs()
PAD, BOS, EOS = 0, 1, 2
CPU = torch.device("cpu")


def _config(**extra) -> OPTConfig:
    base = dict(
        vocab_size=24,
        hidden_size=16,
        word_embed_proj_dim=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        init_std=0.5,
    )
    return OPTConfig(**{**base, **extra})


def _lm(seed: int = 0, **extra) -> OPTForCausalLM:
    torch.manual_seed(seed)
    return OPTForCausalLM(_config(**extra)).eval()


def _critic(seed: int = 1) -> ValueModel:
    torch.manual_seed(seed)
    return ValueModel(OPTForSequenceClassification(_config(num_labels=1))).eval()


class ConstantReward(torch.nn.Module):
    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, input_ids, attention_mask):
        return torch.full(input_ids.shape, self.value)


SHAPING = Shaping(
    kl_coef=0.1,
    kl_estimator="k1",
    clip_reward_value=5.0,
    gamma=1.0,
    lam=0.95,
    min_response_tokens=2,
    score_position="last",
    reward_stats=None,
)

# an answer that ends, one cut at max_new_tokens (no EOS), one that is only EOS (short)
PROMPTS = [[BOS, 5, 6], [BOS, 7], [BOS, 8, 9]]
RESPONSES = [[12, 13, EOS], [14, 15, 16, 17], [EOS]]


def _rollout(ended: bool = True) -> Rollout:
    prompt_ids, prompt_mask = left_pad(PROMPTS, PAD)
    response_ids, answer_mask = right_pad(RESPONSES, PAD)
    sequences = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, answer_mask], dim=1)
    ends = torch.tensor([True, False, True]) if ended else None
    return Rollout(sequences, attention_mask, prompt_ids.shape[1], answer_mask.bool(), None, ends)


def _experience(shaping: Shaping, score: float = 3.0, rollout: Rollout | None = None):
    return make_experience(
        rollout or _rollout(), _lm(), _lm(seed=2), _critic(), ConstantReward(score), shaping, CPU
    )


# ---------------------------------------------------------------- 6. penalties


def test_missing_eos_penalty_lands_on_the_last_token_of_a_cut_answer():
    plain = _experience(SHAPING)
    penalised = _experience(dataclasses.replace(SHAPING, unterminated_penalty=1.5))
    assert plain.unterminated.tolist() == [False, True, False]
    difference = plain.rewards - penalised.rewards
    expected = torch.zeros_like(difference)
    expected[1, 3] = 1.5  # the cut answer's 4th and last token
    torch.testing.assert_close(difference, expected)


def test_penalties_come_after_the_clip():
    """A score at the clip must not swallow the penalty: 7 -> clip 5 -> 5 - 1.5."""
    shaping = dataclasses.replace(SHAPING, unterminated_penalty=1.5, short_answer_penalty=2.0)
    scores = torch.tensor([7.0, 7.0, 7.0])
    short = torch.tensor([False, False, True])
    cut = torch.tensor([False, True, False])
    assert penalised_scores(scores, short, cut, shaping).tolist() == [5.0, 3.5, -2.0]
    assert penalised_scores(scores, short, cut, SHAPING).tolist() == [5.0, 5.0, 5.0]


def test_short_answer_penalty_keeps_an_empty_answer_in_the_losses_with_the_penalty():
    masked = _experience(SHAPING)
    assert masked.short.tolist() == [False, False, True]
    assert not masked.response_mask[2].any()  # default: masked out, no signal at all
    assert (masked.rewards[2] == 0).all()

    kept = _experience(dataclasses.replace(SHAPING, short_answer_penalty=2.0))
    assert kept.response_mask[2].tolist() == [True, False, False, False]
    kl_part = -0.1 * (kept.old_logprobs[2, 0] - kept.ref_logprobs[2, 0])
    torch.testing.assert_close(kept.rewards[2, 0], -2.0 + kl_part)
    assert kept.advantages[2, 0] != 0  # the policy gets a gradient from it
    # the other rows are untouched
    torch.testing.assert_close(kept.rewards[:2], masked.rewards[:2])


def test_rollout_metrics_report_the_share_of_unterminated_answers():
    metrics = rollout_metrics([_experience(SHAPING), _experience(SHAPING)])
    assert metrics["ppo/unterminated"] == pytest.approx(1 / 3)
    assert metrics["ppo/short_answers"] == 2
    # a short answer kept by its penalty counts in neither the reward nor the length
    kept = rollout_metrics([_experience(dataclasses.replace(SHAPING, short_answer_penalty=2.0))])
    assert kept["ppo/response_length"] == pytest.approx((3 + 4) / 2)


def test_generate_records_which_answers_ended():
    model = _lm(seed=3)
    rollout = generate(model, PROMPTS, PAD, EOS, Sampling(6, greedy=True), False)
    answers = rollout.sequences[:, rollout.prompt_width :]
    assert rollout.ended.tolist() == (answers == EOS).any(1).tolist()


# ---------------------------------------------------------------- 7. generation settings


def _with_saved_generation_config(model: OPTForCausalLM) -> OPTForCausalLM:
    """A hub chat model's habits: low temperature, sampling on, top-k/top-p, a repetition
    penalty, a minimum length."""
    model.generation_config = GenerationConfig(
        do_sample=True,
        temperature=0.3,
        top_k=3,
        top_p=0.5,
        repetition_penalty=1.8,
        min_new_tokens=5,
        no_repeat_ngram_size=1,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return model


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_a_saved_generation_config_changes_neither_sampling_nor_greedy_answers(lora):
    def model(saved: bool):
        lm = _lm(seed=4)
        if saved:
            _with_saved_generation_config(lm)
        return apply_lora(lm, LoraConfig(rank=4, target_modules=["q_proj"])) if lora else lm

    prompts = [[BOS, 5, 6, 7], [BOS, 8], [BOS, 9, 10]]
    for sampling in (Sampling(8, temperature=1.0), Sampling(8, greedy=True)):
        answers = []
        for saved in (False, True):
            torch.manual_seed(11)
            answers.append(generate(model(saved), prompts, PAD, EOS, sampling, False).sequences)
        assert torch.equal(answers[0], answers[1]), f"greedy={sampling.greedy}"
    # greedy stays greedy: the same answers whatever the seed
    torch.manual_seed(12)
    again = generate(model(True), prompts, PAD, EOS, Sampling(8, greedy=True), False).sequences
    assert torch.equal(again, answers[1])
    assert model(True).generation_config.temperature == 0.3  # restored after the call


def test_rollout_logprobs_default_to_a_recompute_outside_fp32():
    def cfg(logprobs=None, hybrid=False, kl_estimator="k1", **rollout):
        return SimpleNamespace(
            ppo=PPOConfig(
                rollout=PPORolloutConfig(logprobs=logprobs, **rollout),
                kl=PPOKLConfig(estimator=kl_estimator),
            ),
            actor=SimpleNamespace(hybrid_engine=hybrid),
        )

    def uses(c, dtype: str) -> bool:  # the actor's dtype as resolved, the registry's answer
        c.actor.model = SimpleNamespace(dtype=dtype)
        return uses_rollout_logprobs(c, Facts(kl_reads_logits=c.ppo.kl.estimator == "full"))

    assert uses(cfg(), "fp32") is True
    assert uses(cfg(), "bf16") is False
    assert uses(cfg(), "fp16") is False
    assert uses(cfg(True), "bf16") is True
    assert uses(cfg(False), "fp32") is False
    assert uses(cfg(None, hybrid=True), "fp32") is False
    # the exact KL needs the actor's distributions, which the sampler does not keep
    assert uses(cfg(None, kl_estimator="full"), "fp32") is False
    # vLLM's kernels are not the trainer's; a truncating sampler's record is the full softmax
    assert uses(cfg(None, engine="vllm"), "fp32") is False
    assert uses(cfg(None, top_k=5), "fp32") is False
    assert uses(cfg(None, top_p=0.9, greedy=True), "fp32") is True


def test_logprob_gap_is_the_mean_and_max_absolute_difference_over_answer_tokens():
    gap = LogprobGap()
    sampled = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    trained = torch.tensor([[-1.1, -2.0, 0.0], [-0.5, -0.2, -0.5]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    gap.add(sampled, trained, mask)
    metrics = gap.metrics()
    assert metrics["ppo/logprob_diff_mean"] == pytest.approx((0.1 + 0.3) / 5)
    assert metrics["ppo/logprob_diff_max"] == pytest.approx(0.3)
    assert gap.metrics() == {}  # starts over; nothing measured, nothing logged
    gap.add(sampled, trained, torch.zeros_like(mask))  # every token older than the weights
    assert gap.metrics() == {}


# ---------------------------------------------------------------- 1. hybrid engine switching


class KernelSwitchingEngine(torch.nn.Module):
    """Stands in for DeepSpeed's hybrid engine: ``eval()`` swaps in 'inference kernels' and
    ``train()`` swaps them out; every forward of the module records which were active."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.inference_kernels = False
        self.forwards: list[str] = []
        module.register_forward_hook(lambda *_: self.forwards.append(self._kernels()))

    def _kernels(self) -> str:
        return "inference" if self.inference_kernels else "training"

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def eval(self):
        self.inference_kernels = True
        return super().eval()

    def train(self, mode: bool = True):
        if mode:
            self.inference_kernels = False
        return super().train(mode)


def test_rollouts_decode_on_inference_kernels_and_take_log_probs_on_training_kernels():
    actor = KernelSwitchingEngine(_lm(seed=5))
    critic = SimpleNamespace(module=_critic(), eval=None, train=None)  # never engine-switched
    models = SimpleNamespace(
        actor=actor,
        reference=_lm(seed=6),
        critic=critic.module,
        reward=ConstantReward(1.0),
        teacher=None,
    )
    cfg = SimpleNamespace(actor=SimpleNamespace(zero=SimpleNamespace(stage=0)))
    rollouts = HFDecoder(cfg, actor, PAD, EOS)
    collect = Collector(
        models, cfg, PAD, EOS, Sampling(5, greedy=True), rollout_logprobs=False, rollouts=rollouts
    )
    collect(PROMPTS, SHAPING)
    assert actor.forwards, "the actor never ran"
    decoding, scoring = actor.forwards[:-1], actor.forwards[-1:]
    assert set(decoding) == {"inference"}, actor.forwards  # engine.eval() before generate
    assert scoring == ["training"], actor.forwards  # engine.train() before the log-probs
    assert not actor.inference_kernels  # left ready for the update


def test_make_experience_never_switches_a_hybrid_engine_to_its_inference_kernels():
    actor = KernelSwitchingEngine(_lm(seed=5))
    make_experience(_rollout(), actor, _lm(seed=6), _critic(), ConstantReward(1.0), SHAPING, CPU)
    assert actor.forwards == ["training"]
    assert actor.module.training  # back to train mode for the update


class LegacyLayer(torch.nn.Module):
    """A decoder layer with the tuple-cache contract DeepSpeed's kernels implement."""

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, use_cache=False):
        return hidden_states


class LegacyLM(torch.nn.Module):
    pass


class LegacyPolicy:
    _orig_layer_class = None

    def __init__(self, _):
        type(self)._orig_layer_class = LegacyLayer


def test_hybrid_engine_is_refused_for_the_installed_opt_and_llama_layers():
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    for lm_class, layer in ((OPTForCausalLM, "OPTDecoderLayer"), (LlamaForCausalLM, "Llama")):
        problem = hybrid_engine_problem(lm_class)
        assert problem is not None and layer in problem and "takes a Cache" in problem
        assert "actor.hybrid_engine=false" in problem
    none = hybrid_engine_problem(Qwen2ForCausalLM)  # DeepSpeed has no kernels for it
    assert "no inference kernels" in none
    # a model whose layers have the tuple contract passes
    assert hybrid_engine_problem(LegacyLM, policies=[LegacyPolicy]) is None
    assert causal_lm_class({"model_type": "opt"}) is OPTForCausalLM


# ---------------------------------------------------------------- 2. dropout


def test_dropout_of_a_trained_ppo_model_is_refused_from_the_config():
    zero = ModelConfig(dropout=0.0)
    lora = LoraConfig(rank=8, dropout=0.1)
    assert dropout_problems("actor", zero, LoraConfig(rank=8), {"dropout": 0.1}) == []
    [problem] = dropout_problems("actor", zero, lora, None)
    assert problem.startswith("actor.lora.dropout=0.1: expected 0.0")
    keeps = ModelConfig(path="/m", dropout=None)
    [problem] = dropout_problems("critic", keeps, LoraConfig(), {"attention_dropout": 0.1})
    assert "critic.model.dropout=None" in problem and "attention_dropout=0.1" in problem
    [problem] = dropout_problems("actor", zero, LoraConfig(), {"layerdrop": 0.2})
    assert "layerdrop=0.2" in problem


def test_dropout_of_a_loaded_model_is_found_and_refused():
    assert active_dropouts(_lm()) == []
    found = active_dropouts(_lm(dropout=0.1, layerdrop=0.05))
    assert any(f.endswith("layerdrop=0.05") for f in found)
    assert any(".dropout=0.1" in f for f in found)
    lora = apply_lora(_lm(), LoraConfig(rank=4, dropout=0.1, target_modules=["q_proj"]))
    assert any("lora_dropout" in f for f in active_dropouts(lora))
    with pytest.raises(ConfigError, match=r"actor: dropout is active .*actor.lora.dropout=0.0"):
        refuse_dropout("actor", lora)
    refuse_dropout("actor", apply_lora(_lm(), LoraConfig(rank=4, target_modules=["q_proj"])))


# ---------------------------------------------------------------- 5. end-of-text


class Tokens:
    def convert_ids_to_tokens(self, token_id: int) -> str:
        return {2: "</s>", 7: "<|end|>"}[token_id]


def test_a_reward_model_trained_on_another_end_token_is_refused():
    setting = "critic.model.path=/rm"  # the key and value naming the reward model
    assert end_of_text_problem(2, {"end_of_text_id": 2}, setting, Tokens()) is None
    assert end_of_text_problem(2, None, setting, Tokens()) is None  # a causal LM as critic
    problem = end_of_text_problem(7, {"end_of_text_id": 2}, setting, Tokens())
    assert problem.startswith("critic.model.path=/rm: ")
    assert "'</s>' (id 2)" in problem and "'<|end|>' (id 7)" in problem


# ---------------------------------------------------------------- 3. EMA, 4. PTX


def _as_rank(monkeypatch, module, r: int, size: int) -> None:
    monkeypatch.setattr(module, "rank", lambda: r)
    monkeypatch.setattr(module, "world_size", lambda: size)


def test_ema_is_sliced_over_the_ranks_and_rebuilds_the_full_average(monkeypatch, tmp_path):
    first, second = _lm(seed=7), _lm(seed=8)
    full = EMA(first, 0.9, zero_stage=0)
    full.update(second)
    average = full.full_state()
    for name, param in first.named_parameters():
        expected = 0.9 * param + 0.1 * dict(second.named_parameters())[name]
        torch.testing.assert_close(average[name], expected.detach())

    slices = []
    for r in (0, 1):  # two ranks' EMAs: each holds half (padded), together all of it
        _as_rank(monkeypatch, ema_module, r, 2)
        ema = EMA(first, 0.9, zero_stage=0)
        ema.update(second)
        ema.save(tmp_path)
        slices.append(ema.shards)
    for name, whole in average.items():
        flat = torch.cat([slices[0][name], slices[1][name]])[: whole.numel()]
        torch.testing.assert_close(flat.view(whole.shape), whole)
        assert slices[0][name].numel() == -(-whole.numel() // 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ema-rank0.pt", "ema-rank1.pt"]
    _as_rank(monkeypatch, ema_module, 1, 2)
    restored = EMA(first, 0.9, zero_stage=0)
    restored.load(tmp_path)  # rank 1 reads its own slice back
    for name in slices[1]:
        assert torch.equal(restored.shards[name], slices[1][name])


def _ptx(monkeypatch, r: int):
    _as_rank(monkeypatch, ptx_module, r, 2)
    batches = object.__new__(ptx_module.PTXBatches)
    batches.rows = [[i] for i in range(100)]
    batches.size, batches.pad_id, batches.batches = 3, PAD, 0
    return batches


def test_ptx_ranks_read_disjoint_rows_and_keep_them_after_a_resume(monkeypatch):
    read = {}
    for r in (0, 1):
        batches = _ptx(monkeypatch, r)
        read[r] = [batches.next_rows() for _ in range(2)]
        state = batches.state_dict()
        resumed = _ptx(monkeypatch, r)  # as rank r resuming from the shared trainer state
        resumed.load_state_dict(state)
        read[r] += [resumed.next_rows()]
    assert read[0] == [[[0], [1], [2]], [[6], [7], [8]], [[12], [13], [14]]]
    assert read[1] == [[[3], [4], [5]], [[9], [10], [11]], [[15], [16], [17]]]


# ---------------------------------------------------------------- 8. clamp, entropy


def test_a_huge_log_ratio_gives_a_finite_loss_and_kl():
    logprobs, old = torch.zeros(1, 2), torch.tensor([[-100.0, 0.0]])
    advantages, mask = torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool)
    loss, stats = algos.policy_loss(logprobs, old, advantages, mask, 0.2, 0.2)
    assert torch.isfinite(loss) and torch.isfinite(stats["ratio_max"])
    k3 = algos.kl_penalty(torch.tensor([[-100.0]]), torch.zeros(1, 1), "k3")
    assert torch.isfinite(k3).all()
    assert algos.kl_penalty(torch.tensor([[0.3]]), torch.zeros(1, 1), "k3").item() == (
        pytest.approx(torch.expm1(torch.tensor(-0.3)).item() + 0.3)
    )


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_the_entropy_graph_is_built_only_when_it_is_trained(entropy_coef, monkeypatch):
    from rlhf.steps import ppo_update as ppo_recipe
    from rlhf.steps.loop import NonFiniteGuard

    actor, critic = Trained(_lm(seed=9)), Trained(_critic(seed=10))
    exp = make_experience(_rollout(), actor, _lm(seed=6), critic, ConstantReward(1.0), SHAPING, CPU)
    cfg = to_config(compose(["step=sft", f"ppo.loss.entropy_coef={entropy_coef}"]))
    grad_modes = []
    entropy = algos.entropy_from_logits

    def spy(logits):
        grad_modes.append(torch.is_grad_enabled())
        return entropy(logits)

    monkeypatch.setattr(ppo_recipe.algos, "entropy_from_logits", spy)
    models = SimpleNamespace(actor=actor, critic=critic)
    out = ppo_recipe.train_step(models, [exp], cfg, None, NonFiniteGuard(3), 0.0)
    assert grad_modes == [entropy_coef > 0]
    assert out["entropy_sum"] > 0  # logged either way


# ---------------------------------------------------------------- checkpoint files


def test_a_checkpoint_holds_the_recipes_own_files(tmp_path):
    from rlhf.runtime import checkpoint

    def write(directory: Path) -> list[Path]:
        (directory / "ema-rank0.pt").write_text("slice")
        return [directory / "ema-rank0.pt"]

    final = checkpoint.save(tmp_path, 3, {}, {"state": {}}, keep=2, write_files=write)
    assert (final / "ema-rank0.pt").read_text() == "slice"
    manifest = json.loads((final / "manifest-rank00000.json").read_text())
    assert manifest["files"]["ema-rank0.pt"]["size"] == len("slice")  # hashed as written
    assert "ema" not in torch.load(final / "trainer.pt", weights_only=True)


# ------------------------------------------- the GPU check's CPU-reachable part (slow)
# tests/gpu/check.py --tiny, one check a test, on one bf16 pipeline: the script cannot rot, and
# its ZeRO-3 run is this suite's 2-rank kill-and-resume test of the EMA and PTX (3, 4).


@pytest.fixture(scope="module")
def gpu_check(tmp_path_factory):
    from tests.gpu import check

    s = check.setup(tmp_path_factory.mktemp("gpu-check"), tiny=True)
    [row] = check.check_pipeline(s)
    assert row.ok, row.measured
    return check, s


@pytest.fixture(scope="module")
def hybrid_engine_rows(gpu_check):
    """The hybrid-engine check's rows, once: its hybrid-off run is also the log-prob gap
    check's recompute run, whichever test asks first."""
    check, s = gpu_check
    return check.check_hybrid_engine(s)


@pytest.mark.slow
def test_gpu_check_hybrid_engine_rows(hybrid_engine_rows):
    off, on = hybrid_engine_rows
    assert off.ok and on.ok, (off, on)
    assert "refused (exit 2)" in on.measured and "GPUs only" in on.measured  # on CPU


@pytest.mark.slow
def test_gpu_check_logprob_gap_rows(gpu_check, hybrid_engine_rows):
    """bf16 on CPU: the sampler's log-probs differ from the training forward's, so the first
    ratio is off 1 with them and exactly 1 with the default recompute."""
    check, s = gpu_check
    gap, recompute, sampler = check.check_logprob_gap(s)
    assert gap.ok and recompute.ok and sampler.ok, (gap, recompute, sampler)
    assert check.first(s.out / "hybrid-off", "ppo/ratio_max") == 1.0
    assert check.first(s.out / "sampler-logprobs", "ppo/ratio_max") > 1.0


@pytest.mark.slow
def test_gpu_check_recipe_rows(gpu_check):
    """The published recipe's PPO step (experiment=opt-1.3b-350m), tiny shapes on CPU: its rows
    report prompts/s, the split of an iteration and the peak memory."""
    check, s = gpu_check
    speed, split, peak = check.check_recipe(s)
    assert speed.ok and split.ok and peak.ok, (speed, split, peak)
    assert "hf rollouts, 32 + 32 tokens" in speed.check
    assert all(f"{part} " in split.measured for part in check.SPLIT)


@pytest.mark.slow
def test_two_rank_zero3_ppo_with_ema_and_ptx_resumes_to_the_uninterrupted_run(gpu_check):
    """ZeRO-3 on 2 ranks with EMA and PTX, killed after the checkpoint at step 3 and resumed:
    every logged row (ppo/unsup_loss sums both ranks' PTX rows, so a rank reading another's
    rows would show) and the EMA export equal the uninterrupted run's; each rank checkpointed
    its own half of the EMA, and trainer.pt holds none of it, only the shared PTX counter."""
    from safetensors.torch import load_file

    check, s = gpu_check
    [row] = check.check_zero3_resume(s)
    assert row.ok, row.measured
    checkpoint = s.out / "zero3-resumed" / "checkpoints" / "step-00000006"
    trainer = torch.load(checkpoint / "trainer.pt", weights_only=True)
    assert "ema" not in trainer and trainer["ptx"] == {"batches": 6}
    actor = load_file(s.out / "pipeline" / "sft" / "model" / "model.safetensors")
    elements = sum(t.numel() for t in actor.values())
    for r in (0, 1):
        part = torch.load(checkpoint / f"ema-rank{r}.pt", weights_only=True)
        held = sum(t.numel() for t in part.values())
        assert elements / 2 <= held < elements / 2 + 2 * len(part)  # half (embeddings tied)
    rows = [r for r in read_metrics(s.out / "zero3-reference") if "ppo/unsup_loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_launch_refuses_lora_dropout_and_a_reward_model_with_another_end_token(tmp_path):
    """The checks run from the config and the model directories, before any model is built."""
    import shutil

    from rlhf.checks.validate import check_launch
    from rlhf.modeling.loading import tiny_model_dir

    actor = tiny_model_dir(ModelConfig(), str(tmp_path / "cache"))
    critic = tmp_path / "reward"
    shutil.copytree(actor, critic)
    config = json.loads((critic / "config.json").read_text())  # as a reward export names itself
    config["architectures"] = ["OPTForSequenceClassification"]
    (critic / "config.json").write_text(json.dumps(config))
    stats = {"mean": 0.0, "std": 1.0, "score_position": "last", "end_of_text_id": 5}
    (critic / "reward_stats.json").write_text(json.dumps(stats))

    def launch(*overrides):
        paths = [f"actor.model.path={actor}", f"critic.model.path={critic}"]
        check_launch(to_config(compose(["step=ppo", *paths, *overrides])))

    with pytest.raises(ConfigError, match=r"critic.model.path=.*reward: the reward model was"):
        launch()
    stats["end_of_text_id"] = 2  # the tiny tokenizer's </s>
    (critic / "reward_stats.json").write_text(json.dumps(stats))
    launch()  # agrees: no error
    with pytest.raises(ConfigError, match=r"^actor.lora.dropout=0.1: expected 0.0"):
        launch("actor.lora.rank=8", "actor.lora.dropout=0.1")
    with pytest.raises(ConfigError, match=r"critic.model.dropout=None keeps .*dropout=0.1"):
        config = json.loads((critic / "config.json").read_text())
        (critic / "config.json").write_text(json.dumps({**config, "dropout": 0.1}))
        launch("critic.model.dropout=null")

"""Step 3's critic-free estimators as configured and wired: the keys' bad values are refused by
name before anything is built; each prompt's answers form a group of contiguous rows, the
advantages come from it (or from a greedy answer: ReMax), no critic is read or trained, the KL
can be a loss term, dynamic sampling keeps the batch size, and the update does not depend on
the micro-batch split whatever the loss aggregation."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rlhf import algos, registry
from rlhf.checks.validate import validated
from rlhf.config import TINY_VOCAB_SIZE, ConfigError, register_configs, to_config
from rlhf.rl.collector import Collector
from rlhf.rl.experience import Experience, make_experience
from rlhf.rl.experience_batch import keep_varied_groups
from rlhf.rl.generation import Sampling, generate
from rlhf.rl.rollouts import HFDecoder
from rlhf.rl.shaping import Shaping
from tests import test_ppo as ppo_tests
from tests.conftest import compose

register_configs()


@pytest.fixture
def PPO(tmp_path):
    """step=ppo on exports of the embedded default (their config.json has the shipped tokenizer's
    vocabulary, as model=tiny asks)."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": TINY_VOCAB_SIZE}))
    return ["step=ppo", f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"]


BAD = [
    (["ppo.advantage.estimator=ppo"], "ppo.advantage.estimator", "'ppo'", "gae, grpo, rloo"),
    (["ppo.advantage.estimator=grpo"], "ppo.rollout.samples_per_prompt", "1", ">= 2 with"),
    (["ppo.rollout.samples_per_prompt=0"], "ppo.rollout.samples_per_prompt", "0", ">= 1"),
    (
        ["ppo.advantage.dynamic_sampling=true"],
        "ppo.advantage.dynamic_sampling",
        "True",
        "grpo, rloo",
    ),
    (
        ["ppo.advantage.estimator=remax", "ppo.rollout.greedy=true"],
        "ppo.rollout.greedy",
        "True",
        "every advantage would be 0",
    ),
    (["ppo.loss.clip_low=1.5"], "ppo.loss.clip_low", "1.5", "[0, 1]"),
    (["ppo.loss.clip_high=-0.1"], "ppo.loss.clip_high", "-0.1", ">= 0"),
    (["ppo.loss.aggregation=sum"], "ppo.loss.aggregation", "'sum'", "seq-mean-token-sum"),
    (["ppo.reward.overlong_buffer=-1"], "ppo.reward.overlong_buffer", "-1", ">= 0"),
    (
        ["ppo.rollout.max_new_tokens=16", "ppo.reward.overlong_buffer=16"],
        "ppo.reward.overlong_buffer",
        "16",
        "fewer tokens than ppo.rollout.max_new_tokens (16)",
    ),
    (
        ["ppo.reward.overlong_buffer=32"],  # the toy's answers: 64 - 32 tokens
        "ppo.reward.overlong_buffer",
        "32",
        "fewer tokens than the answer budget (data.max_seq_len - data.max_prompt_len = 32)",
    ),
    (
        ["ppo.advantage.dynamic_sampling_rounds=-2"],
        "ppo.advantage.dynamic_sampling_rounds",
        "-2",
        ">= 0",
    ),
    (
        [
            "ppo.advantage.estimator=rloo",
            "ppo.rollout.samples_per_prompt=3",
            "ppo.rollout.per_device_batch_size=2",
            "ppo.update.per_device_batch_size=4",
        ],
        "ppo.update.per_device_batch_size",
        "4",
        "rollout.samples_per_prompt (6)",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "key", "value", "accepted"), BAD, ids=[b[0][-1] for b in BAD]
)
def test_bad_estimator_values_are_refused_by_name(PPO, overrides, key, value, accepted):
    with pytest.raises(ConfigError) as err:
        validated(compose([*PPO, *overrides]))
    [line] = [ln for ln in str(err.value).splitlines() if ln.strip().startswith(f"{key}=")]
    assert line.strip().startswith(f"{key}={value}: expected ")
    assert accepted in line


def test_a_group_estimator_with_groups_validates(PPO):
    overrides = ["ppo.advantage.estimator=grpo", "ppo.rollout.samples_per_prompt=4"]
    config = validated(compose([*PPO, *overrides, "ppo.advantage.dynamic_sampling=true"]))
    assert not registry.uses_critic(config.ppo)
    assert registry.uses_critic(validated(compose(PPO)).ppo)  # gae, today's PPO, is the default


def answer_length(prompts: list[str], answers: list[str]) -> list[float]:
    """A rule-based reward for the end-to-end runs (ppo.reward.function=
    tests.test_critic_free:answer_length): the answer's length in characters / 50, which
    differs between most answers, so groups have a spread even from a barely trained model."""
    return [len(answer) / 50 for answer in answers]


# ---------------------------------------------------------------- experience and update wiring
# (tiny random OPTs built here, no DeepSpeed: see tests/test_ppo.py)

PAD, BOS, EOS = ppo_tests.PAD, ppo_tests.BOS, ppo_tests.EOS
CPU = torch.device("cpu")
SHAPING = Shaping(
    kl_coef=0.0,  # ppo.kl.in_loss: the reward is the score alone
    kl_estimator="k3",
    clip_reward_value=10.0,
    gamma=1.0,
    lam=0.95,
    min_response_tokens=1,
    score_position="last",
    reward_stats=None,
    group_size=2,
)
# two prompts, two answers each, in contiguous rows
GROUP_PROMPTS = [[BOS, 5, 6], [BOS, 5, 6], [BOS, 7], [BOS, 7]]
GROUP_RESPONSES = [[12, 13, EOS], [14, EOS], [15, 16, 17, EOS], [18, EOS]]


class LengthReward(torch.nn.Module):
    """A reward model whose score is the sequence's length (prompt + answer)."""

    def forward(self, input_ids, attention_mask):
        return attention_mask.sum(-1, keepdim=True).float().expand(input_ids.shape)


def _group_experience(estimator: str, **shaping) -> Experience:
    rollout = ppo_tests._rollout(GROUP_PROMPTS, GROUP_RESPONSES)
    shaping = replace(SHAPING, estimator=estimator, **shaping)
    actor, reference = ppo_tests._lm(seed=3), ppo_tests._lm(seed=4)
    return make_experience(rollout, actor, reference, None, LengthReward(), shaping, CPU)


def test_grpo_and_rloo_advantages_come_from_each_prompts_group():
    # scores (lengths): 6, 5 for the first prompt; 6, 4 for the second
    mask = ppo_tests._rollout(GROUP_PROMPTS, GROUP_RESPONSES).response_mask
    for estimator, per_answer in (
        ("grpo", [0.5**0.5, -(0.5**0.5), 0.5**0.5, -(0.5**0.5)]),  # +-1 / sqrt(2) both
        ("rloo", [1.0, -1.0, 2.0, -2.0]),  # 6 - 5, 5 - 6, 6 - 4, 4 - 6
    ):
        exp = _group_experience(estimator)
        expected = torch.where(mask, torch.tensor(per_answer).unsqueeze(1), 0.0)
        torch.testing.assert_close(exp.advantages, expected, atol=1e-5, rtol=0)
        assert torch.equal(exp.old_values, torch.zeros_like(exp.old_values))  # no critic
    dr_grpo = _group_experience("grpo", std_normalize=False)
    expected = torch.where(mask, torch.tensor([0.5, -0.5, 1.0, -1.0]).unsqueeze(1), 0.0)
    torch.testing.assert_close(dr_grpo.advantages, expected, atol=1e-5, rtol=0)


def test_reinforce_pp_returns_carry_the_per_token_kl():
    exp = _group_experience("reinforce_pp", kl_coef=0.1, kl_estimator="k1")
    assert exp.kl[exp.response_mask].abs().min() > 0  # actor and reference differ
    expected = algos.discounted_returns(exp.rewards, exp.response_mask, 1.0)
    torch.testing.assert_close(exp.advantages, expected)
    # the return of each first token: the score less 0.1 x the answer's summed KL
    first = exp.scores - 0.1 * algos.masked_sum(exp.kl, exp.response_mask, 1)
    torch.testing.assert_close(exp.advantages[:, 0], first)


def _collector() -> Collector:
    models = SimpleNamespace(
        actor=ppo_tests.Trained(ppo_tests._lm(seed=5)),
        reference=ppo_tests._lm(seed=6),
        critic=None,
        reward=LengthReward(),
        teacher=None,
    )
    cfg = SimpleNamespace(actor=SimpleNamespace(zero=SimpleNamespace(stage=0)))
    rollouts = HFDecoder(cfg, models.actor, PAD, EOS)
    return Collector(models, cfg, PAD, EOS, Sampling(5), rollout_logprobs=False, rollouts=rollouts)


def test_each_prompt_is_answered_by_a_group_of_contiguous_rows():
    prompts = [[BOS, 5, 6, 7], [BOS, 8]]
    exp = _collector()(prompts, replace(SHAPING, estimator="grpo", group_size=3))
    assert exp.sequences.shape[0] == 6
    width = exp.prompt_width
    for row in range(6):
        prompt = exp.sequences[row, :width][exp.attention_mask[row, :width].bool()]
        assert prompt.tolist() == prompts[row // 3]


def test_a_seeded_rollout_repeats_and_leaves_the_process_rng_alone():
    collect, shaping = _collector(), replace(SHAPING, estimator="grpo", group_size=4)
    state = torch.get_rng_state()
    first = collect([[BOS, 5, 6]], shaping, seed=11)
    assert torch.equal(torch.get_rng_state(), state)
    again = collect([[BOS, 5, 6]], shaping, seed=11)
    assert torch.equal(first.sequences, again.sequences)
    assert len({tuple(row.tolist()) for row in first.sequences}) > 1  # the group's answers differ


def test_remax_baseline_is_the_reward_of_a_greedy_answer():
    prompts = [[BOS, 5, 6, 7], [BOS, 8]]
    collect = _collector()
    exp = collect(prompts, replace(SHAPING, estimator="remax", group_size=2))
    greedy = generate(
        collect.models.actor.module, prompts, PAD, EOS, Sampling(5, greedy=True), False
    )
    baselines = greedy.attention_mask.sum(-1).float().repeat_interleave(2)  # LengthReward
    expected = algos.remax_advantages(exp.rewards, baselines, exp.response_mask)
    torch.testing.assert_close(exp.advantages, expected)


def _scored(scores: list[float], first_row: int = 0) -> Experience:
    """An experience whose answers' rewards are ``scores``; sequences hold each row's id."""
    B, R = len(scores), 3
    mask = torch.ones(B, R, dtype=torch.bool)
    rewards = torch.zeros(B, R)
    rewards[:, -1] = torch.tensor(scores)
    zeros = torch.zeros(B, R)
    ids = torch.arange(first_row, first_row + B).unsqueeze(1).expand(B, 4)
    no = torch.zeros(B, dtype=torch.bool)
    return Experience(
        ids, torch.ones(B, 4), 1, mask, zeros, zeros, zeros, torch.tensor(scores), rewards,
        zeros, zeros, zeros, no, no,
    )  # fmt: skip


def test_dynamic_sampling_drops_equal_groups_and_refills_to_the_batch_size():
    first = _scored([1, 1, 0, 1, 2, 2, 3, 4])  # groups of 2: equal, varied, equal, varied
    drawn = []

    def draw(round_):
        drawn.append(round_)
        return _scored([5, 5, 6, 7, 8, 9, 1, 1], first_row=100)

    [batch], stats = keep_varied_groups([first], 2, draw, max_rounds=4)
    assert drawn == [1]  # one round filled it
    assert batch.sequences[:, 0].tolist() == [2, 3, 6, 7, 102, 103, 104, 105]
    assert stats == {"ppo/groups_dropped": 4, "ppo/groups_padded": 0, "ppo/sampling_rounds": 1}


def test_dynamic_sampling_pads_with_equal_groups_when_its_rounds_run_out():
    first = _scored([1, 1, 0, 1, 2, 2, 3, 4])
    [batch], stats = keep_varied_groups(
        [first], 2, lambda round_: _scored([5] * 8, first_row=100), max_rounds=1
    )
    assert len(batch.scores) == 8  # the batch size is kept
    assert batch.sequences[:, 0].tolist() == [2, 3, 6, 7, 0, 1, 4, 5]
    assert stats == {"ppo/groups_dropped": 4, "ppo/groups_padded": 2, "ppo/sampling_rounds": 1}


def _update_config(*overrides):
    return to_config(
        compose(
            [
                "step=sft",
                "ppo.advantage.estimator=grpo",
                "ppo.rollout.samples_per_prompt=2",
                "ppo.kl.in_loss=true",
                "ppo.kl.estimator=k3",
                *overrides,
            ]
        )
    )


def test_a_critic_free_update_has_no_critic_and_adds_the_kl_loss_term():
    from rlhf.steps import ppo_update as ppo_recipe
    from rlhf.steps.loop import NonFiniteGuard

    exp = _group_experience("grpo")
    models = SimpleNamespace(actor=ppo_tests.Trained(ppo_tests._lm(seed=3)), critic=None)
    cfg = _update_config("ppo.loss.aggregation=token-mean")
    out = ppo_recipe.train_step(models, [exp], cfg, None, NonFiniteGuard(3), 0.1)
    assert out["critic_loss_sum"] == 0.0
    # the actor is the rollout's (seed 3): its log-probs are the old ones
    kl = algos.kl_loss(exp.old_logprobs, exp.ref_logprobs, exp.response_mask, "k3")
    assert out["kl_loss_sum"] == pytest.approx(kl.item() * exp.response_mask.sum().item(), rel=1e-5)
    assert out["kl_loss_sum"] > 0


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_update_is_the_same_whatever_the_micro_batch_split(aggregation):
    from rlhf.steps import ppo_update as ppo_recipe
    from rlhf.steps.loop import NonFiniteGuard

    exp = _group_experience("grpo")
    cfg = _update_config(f"ppo.loss.aggregation={aggregation}")

    def grads(micro):
        actor = ppo_tests.Trained(ppo_tests._lm(seed=3))
        models = SimpleNamespace(actor=actor, critic=None)
        ppo_recipe.train_step(models, micro, cfg, None, NonFiniteGuard(3), 0.1)
        return [p.grad for p in actor.parameters() if p.grad is not None]

    whole = grads([exp])
    split = grads([exp.rows(torch.tensor([0, 1])), exp.rows(torch.tensor([2, 3]))])
    assert whole
    for g, h in zip(whole, split, strict=True):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------- algo options and the sweep


def test_a_critic_free_run_with_a_rule_reward_needs_no_critic_path():
    """critic.model.path names the critic's start (GAE) or the reward model; GRPO scored by a
    function reads neither, so it is not asked for, and GAE still is."""
    actor = ["step=ppo", "actor.model.path=/tmp", "ppo.reward.function=toy_gold"]
    config = validated(compose([*actor, "algo=grpo"]))
    assert config.critic.model.path is None and not registry.reads_critic_path(config)
    with pytest.raises(ConfigError, match=r"critic.model.path=None: expected a model directory"):
        validated(compose(actor))  # GAE trains a critic from it
    with pytest.raises(ConfigError, match=r"critic.model.path=None: expected a model directory"):
        validated(compose(["step=ppo", "actor.model.path=/tmp", "algo=grpo"]))  # reward model


@pytest.mark.parametrize(
    ("algo", "estimator", "critic_free"),
    [
        ("ppo", "gae", False),
        ("grpo", "grpo", True),
        ("dr_grpo", "grpo", True),
        ("dapo", "grpo", True),
        ("rloo", "rloo", True),
        ("reinforce_pp", "reinforce_pp", True),
        ("reinforce_pp_baseline", "reinforce_pp_baseline", True),
        ("remax", "remax", True),
        ("gspo", "grpo", True),
        ("cispo", "grpo", True),
    ],
)
def test_each_rl_algo_option_sets_its_estimator_and_runs_the_rl_pipeline(
    PPO, algo, estimator, critic_free
):
    config = validated(compose([f"algo={algo}", *PPO]))
    assert config.ppo.advantage.estimator == estimator
    assert registry.uses_critic(config.ppo) is not critic_free
    assert config.pipeline.steps == ["sft", "reward", "ppo"]
    # PPO's 32 answers a rollout; GRPO's 32 prompts x 4 in one update (conf/algo_tuning/tiny)
    ppo = config.ppo
    answers = 128 if algo in ("grpo", "dr_grpo") else 32
    assert ppo.rollout.per_device_batch_size * ppo.rollout.samples_per_prompt == answers


def test_dr_grpo_and_dapo_change_grpo_where_their_papers_do(PPO):
    grpo, dr, dapo = (
        validated(compose([f"algo={a}", *PPO])).ppo for a in ("grpo", "dr_grpo", "dapo")
    )
    assert (grpo.advantage.std_normalize, dr.advantage.std_normalize) == (True, False)
    assert (grpo.loss.aggregation, dr.loss.aggregation) == (
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    )
    assert dr.kl.in_loss and dr.kl.coef == grpo.kl.coef  # the rest is GRPO's
    assert (dapo.loss.clip_range, dapo.loss.clip_high, dapo.kl.coef) == (0.2, 0.28, 0.0)
    assert dapo.advantage.dynamic_sampling and dapo.reward.overlong_buffer > 0
    assert dapo.loss.aggregation == "token-mean"


@pytest.mark.parametrize("algo", ["grpo", "dr_grpo", "gspo", "cispo"])
def test_the_grpo_family_keeps_empty_answers_in_its_loss(algo, PPO):
    """Masked, an empty answer costs nothing: GRPO drifted to them on data=toy_tools."""
    ppo = validated(compose([f"algo={algo}", *PPO])).ppo
    assert ppo.reward.short_answer_penalty == 1.0 and ppo.rollout.min_response_tokens == 2


def test_dapos_overlong_buffer_is_a_fifth_of_the_answer_budget_unless_given(tmp_path):
    from rlhf.config import Config
    from rlhf.config.resolve import Facts, resolve_ppo

    def overlong_buffer(buffer, budget: int) -> int:  # as rlhf.config.resolve decides it
        cfg = Config()
        cfg.ppo.rollout.max_new_tokens, cfg.ppo.reward.overlong_buffer = budget, buffer
        resolve_ppo(cfg, Facts())
        return cfg.ppo.reward.overlong_buffer

    assert (overlong_buffer(None, 256), overlong_buffer(None, 32), overlong_buffer(8, 32)) == (
        51,
        6,
        8,
    )
    paths = [f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"]
    real = validated(compose(["algo=dapo", "step=ppo", "model=opt-1.3b", *paths]))
    assert real.ppo.reward.overlong_buffer is None  # a real model on the toy's 32-token answers: 6


def test_the_algos_sweep_composes_each_algorithm_on_the_same_start():
    from tests.conftest import compose_sweep, sweep_axes

    [algos] = sweep_axes("algos").values()
    assert algos == [
        "ppo",
        "grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "remax",
        "gspo",
        "cispo",
        "dpo",
    ]
    starts = set()
    for algo in algos:
        job = validated(compose_sweep("algos", [f"algo={algo}"]))
        assert job.step.name == "all"
        assert job.pipeline.steps == (["sft", "dpo"] if algo == "dpo" else ["sft", "reward", "ppo"])
        starts.add((job.seed, job.data.seed, repr(job.sft), repr(job.model)))
    assert len(starts) == 1  # one SFT start: same seed, data, SFT settings and model

"""ppo.update.micro_batch_tokens and ppo.update.balance_ranks: an optimizer step's rows cut into
micro batches by a token budget, and dealt over the ranks by their tokens, give the update of
fixed per_device_batch_size rows (weights, critic, every logged stat) for every advantage
estimator and policy loss; each micro batch is computed at its own width; PTX still draws
grad_accum batches a step. The ZeRO-3 two-rank check is test_a_zero3_update_on_two_ranks_*."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rlhf import registry
from rlhf.checks.validate import validated
from rlhf.config import ConfigError
from rlhf.data.sampling import budget_micro_batches
from rlhf.rl.experience import make_experience, response_logprobs
from rlhf.rl.micro_batches import step_shares, trimmed
from rlhf.runtime.dist import free_port
from rlhf.steps.loop import NonFiniteGuard, TrainState
from rlhf.steps.ppo_update import ppo_update
from tests import test_ppo as ppo_tests
from tests.conftest import REPO, compose
from tests.test_critic_free import (
    CPU,
    GROUP_PROMPTS,
    GROUP_RESPONSES,
    PPO,
    SHAPING,
    LengthReward,
)
from tests.test_on_policy_shortcut import CASES, _config, _update, assert_same_update

# one step of 4 rows: 4 micro batches of 1 row, or by tokens (rows of 4-6 tokens) 2 of 2 rows
FIXED = ("ppo.update.per_device_batch_size=1", "ppo.update.grad_accum=4")
LAYOUTS = {
    "tokens": ("ppo.update.micro_batch_tokens=12",),
    "balanced": ("ppo.update.balance_ranks=true",),
    "tokens+balanced": ("ppo.update.micro_batch_tokens=12", "ppo.update.balance_ranks=true"),
    # rows packed end to end into bins of the rollout's width, bins grouped by the budget
    "tokens+packed": ("ppo.update.micro_batch_tokens=12", "ppo.update.packing=true"),
}
POLICY_CASES = [
    ("grpo", ("ppo.loss.policy=gspo",)),
    ("grpo", ("ppo.loss.policy=cispo",)),
    ("grpo", ("ppo.loss.aggregation=seq-mean-token-sum-norm",)),
    ("gae", ("ppo.update.epochs=2", "ppo.kl.in_loss=false")),  # two steps, each reshuffled
    ("grpo", ("ppo.kl.estimator=full",)),  # the reference's logits per micro batch
]
ALL = CASES + POLICY_CASES
__all__ = ["PPO"]  # the fixture, used by name below


def _same_update(a, b) -> None:
    """Weights within float rounding (two SGD steps of a ratio up to ~300 amplify it)."""
    assert_same_update(a, b, atol=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("estimator", "extra"), ALL, ids=[f"{n}{''.join(e)}" for n, e in ALL])
def test_micro_batches_by_tokens_or_dealt_by_tokens_make_the_fixed_rows_update(
    estimator, extra, layout
):
    fixed = _update(estimator, False, *extra, *FIXED)
    other = _update(estimator, False, *extra, *FIXED, *LAYOUTS[layout])
    moved = [
        (p - q).abs().max().item()
        for p, q in zip(fixed.actor.parameters(), ppo_tests._lm(seed=3).parameters(), strict=True)
    ]
    assert max(moved) > 1e-3  # the update did something to compare
    steps = 2 if "ppo.update.epochs=2" in extra else 1
    assert fixed.actor.boundaries == [False, False, False, True] * steps
    if "tokens" in layout:  # fewer, fuller passes
        assert other.actor.boundaries == [False, True] * steps
    _same_update(fixed, other)


def test_the_on_policy_shortcut_fills_the_old_logprobs_of_micro_batches_by_tokens():
    full = _update("grpo", False, *FIXED, *LAYOUTS["tokens"])
    short = _update("grpo", True, *FIXED, *LAYOUTS["tokens"])
    _same_update(full, short)
    mask = full.exp.response_mask.bool()
    for name in ("old_logprobs", "kl"):
        torch.testing.assert_close(
            getattr(short.exp, name)[mask], getattr(full.exp, name)[mask], atol=1e-5, rtol=1e-5
        )
    assert torch.isfinite(short.exp.old_logprobs).all()  # trimmed columns filled, not NaN


class CountedPTX:
    """A PTX stand-in whose loss is a function of the actor, counting its batches."""

    def __init__(self):
        self.drawn = 0

    def loss(self, actor) -> torch.Tensor:
        self.drawn += 1
        return sum(p.square().mean() for p in actor.parameters()) * (1 + 0.1 * self.drawn)


def test_ptx_draws_grad_accum_batches_a_step_however_many_micro_batches():
    grads = {}
    for layout in ("fixed", "tokens"):
        cfg = _config("grpo", False, *FIXED, *(LAYOUTS["tokens"] if layout == "tokens" else ()))
        rollout = ppo_tests._rollout(GROUP_PROMPTS, GROUP_RESPONSES)
        models = (ppo_tests._lm(seed=3), ppo_tests._lm(seed=4), None, LengthReward())
        exp = make_experience(rollout, *models, SHAPING, CPU)
        actor, ptx = ppo_tests.Trained(ppo_tests._lm(seed=3)), CountedPTX()
        trained = SimpleNamespace(actor=actor, critic=None, reference=models[1])
        stats = ppo_update(trained, exp, cfg, TrainState(), ptx, NonFiniteGuard(3), 0.1)
        assert ptx.drawn == 4  # grad_accum
        grads[layout] = ([p.grad for p in actor.parameters()], stats["ppo/unsup_loss"])
    assert grads["tokens"][1] == pytest.approx(grads["fixed"][1], rel=1e-6)
    for g, h in zip(*(grads[k][0] for k in ("fixed", "tokens")), strict=True):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)


def test_a_trimmed_micro_batch_drops_only_padding_and_keeps_its_log_probs():
    rollout = ppo_tests._rollout(GROUP_PROMPTS, GROUP_RESPONSES)
    lm = ppo_tests._lm(seed=3)
    exp = make_experience(rollout, lm, ppo_tests._lm(seed=4), None, LengthReward(), SHAPING, CPU)
    short = exp.rows(torch.tensor([1, 3]))  # [BOS 5 6][14 EOS] and [pad BOS 7][18 EOS]
    cut = trimmed(short)
    assert cut.prompt_width == 3 and cut.response_mask.shape[1] == 2  # answers of 2 of 4 columns
    cut_left = trimmed(exp.rows(torch.tensor([3])))  # [pad BOS 7]: the pad column goes
    assert cut_left.prompt_width == 2 and cut_left.sequences[0].tolist() == [
        ppo_tests.BOS,
        7,
        18,
        ppo_tests.EOS,
    ]
    for part in (cut, cut_left):
        with torch.no_grad():
            logprobs, _ = response_logprobs(
                lm, part.sequences, part.attention_mask, part.prompt_width - 1
            )
        mask = part.response_mask.bool()
        torch.testing.assert_close(logprobs[mask], part.old_logprobs[mask], atol=1e-5, rtol=1e-5)


def test_ranks_deal_a_steps_rows_by_tokens_each_row_once_in_equal_counts():
    g = torch.Generator().manual_seed(0)
    rows, world = 16, 2
    lengths = torch.randint(4, 200, (rows * world,), generator=g).tolist()
    step_rows = torch.randperm(rows, generator=g)[:8].tolist()
    own = step_shares(step_rows, lengths, rows, world, balance=False)
    assert own == [step_rows, [rows + i for i in step_rows]]
    dealt = step_shares(step_rows, lengths, rows, world, balance=True)
    assert sorted(i for share in dealt for i in share) == sorted(i for share in own for i in share)
    assert [len(s) for s in dealt] == [8, 8]
    tokens = [sum(lengths[i] for i in share) for share in dealt]
    unbalanced = [sum(lengths[i] for i in share) for share in own]
    assert abs(tokens[0] - tokens[1]) <= max(lengths)  # within one row of each other
    assert abs(tokens[0] - tokens[1]) <= abs(unbalanced[0] - unbalanced[1])
    # by tokens, both ranks then run as many micro batches as the busier one needs
    by_rank = [[lengths[i] for i in share] for share in dealt]
    counts = {len(budget_micro_batches(by_rank, r, 400)) for r in range(world)}
    assert len(counts) == 1


@pytest.mark.slow
def test_a_zero3_update_on_two_ranks_is_the_same_for_every_estimator_and_layout(tiny_lm_dir):
    """ZeRO-3, every parameter partitioned, 2 ranks whose rollouts differ in length: one PPO
    update (two optimizer steps) from the same weights, fixed rows against micro batches by
    tokens, dealt by tokens, and both, for every estimator: the same weights and stats."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    worker = REPO / "tests" / "ppo_update_worker.py"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*launcher, "--master_port", str(free_port()), str(worker), str(tiny_lm_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = sorted(line for line in proc.stdout.splitlines() if " ok: " in line)
    assert [line.split(" ok: ")[0] for line in lines] == ["rank 0", "rank 1"], proc.stdout
    estimators = sorted(n for n, e in registry.ESTIMATORS.items() if not e.teacher)
    for line in lines:
        assert f"estimators {','.join(estimators)}" in line, line
        # the layouts differ: other micro batches, rows trained on the rank that did not draw them
        plan = dict(re.findall(r"(\S+) (\[[\d, ]+\] foreign \d+)", line.split("first step: ")[1]))
        assert plan["fixed"] == "[2, 2] foreign 0", line
        assert plan["tokens"].startswith("[1, 1, 1, 1]"), line  # rank 1's long rows alone
        assert not plan["balanced"].endswith("foreign 0"), line
        assert not plan["tokens+balanced"].endswith("foreign 0"), line


def test_a_budget_below_one_token_is_refused_in_one_line_naming_the_key(PPO):
    with pytest.raises(ConfigError) as err:
        validated(compose([*PPO, "ppo.update.micro_batch_tokens=0"]))
    assert "ppo.update.micro_batch_tokens=0: expected null (fixed rows) or an integer >= 1" in str(
        err.value
    )
    assert validated(compose([*PPO, "ppo.update.micro_batch_tokens=4096"]))

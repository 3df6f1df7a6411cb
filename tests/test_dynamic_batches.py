"""optim.dynamic_batch: micro batches cut by a token budget instead of a row count hold every
row of the step once, stay within the budget, agree in number on every rank, and give the same
update as DeepSpeed-Chat's fixed micro batches (fp32, within 1e-5)."""

from types import SimpleNamespace

import pytest
import torch

from rlhf.data.collate import sft_batch
from rlhf.data.packing import packed_batch
from rlhf.data.sampling import EpochPlan, budget_groups, budget_micro_batches, split_groups
from rlhf.steps import reward as reward_step
from rlhf.steps import sft as sft_step
from rlhf.steps.loop import NonFiniteGuard
from tests.test_fast_paths import PAD, random_rows, tiny_lm, tiny_scorer

MICRO, GRAD_ACCUM, MAX_LEN = 4, 3, 48


class AccumulatingEngine(torch.nn.Module):
    """What train_step asks of a DeepSpeed engine on one rank: backward divides the loss by
    grad_accum (DeepSpeed's scale_wrt_gas) and accumulates; the boundaries are recorded."""

    def __init__(self, module: torch.nn.Module, grad_accum: int):
        super().__init__()
        self.module, self.grad_accum, self.boundaries = module, grad_accum, []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> None:
        pass

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.boundaries.append(is_boundary)

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in self.module.named_parameters() if p.grad is not None}


def check_micro_batches(micro, lengths, budget, capacity=None):
    rows = sorted(i for bins in micro for b in bins for i in b)
    assert rows == list(range(len(lengths)))  # every row once
    for bins in micro:
        sizes = [sum(lengths[i] for i in b) for b in bins]
        assert len(bins) == 1 or len(bins) * max(sizes) <= budget
        if capacity:
            assert all(s <= capacity for s in sizes)
        else:
            assert all(len(b) == 1 for b in bins)


@pytest.mark.parametrize("capacity", [None, MAX_LEN])
def test_budget_micro_batches_hold_every_row_once_within_budget_on_every_rank(capacity):
    g = torch.Generator().manual_seed(0)
    by_rank = [torch.randint(2, MAX_LEN + 1, (24,), generator=g).tolist() for _ in range(2)]
    by_rank[1] = [2] * 24  # short rows: this rank alone would need a single micro batch
    budget = MICRO * MAX_LEN
    micro = [budget_micro_batches(by_rank, r, budget, capacity) for r in range(2)]
    assert len(micro[0]) == len(micro[1]) > 1  # the same number of passes on both ranks
    for r in range(2):
        check_micro_batches(micro[r], by_rank[r], budget, capacity)
    alone = budget_micro_batches(by_rank[1:], 0, budget, capacity)
    assert len(alone) == 1  # ... which rank 1 split to match rank 0


def test_budget_groups_put_short_rows_together_and_long_rows_alone():
    assert budget_groups([10, 40, 10, 10, 10, 60], budget=40) == [[5], [1], [0, 2, 3, 4]]


def test_split_groups_halves_the_largest_then_splits_bins():
    assert split_groups([[[0], [1], [2], [3]]], 3) == [[[0]], [[1]], [[2], [3]]]
    assert split_groups([[[0, 1, 2]]], 2) == [[[0]], [[1, 2]]]
    with pytest.raises(ValueError, match="cannot split"):
        split_groups([[[0]]], 2)


def sft_grads(micro_batches):
    engine = AccumulatingEngine(tiny_lm(seed=4).train(), GRAD_ACCUM)
    shape = SimpleNamespace(world_size=1, grad_accum=GRAD_ACCUM)
    guard = NonFiniteGuard(3, engine)
    nll, targets, tokens = sft_step.train_step(engine, micro_batches, shape, False, guard)
    return engine, nll / targets, tokens, engine.grads()


@pytest.mark.parametrize("packing", [False, True])
def test_a_dynamic_sft_step_gives_the_fixed_steps_loss_and_gradients(packing):
    rows = random_rows(MICRO * GRAD_ACCUM, seed=3)
    fixed = [sft_batch(rows[k::GRAD_ACCUM], PAD, False) for k in range(GRAD_ACCUM)]
    lengths = [len(r["prompt_ids"]) + len(r["chosen_ids"]) for r in rows]
    micro = budget_micro_batches([lengths], 0, MICRO * MAX_LEN, MAX_LEN if packing else None)
    if packing:
        dynamic = [packed_batch(rows, bins, PAD, False) for bins in micro]
    else:
        dynamic = [sft_batch([rows[i] for b in bins for i in b], PAD, False) for bins in micro]
    assert len(dynamic) < GRAD_ACCUM  # fewer, fuller passes
    _, loss_f, tokens_f, grads_f = sft_grads(fixed)
    engine, loss_d, tokens_d, grads_d = sft_grads(dynamic)
    assert engine.boundaries == [False] * (len(dynamic) - 1) + [True]
    assert tokens_d == tokens_f
    assert loss_d == pytest.approx(loss_f, abs=1e-5)
    for name, grad in grads_f.items():
        torch.testing.assert_close(grads_d[name], grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_a_dynamic_reward_step_gives_the_fixed_steps_loss_and_gradients(share_prompt):
    rows = random_rows(MICRO * GRAD_ACCUM, seed=6)
    reward = SimpleNamespace(loss="pairwise", margin=0.0, score_position="last", share_prompt=False)
    cfg = SimpleNamespace(
        reward=reward,
        data=SimpleNamespace(pad_to_max_len=False, max_seq_len=MAX_LEN),
        optim=SimpleNamespace(micro_batch_size=MICRO),
    )
    lengths = [
        len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows
    ]
    budget = MICRO * MAX_LEN
    if share_prompt:  # as the reward step sizes a shared row
        lengths = [
            sum(len(r[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")) for r in rows
        ]
        budget *= 2
    micro = budget_micro_batches([lengths], 0, budget)
    layouts = {
        "fixed": [rows[k::GRAD_ACCUM] for k in range(GRAD_ACCUM)],
        "dynamic": [[rows[i] for b in bins for i in b] for bins in micro],
    }
    assert len(layouts["dynamic"]) < GRAD_ACCUM
    assert len({len(m) for m in layouts["dynamic"]}) > 1  # unequal micro batches get weighted
    out = {}
    for name, micro_rows in layouts.items():
        reward.share_prompt = share_prompt and name == "dynamic"
        engine = AccumulatingEngine(tiny_scorer(seed=2).train(), GRAD_ACCUM)
        guard = NonFiniteGuard(3, engine)
        loss, accuracy, _ = reward_step.train_step(engine, micro_rows, cfg, PAD, guard)
        out[name] = loss, accuracy, engine.grads()
    assert out["dynamic"][0] == pytest.approx(out["fixed"][0], abs=1e-5)
    assert out["dynamic"][1] == out["fixed"][1]
    for name, grad in out["fixed"][2].items():
        torch.testing.assert_close(out["dynamic"][2][name], grad, atol=1e-5, rtol=0)


def test_every_rank_of_a_plan_reads_its_rows_once():
    plan = EpochPlan(48, MICRO, 2, GRAD_ACCUM, seed=1, lengths=tuple(range(48)))
    rows = [plan.rank_rows(0, 1, r) for r in range(2)]
    assert len(rows[0]) == len(rows[1]) == MICRO * GRAD_ACCUM
    assert not set(rows[0]) & set(rows[1])


def test_a_plans_budget_micro_batches_cover_each_ranks_rows_with_equal_counts():
    sizes = tuple((7 * i) % MAX_LEN + 2 for i in range(48))
    plan = EpochPlan(48, MICRO, 2, GRAD_ACCUM, seed=1, lengths=sizes)
    out = [plan.budget_micro_batches(0, 1, r, sizes, MICRO * MAX_LEN) for r in range(2)]
    assert len(out[0][1]) == len(out[1][1])
    for r, (rows, micro) in enumerate(out):
        assert rows == plan.rank_rows(0, 1, r)
        check_micro_batches(micro, [sizes[i] for i in rows], MICRO * MAX_LEN)

"""Which rows each rank reads (EpochPlan, eval_shards), SFT batches and their labels, and the
loss scale that makes the update independent of rank count and gradient accumulation."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from rlhf.algos import causal_lm_nll_sum, token_loss_scale
from rlhf.data.collate import IGNORE_INDEX, count_targets, sft_batch
from rlhf.data.sampling import EpochPlan, eval_shards

PLANS = [  # (num_rows, micro, world, grad_accum)
    (100, 4, 2, 1),
    (100, 3, 2, 2),
    (257, 2, 4, 3),
    (64, 8, 1, 2),
]


@pytest.mark.parametrize(("num_rows", "micro", "world", "accum"), PLANS)
def test_ranks_together_read_what_one_process_reads(num_rows, micro, world, accum):
    plan = EpochPlan(num_rows, micro, world, accum, seed=7)
    single = EpochPlan(num_rows, micro * world, 1, accum, seed=7)
    assert plan.steps_per_epoch == single.steps_per_epoch > 0
    for epoch, step in itertools.product(range(2), range(plan.steps_per_epoch)):
        per_rank = [plan.micro_batches(epoch, step, r) for r in range(world)]
        reference = single.micro_batches(epoch, step, 0)
        assert len(reference) == accum
        for k in range(accum):
            union = [i for r in range(world) for i in per_rank[r][k]]
            assert all(len(per_rank[r][k]) == micro for r in range(world))
            assert len(set(union)) == len(union)  # ranks never share a row
            assert set(union) == set(reference[k])


@pytest.mark.parametrize(("num_rows", "micro", "world", "accum"), PLANS)
def test_grouped_by_length_ranks_read_the_same_rows_with_about_equal_tokens(
    num_rows, micro, world, accum
):
    """With lengths (data.group_by_length) a step holds the same rows as without, and each
    micro step's rows are dealt so that no rank holds more tokens than another by more than a
    row's length: dealt in contiguous slices of the sorted rows, rank 0 held all the longest."""
    generator = torch.Generator().manual_seed(num_rows)
    lengths = tuple(int(n) for n in torch.randint(5, 250, (num_rows,), generator=generator))
    plan = EpochPlan(num_rows, micro, world, accum, seed=7, lengths=lengths)
    ungrouped = EpochPlan(num_rows, micro, world, accum, seed=7)
    for step in range(plan.steps_per_epoch):
        per_rank = [plan.micro_batches(0, step, r) for r in range(world)]
        step_rows = {i for r in range(world) for batch in per_rank[r] for i in batch}
        assert step_rows == {i for r in range(world) for i in ungrouped.rank_rows(0, step, r)}
        for k in range(accum):
            shares = [per_rank[r][k] for r in range(world)]
            assert all(len(share) == micro for share in shares)
            assert all(share == sorted(share, key=lambda i: -lengths[i]) for share in shares)
            tokens = [sum(lengths[i] for i in share) for share in shares]
            assert max(tokens) - min(tokens) <= max(lengths[i] for share in shares for i in share)


@pytest.mark.parametrize(("num_rows", "micro", "world", "accum"), PLANS)
def test_each_row_at_most_once_per_epoch(num_rows, micro, world, accum):
    plan = EpochPlan(num_rows, micro, world, accum, seed=3)
    for epoch in range(3):
        seen = [
            i
            for step in range(plan.steps_per_epoch)
            for r in range(world)
            for batch in plan.micro_batches(epoch, step, r)
            for i in batch
        ]
        assert len(seen) == plan.steps_per_epoch * plan.global_batch_size
        assert len(set(seen)) == len(seen)
        assert all(0 <= i < num_rows for i in seen)
        # only the incomplete last global batch is left out
        assert num_rows - len(seen) < plan.global_batch_size


def test_steps_per_epoch_counts_full_global_batches_only():
    assert EpochPlan(100, 4, 2, 3, seed=0).steps_per_epoch == 4  # 100 // 24
    assert EpochPlan(23, 4, 2, 3, seed=0).steps_per_epoch == 0
    assert EpochPlan(24, 4, 2, 3, seed=0).global_batch_size == 24


def test_epochs_and_seeds_shuffle_differently_but_deterministically():
    plan = EpochPlan(200, 4, 2, 1, seed=11)
    first = [plan.micro_batches(0, s, 0) for s in range(5)]
    assert first == [plan.micro_batches(0, s, 0) for s in range(5)]  # a pure function
    assert first != [plan.micro_batches(1, s, 0) for s in range(5)]
    assert not torch.equal(plan.permutation(0), plan.permutation(1))
    other_seed = EpochPlan(200, 4, 2, 1, seed=12)
    assert not torch.equal(plan.permutation(0), other_seed.permutation(0))
    assert sorted(plan.permutation(1).tolist()) == list(range(200))


@pytest.mark.parametrize("num_rows", [0, 1, 2, 5, 16, 17, 33, 100])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_eval_shards_cover_every_row_once_with_equal_batch_counts(num_rows, world, batch_size):
    shards = [eval_shards(num_rows, batch_size, world, r) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # ZeRO-3: every rank runs the same forwards
    valid_rows = []
    for rank_shards in shards:
        for indices, valid in rank_shards:
            assert 1 <= len(indices) == len(valid) <= batch_size
            assert all(0 <= i < max(num_rows, 1) for i in indices)
            # no padding up to the batch size: a placeholder row only where a rank has none
            assert all(valid) or (indices, valid) == ([0], [False])
            valid_rows += [i for i, ok in zip(indices, valid) if ok]
    assert sorted(valid_rows) == list(range(num_rows))


def test_eval_shards_hold_only_real_rows_where_every_rank_has_some():
    # 2 held-out prompts on 2 ranks: one row each, where batches padded to 64 rows decoded 63
    # placeholders a rank
    assert [eval_shards(2, 64, 2, r) for r in range(2)] == [[([0], [True])], [([1], [True])]]
    assert eval_shards(3, 64, 2, 1) == [([1], [True])]
    assert eval_shards(5, 2, 2, 1) == [([1, 3], [True, True]), ([0], [False])]


def _row(prompt, chosen):
    return {"prompt_ids": prompt, "chosen_ids": chosen}


ROWS = [_row([2, 10, 11], [20, 21, 2]), _row([2, 12], [22, 2]), _row([2, 13, 14, 15], [2])]
PAD = 1


def test_sft_batch_pads_right_and_masks_padding():
    batch = sft_batch(ROWS, PAD, loss_on_prompt=True)
    assert batch["input_ids"].tolist() == [
        [2, 10, 11, 20, 21, 2],
        [2, 12, 22, 2, PAD, PAD],
        [2, 13, 14, 15, 2, PAD],
    ]
    assert batch["attention_mask"].tolist() == [
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
    ]
    x = IGNORE_INDEX
    assert batch["labels"].tolist() == [
        [2, 10, 11, 20, 21, 2],
        [2, 12, 22, 2, x, x],
        [2, 13, 14, 15, 2, x],
    ]
    # the first position predicts nothing: 5 + 3 + 4 targets
    assert count_targets(batch["labels"]) == 12


def test_sft_batch_excludes_the_prompt_unless_loss_on_prompt():
    batch = sft_batch(ROWS, PAD, loss_on_prompt=False)
    x = IGNORE_INDEX
    assert batch["labels"].tolist() == [
        [x, x, x, 20, 21, 2],
        [x, x, 22, 2, x, x],
        [x, x, x, x, 2, x],
    ]
    assert count_targets(batch["labels"]) == 3 + 2 + 1 == sum(len(r["chosen_ids"]) for r in ROWS)


def test_padding_with_a_real_token_id_never_counts():
    # LLaMA-style: pad id == EOS id. Labels must follow the attention mask, not the id.
    rows = [_row([5, 6], [7, 3]), _row([5], [3])]
    batch = sft_batch(rows, pad_id=3, loss_on_prompt=True)
    assert batch["labels"].tolist() == [[5, 6, 7, 3], [5, 3, IGNORE_INDEX, IGNORE_INDEX]]
    assert count_targets(batch["labels"]) == 3 + 1


def test_token_loss_scale():
    assert token_loss_scale(100, 1, 1) == pytest.approx(1 / 100)
    assert token_loss_scale(100, 4, 2) == pytest.approx(8 / 100)
    assert token_loss_scale(0, 2, 1) == 2.0  # no targets: no division by zero


def _micro_batches(seed: int, sizes: list[tuple[int, int]], vocab: int):
    """Random SFT micro batches: (rows, max answer length) each, varying answer lengths."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rows, width in sizes:
        batch = []
        for _ in range(rows):
            prompt = torch.randint(3, vocab, (int(torch.randint(1, 4, (1,), generator=gen)),))
            answer = torch.randint(
                3, vocab, (int(torch.randint(1, width + 1, (1,), generator=gen)),)
            )
            batch.append(_row(prompt.tolist(), answer.tolist()))
        out.append(sft_batch(batch, PAD, loss_on_prompt=False))
    return out


def test_normalised_gradient_equals_the_global_token_mean_gradient():
    """2 simulated ranks x 2 accumulation steps with different token counts. DeepSpeed divides
    the loss by grad_accum in backward and averages gradients over ranks; with the
    token_loss_scale factor the result is the gradient of (all token losses) / (all tokens)."""
    vocab, dim, world, accum = 11, 5, 2, 2
    torch.manual_seed(0)
    embed = torch.nn.Embedding(vocab, dim)
    head = torch.nn.Linear(dim, vocab)
    params = [*embed.parameters(), *head.parameters()]

    def nll_sum(batch):
        logits = head(embed(batch["input_ids"]))  # (B, T, V)
        return causal_lm_nll_sum(logits, batch["labels"])

    ranks = [
        _micro_batches(1, [(3, 6), (1, 2)], vocab),  # rank 0: few tokens
        _micro_batches(2, [(4, 9), (5, 8)], vocab),  # rank 1: many more
    ]
    counts = [[count_targets(b["labels"]) for b in micro] for micro in ranks]
    assert sum(counts[0]) != sum(counts[1])
    global_targets = sum(map(sum, counts))

    # reference: one big mean over every target token of the global batch
    reference = torch.autograd.grad(
        sum(nll_sum(b) for micro in ranks for b in micro) / global_targets, params
    )

    # what the engine does: each rank backprops nll * scale / accum per micro batch, summed,
    # then gradients are averaged over ranks
    scale = token_loss_scale(global_targets, world, accum)
    per_rank = []
    for micro in ranks:
        grads = [torch.zeros_like(p) for p in params]
        for batch in micro:
            step = torch.autograd.grad(nll_sum(batch) * scale / accum, params)
            grads = [g + s for g, s in zip(grads, step)]
        per_rank.append(grads)
    averaged = [(a + b) / world for a, b in zip(*per_rank)]
    for got, want in zip(averaged, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)

    # and it is not what a per-rank mean would give (the test can tell the difference)
    naive = [
        sum(g)
        for g in zip(
            *(
                torch.autograd.grad(sum(nll_sum(b) for b in micro) / sum(count) / world, params)
                for micro, count in zip(ranks, counts)
            )
        )
    ]
    assert not torch.allclose(naive[-1], reference[-1], rtol=1e-3)


def test_sft_loss_ignores_prompt_and_padding_logits():
    """Changing logits at prompt or padding positions leaves the summed SFT loss unchanged."""
    batch = sft_batch(ROWS, PAD, loss_on_prompt=False)
    torch.manual_seed(0)
    logits = torch.randn(*batch["input_ids"].shape, 30)
    base = causal_lm_nll_sum(logits, batch["labels"])
    # position t predicts label t+1: positions whose next label is ignored do not matter
    predicts_nothing = F.pad(batch["labels"][:, 1:] == IGNORE_INDEX, (0, 1), value=True)
    noisy = torch.where(predicts_nothing[..., None], torch.randn_like(logits) * 10, logits)
    torch.testing.assert_close(causal_lm_nll_sum(noisy, batch["labels"]), base)
    changed = logits.clone()
    changed[0, 3, 21] += 5.0  # position 3 predicts answer token 21: counts
    assert not torch.allclose(causal_lm_nll_sum(changed, batch["labels"]), base)

"""The fast paths learn what the padded paths learn: dynamic padding, SFT packing and
early-stopped generation give the same losses, logits and answers (fp32, within 1e-5), and a
packed row never attends to another row."""

import dataclasses

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM, OPTForSequenceClassification

from rlhf import algos
from rlhf.algos import causal_lm_nll_sum
from rlhf.data.collate import (
    IGNORE_INDEX,
    count_targets,
    left_pad,
    pair_batch,
    right_pad,
    sft_batch,
)
from rlhf.data.packing import (
    block_causal_mask,
    gather_positions,
    model_inputs,
    pack_bins,
    pack_rows,
    packed_sft_batch,
    packed_sft_batches,
    shared_prompt_mask,
    shared_prompt_pair_batch,
)
from rlhf.modeling.loading import ValueModel
from rlhf.rl.experience import make_experience, response_logprobs, response_values
from rlhf.rl.generation import Sampling, generate
from rlhf.rl.shaping import Shaping

PAD, VOCAB, MAX_LEN = 1, 96, 48
CPU = torch.device("cpu")


def tiny_config(**extra) -> OPTConfig:
    return OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        word_embed_proj_dim=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=64,
        max_position_embeddings=MAX_LEN + 16,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=2,
        eos_token_id=2,
        **extra,
    )


def tiny_lm(seed: int = 0, attn: str = "sdpa") -> OPTForCausalLM:
    torch.manual_seed(seed)
    return OPTForCausalLM(tiny_config(attn_implementation=attn)).eval()


def tiny_scorer(seed: int = 1) -> ValueModel:
    torch.manual_seed(seed)
    return ValueModel(OPTForSequenceClassification(tiny_config(num_labels=1))).eval()


def random_rows(n: int, seed: int = 0, max_part: int = 20) -> list[dict]:
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int) -> list[int]:
        length = int(torch.randint(lo, max_part + 1, (1,), generator=g))
        return torch.randint(3, VOCAB, (length,), generator=g).tolist()

    return [
        {"prompt_ids": [2, *ids(0)], "chosen_ids": ids(1), "rejected_ids": ids(1)} for _ in range(n)
    ]


def mean_loss(model, batch: dict) -> float:
    logits = model(**model_inputs(batch, CPU, torch.float32)).logits
    return causal_lm_nll_sum(logits, batch["labels"]).item() / count_targets(batch["labels"])


@pytest.mark.parametrize("loss_on_prompt", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_dynamic_padding_and_packing_give_the_padded_loss(loss_on_prompt, attn):
    model, rows = tiny_lm(attn=attn), random_rows(11)
    padded = sft_batch(rows, PAD, loss_on_prompt, pad_to=MAX_LEN)
    dynamic = sft_batch(rows, PAD, loss_on_prompt)
    packed = packed_sft_batch(rows, PAD, loss_on_prompt, capacity=MAX_LEN)
    assert packed["input_ids"].shape[0] < len(rows)  # packing did pack
    assert dynamic["input_ids"].shape[1] < MAX_LEN
    assert count_targets(padded["labels"]) == count_targets(packed["labels"])
    with torch.no_grad():
        reference = mean_loss(model, padded)
        assert mean_loss(model, dynamic) == pytest.approx(reference, abs=1e-5)
        assert mean_loss(model, packed) == pytest.approx(reference, abs=1e-5)


@pytest.mark.parametrize("micro_batches", [1, 3, 8])
def test_a_packed_step_holds_the_same_rows_and_loss_as_its_padded_micro_batches(micro_batches):
    model, rows = tiny_lm(), random_rows(24, seed=6)
    micro_rows = [rows[k::micro_batches] for k in range(micro_batches)]
    padded = [sft_batch(b, PAD, False, pad_to=MAX_LEN) for b in micro_rows]
    packed = packed_sft_batches(micro_rows, PAD, False, capacity=MAX_LEN)
    assert len(packed) == micro_batches
    real = sum(int(b["attention_mask"].sum()) for b in padded)
    assert sum(int(b["attention_mask"].sum()) for b in packed) == real
    assert sum(b["input_ids"].shape[0] for b in packed) < len(rows)
    with torch.no_grad():
        nll = [
            sum(
                causal_lm_nll_sum(model(**model_inputs(b, CPU, torch.float32)).logits, b["labels"])
                for b in batches
            )
            for batches in (padded, packed)
        ]
    targets = sum(count_targets(b["labels"]) for b in padded)
    assert sum(count_targets(b["labels"]) for b in packed) == targets
    assert nll[1].item() / targets == pytest.approx(nll[0].item() / targets, abs=1e-5)


def test_packed_gradients_equal_the_padded_gradients():
    rows = random_rows(9, seed=3)
    grads = []
    for batch in (
        sft_batch(rows, PAD, False, pad_to=MAX_LEN),
        packed_sft_batch(rows, PAD, False, 40),
    ):
        model = tiny_lm()
        logits = model(**model_inputs(batch, CPU, torch.float32)).logits
        causal_lm_nll_sum(logits, batch["labels"]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_packed_logits_of_each_row_equal_its_unpacked_logits():
    model, rows = tiny_lm(), random_rows(8, seed=1)
    packed = packed_sft_batch(rows, PAD, False, capacity=MAX_LEN)
    with torch.no_grad():
        packed_logits = model(**model_inputs(packed, CPU, torch.float32)).logits
        for i, row in enumerate(rows):
            ids = torch.tensor([row["prompt_ids"] + row["chosen_ids"]])
            alone = model(input_ids=ids).logits[0]
            k, start = locate(packed, i, rows)
            torch.testing.assert_close(
                packed_logits[k, start : start + ids.shape[1]], alone, atol=1e-5, rtol=0
            )


def locate(packed: dict, index: int, rows: list[dict]) -> tuple[int, int]:
    """(packed sequence, offset) where row ``index`` sits, found from its tokens."""
    seq = rows[index]["prompt_ids"] + rows[index]["chosen_ids"]
    ids = packed["input_ids"]
    for k in range(ids.shape[0]):
        starts = (packed["position_ids"][k] == 0) & (packed["segment_ids"][k] >= 0)
        for start in starts.nonzero().flatten().tolist():
            if ids[k, start : start + len(seq)].tolist() == seq:
                return k, start
    raise AssertionError(f"row {index} is not in the packed batch")


def test_a_token_never_sees_another_packed_row():
    model, rows = tiny_lm(), random_rows(8, seed=2, max_part=10)
    packed = packed_sft_batch(rows, PAD, False, capacity=MAX_LEN)
    k = max(range(packed["input_ids"].shape[0]), key=lambda k: int(packed["segment_ids"][k].max()))
    segments = packed["segment_ids"][k]
    assert segments.max() >= 1  # this sequence holds at least two rows
    changed = {key: value.clone() for key, value in packed.items()}
    changed["input_ids"][k][segments != 0] = torch.randint(3, VOCAB, ((segments != 0).sum(),))
    with torch.no_grad():
        before = model(**model_inputs(packed, CPU, torch.float32)).logits
        after = model(**model_inputs(changed, CPU, torch.float32)).logits
    first = segments == 0
    torch.testing.assert_close(after[k][first], before[k][first], atol=1e-6, rtol=0)
    assert not torch.allclose(after[k][segments == 1], before[k][segments == 1])


def test_block_causal_mask_allows_only_earlier_tokens_of_the_same_row():
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1]])
    allowed = block_causal_mask(segments, torch.float32)[0, 0] == 0
    for q in range(8):
        for key in range(8):
            same = segments[0, q] == segments[0, key]
            assert bool(allowed[q, key]) == bool(same and key <= q), (q, key)


def test_packed_labels_skip_each_rows_first_token_and_the_prompt():
    rows = random_rows(6, seed=4)
    for on_prompt in (False, True):
        packed = packed_sft_batch(rows, PAD, on_prompt, capacity=MAX_LEN)
        starts = (packed["position_ids"] == 0) & (packed["segment_ids"] >= 0)
        assert (packed["labels"][starts] == IGNORE_INDEX).all()
        assert (packed["labels"][packed["segment_ids"] < 0] == IGNORE_INDEX).all()
        expected = sum(
            len(r["chosen_ids"])
            if not on_prompt
            else len(r["prompt_ids"]) + len(r["chosen_ids"]) - 1
            for r in rows
        )
        assert count_targets(packed["labels"]) == expected


@pytest.mark.parametrize("capacity", [10, 25, 64])
def test_pack_bins_keeps_every_row_once_within_capacity(capacity):
    lengths = [3, 9, 10, 1, 7, 7, 5, 2, 8, 10]
    bins = pack_bins(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert len(bins) <= -(-sum(lengths) // capacity) + 1  # first-fit decreasing is near optimal


def test_dynamic_padding_gives_the_padded_reward_scores_and_loss():
    scorer, rows = tiny_scorer(), random_rows(7, seed=5)
    out = []
    with torch.no_grad():
        for batch in (pair_batch(rows, PAD, pad_to=MAX_LEN), pair_batch(rows, PAD)):
            values = scorer(batch["input_ids"], batch["attention_mask"])
            scores = algos.sequence_scores(
                values, batch["attention_mask"], batch["response_mask"], "last"
            )
            chosen, rejected = scores.chunk(2)
            out.append((scores, algos.pairwise_ranking_loss(chosen, rejected, 0.0)))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1][1], out[0][1], atol=1e-5, rtol=0)


END = 40  # the end-of-text of the counting model
# the counting model's answers to these end after 15, 10, 6 and 2 tokens (end-of-text included)
COUNTING_PROMPTS = [[2, 7, 25], [2, 30], [2, 9, 11, 60, 34], [2, 5, 38]]


def counting_lm() -> OPTForCausalLM:
    """An LM whose next token after t is t + 1 (wrapping over the ordinary ids 3..V-1): the
    layers add nothing, the head maps each token's final hidden state to its successor. Its
    answers end at END after a number of steps set by the prompt's last token."""
    torch.manual_seed(0)
    model = OPTForCausalLM(tiny_config(tie_word_embeddings=False)).eval()
    decoder = model.model.decoder
    with torch.no_grad():
        for layer in decoder.layers:
            for linear in (layer.self_attn.out_proj, layer.fc2):
                linear.weight.zero_()
                linear.bias.zero_()
        decoder.embed_positions.weight.zero_()
        hidden = decoder.final_layer_norm(decoder.embed_tokens.weight)  # (V, H)
        previous = [VOCAB - 1, *range(3, VOCAB - 1)]  # of ids 3..V-1
        model.lm_head.weight.zero_()
        model.lm_head.weight[3:] = hidden[previous]
    return model


@pytest.mark.parametrize("greedy", [True, False])
def test_early_stopped_generation_equals_full_length_generation_up_to_eos(greedy):
    model, max_new = counting_lm(), 24
    model.generation_config.eos_token_id = END  # as an export's generation_config.json says
    rollouts = {}
    for stop in (True, False):
        torch.manual_seed(11)
        sampling = Sampling(max_new, greedy=greedy, stop_at_eos=stop)
        rollouts[stop] = generate(model, COUNTING_PROMPTS, PAD, END, sampling, synced_gpus=False)
    early, full = rollouts[True], rollouts[False]
    assert early.response_mask.sum(1).tolist() == [15, 10, 6, 2]
    width = early.response_mask.shape[1]
    assert width == 15 < max_new  # generation stopped when the last answer ended
    assert full.sequences.shape[1] == full.prompt_width + max_new
    torch.testing.assert_close(early.response_mask, full.response_mask[:, :width])
    assert not full.response_mask[:, width:].any()  # nothing counts after the end-of-text
    kept = early.response_mask
    responses = early.sequences[:, early.prompt_width :]
    assert torch.equal(responses[kept], full.sequences[:, full.prompt_width :][:, :width][kept])
    assert (responses[~kept] == PAD).all()
    torch.testing.assert_close(
        early.attention_mask, full.attention_mask[:, : early.prompt_width + width]
    )


def test_kv_cached_greedy_generation_equals_recomputing_every_step():
    model = tiny_lm(seed=3)
    prompts = [r["prompt_ids"] for r in random_rows(4, seed=9, max_part=8)]
    rollout = generate(model, prompts, PAD, 0, Sampling(12, greedy=True), False)
    sequences = rollout.sequences[:, : rollout.prompt_width]
    mask = rollout.attention_mask[:, : rollout.prompt_width]
    with torch.no_grad():
        for _ in range(12):  # no cache: the whole sequence again for each new token
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=sequences, attention_mask=mask, position_ids=positions).logits
            sequences = torch.cat([sequences, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    assert torch.equal(rollout.sequences, sequences)


@pytest.mark.parametrize("greedy", [True, False])
def test_rollout_logprobs_equal_a_second_forward_over_the_rollout(greedy):
    model, temperature = tiny_lm(seed=7), 1.0 if greedy else 0.7
    prompts = [r["prompt_ids"] for r in random_rows(5, seed=4, max_part=10)]
    torch.manual_seed(2)
    sampling = Sampling(16, greedy=greedy, temperature=temperature, top_k=0 if greedy else 20)
    rollout = generate(model, prompts, PAD, 0, sampling, False, logprobs_temperature=temperature)
    recomputed, _ = response_logprobs(
        model,
        rollout.sequences,
        rollout.attention_mask,
        rollout.prompt_width - 1,
        True,
        temperature,
    )
    assert rollout.logprobs.shape == rollout.response_mask.shape
    kept = rollout.response_mask
    torch.testing.assert_close(rollout.logprobs[kept], recomputed[kept], atol=1e-5, rtol=0)
    assert (rollout.logprobs[kept] < 0).all()  # the model's own, not top-k-renormalised


@pytest.mark.parametrize("kl_estimator", ["k1", "full"])
def test_ppo_experience_and_losses_are_the_same_on_the_fast_and_the_baseline_path(kl_estimator):
    actor, reference = counting_lm(), tiny_lm(seed=5)
    critic, reward = tiny_scorer(seed=2), tiny_scorer(seed=3)
    shaping = Shaping(
        kl_coef=0.1,
        kl_estimator=kl_estimator,
        clip_reward_value=5.0,
        gamma=1.0,
        lam=0.95,
        min_response_tokens=2,
        score_position="last",
        reward_stats=None,
    )
    out = {}
    # fast: stop at the end, drop finished answers, log-probs from the rollout, packed rows;
    # baseline: DeepSpeed-Chat's (greedy rollouts: issue 19's KL anomaly)
    for fast in (True, False):
        sampling = Sampling(
            24, greedy=True, stop_at_eos=fast, prompt_width=None if fast else 9, drop_finished=fast
        )
        rollout = generate(
            actor, COUNTING_PROMPTS, PAD, END, sampling, False, 1.0 if fast else None
        )
        assert rollout.prompt_width == (5 if fast else 9)
        assert (rollout.logprobs is not None) == fast
        shaping = dataclasses.replace(shaping, packing=fast)
        exp = make_experience(rollout, actor, reference, critic, reward, shaping, CPU)
        packing = pack_rows(exp.sequences, exp.attention_mask, PAD) if fast else None
        with torch.no_grad():  # the update's forward, as ppo.train_step runs it
            start = exp.prompt_width - 1
            logprobs, _ = response_logprobs(
                reference, exp.sequences, exp.attention_mask, start, packing=packing
            )
            values = response_values(critic, exp.sequences, exp.attention_mask, start, packing)
        actor_loss, _ = algos.policy_loss(
            logprobs, exp.old_logprobs, exp.advantages, exp.response_mask, 0.2, 0.2
        )
        critic_loss, _ = algos.value_loss(
            values, exp.old_values + 0.1, exp.returns, exp.response_mask, 0.2
        )
        out[fast] = exp, actor_loss, critic_loss
    (early, a0, c0), (full, a1, c1) = out[True], out[False]
    width = early.response_mask.shape[1]
    assert width < full.response_mask.shape[1]
    torch.testing.assert_close(a0, a1, atol=1e-5, rtol=0)
    torch.testing.assert_close(c0, c1, atol=1e-5, rtol=0)
    torch.testing.assert_close(early.scores, full.scores, atol=1e-5, rtol=0)
    fields = (
        "old_logprobs",
        "ref_logprobs",
        "kl",
        "old_values",
        "rewards",
        "advantages",
        "returns",
    )
    for field in fields:
        kept = early.response_mask
        torch.testing.assert_close(
            getattr(early, field)[kept], getattr(full, field)[:, :width][kept], atol=1e-5, rtol=0
        )
    if kl_estimator == "full":  # the exact KL of the two models' distributions, not of a token
        with torch.no_grad():
            start = full.prompt_width - 1
            _, logits = response_logprobs(actor, full.sequences, full.attention_mask, start)
            _, ref_logits = response_logprobs(reference, full.sequences, full.attention_mask, start)
        exact = algos.full_kl(logits, ref_logits)
        kept = full.response_mask
        torch.testing.assert_close(full.kl[kept], exact[kept], atol=1e-5, rtol=0)
        assert not torch.allclose(full.kl[kept], full.old_logprobs[kept] - full.ref_logprobs[kept])


def test_packed_rollout_rows_give_the_padded_logprobs_values_and_gradients():
    actor, critic = tiny_lm(seed=8), tiny_scorer(seed=4)
    rows = random_rows(6, seed=12, max_part=12)  # answers of 1..12 tokens, as if they ended
    prompt_ids, prompt_mask = left_pad([r["prompt_ids"] for r in rows], PAD)
    answer_ids, kept = right_pad([r["chosen_ids"] for r in rows], PAD)
    sequences, mask = torch.cat([prompt_ids, answer_ids], 1), torch.cat([prompt_mask, kept], 1)
    start, kept = prompt_ids.shape[1] - 1, kept.bool()
    packing = pack_rows(sequences, mask, PAD)
    assert packing.input_ids.shape[0] < len(rows)  # fewer rows than the padded batch
    assert packing.input_ids.numel() < sequences.numel()
    out = {}
    for packed in (False, True):
        actor.zero_grad()
        logprobs, logits = response_logprobs(
            actor, sequences, mask, start, packing=packing if packed else None
        )
        values = response_values(critic, sequences, mask, start, packing if packed else None)
        algos.masked_mean(logprobs * logits.float().logsumexp(-1), kept).backward()
        grads = [p.grad.clone() for p in actor.parameters() if p.grad is not None]
        out[packed] = logprobs.detach(), values.detach(), grads
    torch.testing.assert_close(out[True][0][kept], out[False][0][kept], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[True][1][kept], out[False][1][kept], atol=1e-5, rtol=0)
    for packed_grad, padded_grad in zip(out[True][2], out[False][2]):
        torch.testing.assert_close(packed_grad, padded_grad, atol=1e-5, rtol=0)


def test_pack_rows_keeps_every_real_token_once_and_unpack_restores_the_rows():
    sequences = torch.tensor([[0, 0, 5, 6, 7, 0], [8, 9, 4, 3, 0, 0], [0, 0, 0, 11, 12, 13]])
    mask = (sequences != 0).long()
    packing = pack_rows(sequences, mask, pad_id=0)
    assert packing.input_ids.shape == (2, 6)  # 3 + 4 + 3 tokens into rows of at most 6
    assert torch.equal(packing.unpack(packing.input_ids), sequences)
    assert torch.equal(
        packing.unpack(packing.position_ids), (mask.cumsum(1) - 1).clamp(min=0) * mask
    )
    assert sorted(packing.input_ids[packing.segment_ids >= 0].tolist()) == sorted(
        sequences[mask.bool()].tolist()
    )
    with pytest.raises(ValueError, match="not contiguous"):
        pack_rows(torch.tensor([[5, 0, 6]]), torch.tensor([[1, 0, 1]]), pad_id=0)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_static_kv_cache_generates_what_the_dynamic_one_does(greedy):
    # greedy: the counting model's answers end after 15, 10, 6 and 2 tokens
    model, end = (counting_lm(), END) if greedy else (tiny_lm(seed=6), 7)
    prompts = COUNTING_PROMPTS if greedy else [r["prompt_ids"] for r in random_rows(5, seed=3)]
    rollouts = {}
    for cache in ("dynamic", "static"):
        torch.manual_seed(4)
        sampling = Sampling(18, greedy=greedy, temperature=0.8, cache=cache)
        rollouts[cache] = generate(model, prompts, PAD, end, sampling, False, 0.8)
    dynamic, static = rollouts["dynamic"], rollouts["static"]
    assert dynamic.response_mask.sum() < dynamic.response_mask.numel()  # some answers ended
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(static.response_mask, dynamic.response_mask)
    torch.testing.assert_close(static.logprobs, dynamic.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("greedy", [True, False])
def test_dropping_finished_answers_generates_what_hf_generate_does(greedy):
    # greedy: the counting model's answers end after 15, 10, 6 and 2 tokens, so rows drop out
    # at different steps; sampled: a random model, top-k and temperature, answers of every length
    model, end = (counting_lm(), END) if greedy else (tiny_lm(seed=9), 5)
    prompts = COUNTING_PROMPTS if greedy else [r["prompt_ids"] for r in random_rows(6, seed=8)]
    rollouts = {}
    for drop in (False, True):
        torch.manual_seed(3)
        sampling = Sampling(20, greedy=greedy, temperature=0.9, top_k=30, drop_finished=drop)
        rollouts[drop] = generate(model, prompts, PAD, end, sampling, False, 0.9)
    hf, dropped = rollouts[False], rollouts[True]
    lengths = dropped.response_mask.sum(1)
    assert lengths.min() < lengths.max()  # answers ended at different steps
    if greedy:
        assert lengths.tolist() == [15, 10, 6, 2]
        assert torch.equal(dropped.sequences, hf.sequences)
        kept = dropped.response_mask
        torch.testing.assert_close(dropped.logprobs[kept], hf.logprobs[kept], atol=1e-5, rtol=0)
    else:  # the draws agree until the first answer ends; after that the batches differ
        first_end = int(lengths.min())
        width = dropped.prompt_width + first_end
        assert torch.equal(dropped.sequences[:, :width], hf.sequences[:, :width])
    assert dropped.sequences.shape[1] == dropped.prompt_width + int(lengths.max())
    responses = dropped.sequences[:, dropped.prompt_width :]
    assert (responses[~dropped.response_mask] == PAD).all()  # padding after each end-of-text
    recomputed, _ = response_logprobs(
        model,
        dropped.sequences,
        dropped.attention_mask,
        dropped.prompt_width - 1,
        temperature=1.0 if greedy else 0.9,
    )
    kept = dropped.response_mask
    if not greedy:
        torch.testing.assert_close(dropped.logprobs[kept], recomputed[kept], atol=1e-5, rtol=0)


@pytest.mark.parametrize("loss", ["pairwise", "mse"])
def test_a_shared_prompt_gives_the_pair_batch_values_loss_and_gradients(loss):
    rows = random_rows(7, seed=21)
    out = {}
    for shared in (False, True):
        scorer = tiny_scorer(seed=6).train()
        batch = shared_prompt_pair_batch(rows, PAD) if shared else pair_batch(rows, PAD)
        if shared:
            assert batch["packed_ids"].numel() < batch["input_ids"].numel()  # one prompt a pair
            packed = scorer(
                batch["packed_ids"],
                shared_prompt_mask(batch["branch"], torch.float32),
                position_ids=batch["packed_positions"],
            )
            values = gather_positions(packed, batch["index"])
        else:
            values = scorer(batch["input_ids"], batch["attention_mask"])
        mask, response = batch["attention_mask"], batch["response_mask"]
        scores = algos.sequence_scores(
            values, mask, response, "last" if loss == "pairwise" else "mean"
        )
        if loss == "pairwise":
            value = algos.pairwise_ranking_loss(*scores.chunk(2), 0.0)
        else:
            value = algos.mse_reward_loss(scores, torch.tensor([1.0, -1.0]).repeat_interleave(7))
        value.backward()
        grads = [p.grad.clone() for p in scorer.parameters() if p.grad is not None]
        out[shared] = values.detach() * mask, value.detach(), grads
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-5, rtol=0)
    for shared_grad, pair_grad in zip(out[True][2], out[False][2]):
        torch.testing.assert_close(shared_grad, pair_grad, atol=1e-5, rtol=0)


def test_the_rejected_answer_never_sees_the_chosen_one():
    branch = torch.tensor([[0, 0, 1, 1, 2, 2, -1]])
    allowed = shared_prompt_mask(branch, torch.float32)[0, 0] == 0
    assert allowed[4].tolist() == [True, True, False, False, True, False, False]
    assert allowed[3].tolist() == [True, True, True, True, False, False, False]
    assert allowed[6].tolist() == [False] * 6 + [True]  # padding sees padding only


# -- on by default where they apply ------------------------------------------------------------


def tiny_llama(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(13)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN + 16,
        pad_token_id=PAD,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("keys", "drops"),
    [
        ({}, True),  # null: on wherever it applies
        ({"stop_at_eos": False}, False),
        ({"cache": "static"}, False),
        ({"drop_finished_rows": False}, False),
        ({"drop_finished_rows": True}, True),
    ],
)
def test_dropping_finished_answers_is_on_by_default_wherever_it_applies(keys, drops):
    from rlhf.config import PPOConfig, PPORolloutConfig
    from rlhf.rl.generation import drops_finished_rows

    ppo = PPOConfig(rollout=PPORolloutConfig(**keys))
    assert drops_finished_rows(ppo) == drops
    assert not [p for p in ppo.rollout.problems() if p[0] == "drop_finished_rows"]


@pytest.mark.parametrize(
    ("keys", "drops"),
    [
        ({}, True),
        ({"stop_at_eos": False}, True),  # held-out answers end at the end-of-text regardless
        ({"cache": "static"}, False),
        ({"drop_finished_rows": False}, False),
    ],
)
def test_held_out_answers_are_decoded_dropping_finished_rows_as_rollouts_are(keys, drops):
    # HF's generate keeps every row of the batch until the longest answer ends
    from rlhf.config import Config, PPOConfig, PPORolloutConfig
    from rlhf.rl.generation import eval_sampling

    cfg = Config(ppo=PPOConfig(rollout=PPORolloutConfig(temperature=0.7, top_k=5, **keys)))
    for greedy in (True, False):
        sampling = eval_sampling(cfg, 12, greedy)
        assert (sampling.drop_finished, sampling.stop_at_eos) == (drops, True)
        assert (sampling.max_new_tokens, sampling.greedy) == (12, greedy)
        assert (sampling.temperature, sampling.top_k) == (0.7, 5)


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_packing_is_on_for_the_architectures_whose_attention_takes_the_block_mask(arch):
    from rlhf.modeling.loading import block_mask_problem

    for attn in ("eager", "lean_eager", "sdpa"):
        lm = tiny_lm(attn=attn) if arch == "opt" else tiny_llama(attn)
        assert block_mask_problem(lm) is None
        # and the packed rows give that architecture's padded log-probs
        rows = random_rows(5, seed=17, max_part=10)
        prompt_ids, prompt_mask = left_pad([r["prompt_ids"] for r in rows], PAD)
        answer_ids, kept = right_pad([r["chosen_ids"] for r in rows], PAD)
        sequences = torch.cat([prompt_ids, answer_ids], 1)
        mask = torch.cat([prompt_mask, kept], 1)
        start, kept = prompt_ids.shape[1] - 1, kept.bool()
        with torch.no_grad():
            padded, _ = response_logprobs(lm, sequences, mask, start)
            packed, _ = response_logprobs(
                lm, sequences, mask, start, packing=pack_rows(sequences, mask, PAD)
            )
        torch.testing.assert_close(packed[kept], padded[kept], atol=1e-5, rtol=0)
    assert block_mask_problem(tiny_scorer()) is None


def test_ppo_packing_is_refused_where_asked_for_and_a_model_takes_no_mask():
    from rlhf.config import ConfigError
    from rlhf.modeling.loading import fast_path
    from rlhf.rl.ppo_models import Models
    from rlhf.steps.ppo_parts import packing_problem

    assert packing_problem(Models(tiny_lm(), tiny_lm(), None, tiny_scorer(), None, None)) is None
    flash = tiny_lm()
    flash.config._attn_implementation = "flash_attention_2"  # takes no 4D mask
    problem = packing_problem(Models(tiny_lm(), flash, None, tiny_scorer(), None, None))
    assert "flash_attention_2" in problem
    assert fast_path("ppo.update.packing", None, problem) is False  # null: padded rows
    with pytest.raises(ConfigError, match=r"ppo\.update\.packing=true: flash_attention_2"):
        fast_path("ppo.update.packing", True, problem)


def test_packing_falls_back_to_padded_rows_where_the_mask_is_not_taken():
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf.modeling.loading import block_mask_problem

    lm = tiny_lm()
    lm.config._attn_implementation = "flash_attention_2"  # takes no 4D mask
    assert "flash_attention_2" in block_mask_problem(lm)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4))
    assert "gpt2" in block_mask_problem(gpt2)

"""An environment's observation tokens in SFT, DPO and the reward model's mean score.

toy_tools rows carry their observations' character spans; tokenisation turns them into
``*_obs_mask`` beside the answer ids. No loss counts those tokens: the SFT loss, the DPO
log-ratio and the mean score of a row are the same whatever junk its observations hold. The
invariance is checked with a model whose logits depend on the position only: a real model's
later tokens condition on the observation (as in PPO's episodes), so what is tested is that no
observation token is a target or a scored position. Single-turn rows get no mask and the
tensors they always had.
"""

import random

import pytest
import torch
from transformers import AutoTokenizer

from rlhf.algos.logits import causal_lm_nll_sum
from rlhf.algos.preference import answer_logprobs, preference_terms, sequence_scores
from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.config import DataConfig, DPOConfig, SourceConfig
from rlhf.data.collate import IGNORE_INDEX, pair_batch, rows_at, sft_batch
from rlhf.data.observed_tokens import token_mask
from rlhf.data.packing import packed_batch, packed_sft_batch
from rlhf.data.prepare import phase_dataset
from rlhf.tasks import toy_tools

EOT = 2
TOOL = " <call> 123 + 456</call> = 579 The answer is 579."


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)


def _rows(tokenizer, cache, adapter: str, task: str | None, phase: str) -> list[dict]:
    source = SourceConfig(
        adapter=adapter, task=task, num_rows=300, train_split="train", eval_split="test"
    )
    data = DataConfig(
        sources={"s": source}, max_seq_len=64, max_prompt_len=32, seed=1234, cache_dir=str(cache)
    )
    rows = phase_dataset(data, phase, "train", tokenizer, EOT).with_format("python")
    return rows_at(rows, list(range(len(rows))))


@pytest.fixture(scope="module")
def tool_rows(tokenizer, tmp_path_factory):
    """Tokenised toy_tools rows whose demonstration, chosen and rejected answers all call."""
    rows = _rows(tokenizer, tmp_path_factory.mktemp("cache"), "task", "toy_tools", "reward")
    answers = ("response", "chosen", "rejected")
    calling = [r for r in rows if all(any(r[f"{a}_obs_mask"]) for a in answers)]
    assert len(calling) >= 4
    return calling[:4]


def _junk(rows: list[dict], seed: int) -> list[dict]:
    """``rows`` with every observation token (of every answer) replaced by a random id."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        row = dict(row)
        for answer in ("chosen", "rejected", "response"):
            mask = row.get(f"{answer}_obs_mask")
            if mask and row.get(f"{answer}_ids"):
                ids = row[f"{answer}_ids"]
                row[f"{answer}_ids"] = [
                    rng.randrange(3, 500) if m else t for t, m in zip(ids, mask)
                ]
        out.append(row)
    return out


def _without_masks(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith("_obs_mask")} for r in rows]


class PositionLM(torch.nn.Module):
    """A causal LM whose logits depend on the position only: (T, V) from a seeded table."""

    def __init__(self, seed: int, width: int = 128, vocab: int = 2048):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(width, vocab, generator=generator))

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        logits = self.table[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1)
        return type("Out", (), {"logits": logits})()


def test_the_task_marks_its_observations():
    spans = toy_tools.observation_spans(TOOL)
    assert [TOOL[a:b] for a, b in spans] == [" = 579"]
    assert toy_tools.observation_spans(" The answer is 579.") == []
    two = TOOL.replace(" The answer", " <call> 579 * 2</call> = error The answer")
    assert [two[a:b] for a, b in toy_tools.observation_spans(two)] == [" = 579", " = error"]
    for row in toy_tools.generate_rows("train", 200, seed=3):
        for answer in ("response", "chosen", "rejected"):
            text, spans = row[answer], row[f"{answer}_obs_spans"]
            assert [text[a:b].split()[0] for a, b in spans] == ["="] * text.count("</call>")


def test_token_mask_marks_overlapping_tokens():
    offsets = [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert token_mask(offsets, [[3, 5]]) == [0, 1, 1, 0]
    assert token_mask(offsets, None) == [0, 0, 0, 0]


def test_observation_masks_cover_the_observation_tokens(tool_rows, tokenizer):
    for row in tool_rows:
        for answer in ("chosen", "rejected"):
            ids, mask = row[f"{answer}_ids"], row[f"{answer}_obs_mask"]
            assert len(mask) == len(ids) and mask[-1] == 0  # the end-of-text is the model's
            observed = tokenizer.decode([t for t, m in zip(ids, mask) if m])
            assert observed.startswith(" =") and "</call>" not in observed
            assert "answer" not in observed


def test_sft_loss_ignores_observation_junk(tool_rows):
    lm = PositionLM(0)
    losses = []
    for rows in (_junk(tool_rows, 1), _junk(tool_rows, 2)):
        batch = sft_batch(rows, 1, loss_on_prompt=False)
        losses.append(causal_lm_nll_sum(lm(batch["input_ids"]).logits, batch["labels"]))
        packed = packed_batch(rows, [[0, 1], [2, 3]], 1, loss_on_prompt=False)
        targets = packed["labels"][packed["labels"] != IGNORE_INDEX]
        assert targets.tolist() == batch["labels"][batch["labels"] != IGNORE_INDEX].tolist()
    assert torch.equal(losses[0], losses[1])
    # the control: with the observation tokens as targets, the junk changes the loss
    unmasked = [sft_batch(_without_masks(_junk(tool_rows, s)), 1, False) for s in (1, 2)]
    loss_1, loss_2 = (causal_lm_nll_sum(lm(b["input_ids"]).logits, b["labels"]) for b in unmasked)
    assert not torch.equal(loss_1, loss_2)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_dpo_log_ratio_ignores_observation_junk(tool_rows, reduction):
    policy, reference, dpo = PositionLM(0), PositionLM(1), DPOConfig()
    ratios = []
    for rows in (_junk(tool_rows, 1), _junk(tool_rows, 2), _without_masks(_junk(tool_rows, 2))):
        batch = pair_batch(rows, 1)
        with torch.no_grad():
            logprobs = answer_logprobs(policy, batch, reduction)
            ref = answer_logprobs(reference, batch, reduction)
        terms = preference_terms(dpo, logprobs, ref)
        ratios.append(torch.stack([terms["chosen_reward"], terms["rejected_reward"]]))
    assert torch.equal(ratios[0], ratios[1])
    assert not torch.equal(ratios[1], ratios[2])  # the observation tokens did count before


def test_reward_mean_score_ignores_observation_junk(tool_rows):
    scores = []
    for rows in (_junk(tool_rows, 1), _junk(tool_rows, 2)):
        batch = pair_batch(rows, 1)
        # per-token values that depend on the token: junk changes them where it is
        values = torch.sin(batch["input_ids"].float())
        mean = sequence_scores(values, batch["attention_mask"], batch["response_mask"], "mean")
        scores.append(mean)
    assert torch.equal(scores[0], scores[1])


def test_single_turn_rows_are_unchanged(tokenizer, tmp_path):
    rows = _rows(tokenizer, tmp_path, "toy", None, "sft")[:6]
    assert not any(k.endswith("_obs_mask") for r in rows for k in r)
    batch = sft_batch(rows, 1, loss_on_prompt=False)
    # the labels as they always were: every real answer token
    expected = torch.where(batch["attention_mask"].bool(), batch["input_ids"], IGNORE_INDEX)
    for i, r in enumerate(rows):
        expected[i, : len(r["prompt_ids"])] = IGNORE_INDEX
    assert torch.equal(batch["labels"], expected)
    pairs = pair_batch(rows, 1)
    starts = torch.tensor([len(r["prompt_ids"]) for r in rows] * 2).unsqueeze(1)
    positions = torch.arange(pairs["input_ids"].shape[1])
    answer = (positions >= starts) & pairs["attention_mask"].bool()
    assert torch.equal(pairs["response_mask"], answer)
    packed = packed_sft_batch(rows, 1, loss_on_prompt=False, capacity=64)
    assert int((packed["labels"] != IGNORE_INDEX).sum()) == int((expected != IGNORE_INDEX).sum())

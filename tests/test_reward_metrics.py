"""The reward model's held-out table beyond accuracy: calibration, margin quantiles, length
bias, accuracy per source and per rejected kind; hand-computed values, numpy where it has the
same function, and the rows that carry a source and a rejected kind through the data pipeline."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.config import DataConfig, SourceConfig
from rlhf.data.prepare import phase_dataset
from rlhf.evaluators.pair_metrics import (
    ScoredPair,
    correlation,
    expected_calibration_error,
    pair_metrics,
    quantile,
)
from rlhf.evaluators.pair_scores import scored_pairs


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


PAIRS = [  # chosen, rejected, chosen_len, rejected_len, source, rejected_kind
    ScoredPair(2.0, 0.0, 5, 3, "a", "wrong"),  # right, conf sigmoid(2), chosen longer
    ScoredPair(0.0, 1.0, 2, 4, "a", "habit"),  # wrong, conf sigmoid(1), chosen shorter
    ScoredPair(1.0, 0.5, 3, 3, "b", "wrong"),  # right, conf sigmoid(0.5), equal lengths
    ScoredPair(0.3, 0.3, 4, 2, "b", "habit"),  # a tie: wrong, conf 0.5, chosen longer
    ScoredPair(0.0, 2.0, 1, 1, "b", "wrong"),  # wrong, conf sigmoid(2) (A's bin), equal
]


def test_expected_calibration_error_by_hand():
    # bins of width 0.05 over [0.5, 1]: A and E share sigmoid(2)'s bin (one right of two)
    by_hand = (
        2 * abs(0.5 - sigmoid(2)) + abs(0 - sigmoid(1)) + abs(1 - sigmoid(0.5)) + abs(0 - 0.5)
    ) / 5
    margins = [p.margin for p in PAIRS]
    assert expected_calibration_error(margins) == pytest.approx(by_hand, abs=1e-12)
    # one bin for all: |accuracy - mean confidence|
    one_bin = abs(2 / 5 - np.mean([sigmoid(abs(m)) for m in margins]))
    assert expected_calibration_error(margins, bins=1) == pytest.approx(one_bin, abs=1e-12)
    # a model right exactly as often as it is confident in each bin is calibrated
    assert expected_calibration_error([0.0, 0.0]) == pytest.approx(0.5)  # ties: 0 right at 0.5
    assert expected_calibration_error([50.0, 50.0]) == pytest.approx(0.0, abs=1e-12)


def test_pair_metrics_by_hand():
    m = pair_metrics(PAIRS)
    assert m["eval/accuracy"] == pytest.approx(2 / 5)
    assert m["eval/chosen_score"] == pytest.approx(3.3 / 5)
    assert m["eval/rejected_score"] == pytest.approx(3.8 / 5)
    assert m["eval/margin"] == pytest.approx(-0.5 / 5)
    # margins sorted: -2, -1, 0, 0.5, 2; p10 at position 0.4, p50 the middle, p90 at 3.6
    assert m["eval/margin_p10"] == pytest.approx(-2 + 0.4 * 1)
    assert m["eval/margin_p50"] == pytest.approx(0.0)
    assert m["eval/margin_p90"] == pytest.approx(0.5 + 0.6 * 1.5)
    # chosen longer: A (right), D (wrong); chosen shorter: B (wrong); C and E equal
    assert m["eval/chosen_longer_share"] == pytest.approx(2 / 5)
    assert m["eval/accuracy_chosen_longer"] == pytest.approx(0.5)
    assert m["eval/accuracy_chosen_shorter"] == pytest.approx(0.0)
    assert m["eval/accuracy/a"] == pytest.approx(0.5)
    assert m["eval/accuracy/b"] == pytest.approx(1 / 3)
    assert m["eval/accuracy_rejected/wrong"] == pytest.approx(2 / 3)
    assert m["eval/accuracy_rejected/habit"] == pytest.approx(0.0)
    scores = [s for p in PAIRS for s in (p.chosen, p.rejected)]
    lengths = [n for p in PAIRS for n in (p.chosen_len, p.rejected_len)]
    assert m["eval/score_length_corr"] == pytest.approx(np.corrcoef(scores, lengths)[0, 1])
    assert m["eval/score_std"] == pytest.approx(np.std(scores))


def test_what_cannot_be_measured_is_left_out():
    same = [ScoredPair(1.0, 0.0, 3, 3), ScoredPair(2.0, 1.0, 3, 3)]
    m = pair_metrics(same)
    # no length differs: no length-bias accuracy, no correlation; one source, one kind: no split
    assert m["eval/chosen_longer_share"] == 0.0
    for key in ("eval/accuracy_chosen_longer", "eval/accuracy_chosen_shorter"):
        assert key not in m
    assert "eval/score_length_corr" not in m
    assert not [k for k in m if k.startswith(("eval/accuracy/", "eval/accuracy_rejected/"))]
    with pytest.raises(ValueError, match="at least one pair"):
        pair_metrics([])


@pytest.mark.parametrize("q", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_quantile_and_correlation_match_numpy(q):
    rng = np.random.default_rng(0)
    values = rng.normal(size=37).tolist()
    assert quantile(values, q) == pytest.approx(np.quantile(values, q), abs=1e-12)
    other = (np.asarray(values) * 0.3 + rng.normal(size=37)).tolist()
    assert correlation(values, other) == pytest.approx(np.corrcoef(values, other)[0, 1])
    assert correlation(values, [1.0] * 37) is None


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)


class LengthLover(torch.nn.Module):
    """A 'reward model' whose value at every position is the count of real tokens so far:
    its score (the last real token's) is the sequence length."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))  # where the model lives

    def forward(self, input_ids, attention_mask):
        return attention_mask.float().cumsum(-1)


def test_the_embedded_pairs_carry_source_and_rejected_kind_to_the_table(tmp_path, tokenizer):
    sources = {
        "toy": SourceConfig(adapter="toy", num_rows=600),
        "more": SourceConfig(adapter="toy", num_rows=300, seed=3),
    }
    data = DataConfig(sources=sources, cache_dir=str(tmp_path))
    rows = phase_dataset(data, "reward", "eval", tokenizer, tokenizer.eos_token_id)
    assert set(rows["source"]) == {"toy", "more"}
    kinds = set(rows["rejected_kind"])
    assert {"habit", "wrong"} <= kinds
    pairs = scored_pairs(LengthLover(), rows, tokenizer.pad_token_id, 7, "last")
    assert len(rows) % 7 and len(pairs) == len(rows)  # the last batch's padding rows dropped
    m = pair_metrics(pairs)
    # scoring length itself: right exactly where the chosen answer is the longer one
    assert m["eval/accuracy_chosen_longer"] == 1.0
    assert m["eval/accuracy_chosen_shorter"] == 0.0
    assert m["eval/score_length_corr"] > 0
    assert {f"eval/accuracy/{s}" for s in ("toy", "more")} <= set(m)
    assert {f"eval/accuracy_rejected/{k}" for k in kinds} <= set(m)

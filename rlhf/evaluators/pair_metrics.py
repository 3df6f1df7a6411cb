"""A reward model judged by more than its pairwise accuracy (DeepSpeed-Chat's step-2 notes: a
high accuracy can hide a negative chosen score or a rejected score close to the chosen one).

:func:`pair_metrics` turns the scores of N held-out pairs into the ``eval/`` table the reward
step logs and ``python -m rlhf.cli.evaluate reward`` prints: accuracy and mean scores, calibration of
the Bradley-Terry probability sigmoid(chosen - rejected), margin quantiles, length bias, and the
accuracy per source and per rejected kind where the data says them. Pure: lists in, floats out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

CALIBRATION_BINS = 10  # equal-width bins of the confidence over [0.5, 1]
MARGIN_QUANTILES = (0.1, 0.5, 0.9)


@dataclass(frozen=True)
class ScoredPair:
    """One held-out pair as the reward model scored it. Lengths are answer tokens."""

    chosen: float
    rejected: float
    chosen_len: int
    rejected_len: int
    source: str = ""  # the data.sources entry the pair came from
    rejected_kind: str = ""  # the embedded task's kind of rejected answer ("" elsewhere)

    @property
    def margin(self) -> float:
        return self.chosen - self.rejected

    @property
    def correct(self) -> bool:
        return self.chosen > self.rejected  # a tie counts as wrong


def pair_metrics(pairs: Sequence[ScoredPair]) -> dict[str, float]:
    """Every ``eval/`` metric of ``pairs`` (N >= 1). A metric with no pairs to measure (no pair
    whose chosen answer is the longer one, say) is left out rather than reported as 0."""
    if not pairs:
        raise ValueError("pair_metrics needs at least one pair")
    margins = [p.margin for p in pairs]
    scores = [s for p in pairs for s in (p.chosen, p.rejected)]
    lengths = [n for p in pairs for n in (p.chosen_len, p.rejected_len)]
    out = {
        "eval/accuracy": accuracy(pairs),
        "eval/chosen_score": _mean([p.chosen for p in pairs]),
        "eval/rejected_score": _mean([p.rejected for p in pairs]),
        "eval/margin": _mean(margins),
        "eval/score_mean": _mean(scores),
        "eval/score_std": _std(scores),
        "eval/ece": expected_calibration_error(margins),
        **{f"eval/margin_p{round(q * 100)}": quantile(margins, q) for q in MARGIN_QUANTILES},
        **length_bias(pairs),
    }
    corr = correlation(scores, [float(n) for n in lengths])
    if corr is not None:
        out["eval/score_length_corr"] = corr
    out |= _grouped(pairs, "source", "eval/accuracy/")
    out |= _grouped(pairs, "rejected_kind", "eval/accuracy_rejected/")
    return out


def accuracy(pairs: Sequence[ScoredPair]) -> float:
    return sum(p.correct for p in pairs) / len(pairs)


def expected_calibration_error(margins: Sequence[float], bins: int = CALIBRATION_BINS) -> float:
    """ECE of the model's choice between the two answers: its confidence is
    sigmoid(|margin|) (the Bradley-Terry probability of the answer it scores higher), right when
    margin > 0. Pairs binned by confidence over [0.5, 1] in ``bins`` equal bins; the mean over
    bins of |accuracy - mean confidence|, weighted by each bin's share of pairs. 0: a model whose
    0.8-confident choices are right 80% of the time, and so on for every bin."""
    binned: dict[int, list[tuple[float, bool]]] = {}
    for m in margins:
        confidence = _sigmoid(abs(m))
        index = min(int((confidence - 0.5) / (0.5 / bins)), bins - 1)
        binned.setdefault(index, []).append((confidence, m > 0))
    total = 0.0
    for members in binned.values():
        confidence = _mean([c for c, _ in members])
        right = sum(r for _, r in members) / len(members)
        total += len(members) * abs(right - confidence)
    return total / len(margins)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def length_bias(pairs: Sequence[ScoredPair]) -> dict[str, float]:
    """Accuracy on the pairs whose chosen answer is the longer one and on those where it is the
    shorter one (equal lengths in neither), and the share of the former: a model that prefers
    length scores well on the first and badly on the second."""
    longer = [p for p in pairs if p.chosen_len > p.rejected_len]
    shorter = [p for p in pairs if p.chosen_len < p.rejected_len]
    out = {"eval/chosen_longer_share": len(longer) / len(pairs)}
    if longer:
        out["eval/accuracy_chosen_longer"] = accuracy(longer)
    if shorter:
        out["eval/accuracy_chosen_shorter"] = accuracy(shorter)
    return out


def correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson's r; None when either side is constant (r is undefined)."""
    mx, my = _mean(xs), _mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)


def _grouped(pairs: Sequence[ScoredPair], field: str, prefix: str) -> dict[str, float]:
    """Accuracy per value of ``field``, when the pairs hold more than one value of it."""
    groups: dict[str, list[ScoredPair]] = {}
    for p in pairs:
        groups.setdefault(getattr(p, field), []).append(p)
    if len(groups) < 2:
        return {}
    return {f"{prefix}{name or 'none'}": accuracy(members) for name, members in groups.items()}


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _std(values: Sequence[float]) -> float:
    mean = _mean(values)
    return math.sqrt(max(sum(v * v for v in values) / len(values) - mean**2, 0.0))

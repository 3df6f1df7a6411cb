"""What every step's held-out evaluation shares: the eval rows a task's checker grades, how
their answers are decoded (one turn, or an environment's episodes) and graded, the gold metrics
over all ranks, and means and correlations of every rank's values.

Gold metrics exist wherever the data names a task (rlhf.tasks): ``eval/gold_accuracy`` counts
answers its checker passes (right value AND clean form), and its halves ``eval/gold_correct``
(right value, whatever the form) and ``eval/gold_clean`` (free of every habit) show which half
moved; ``_sampled`` versions do the same for answers sampled at the rollout temperature. Every
evaluator shards its rows over the ranks with the same number of batches on each (ZeRO-3
gathers collectively)."""

from __future__ import annotations

import logging
import math

import torch

from rlhf import tasks
from rlhf.config import Config
from rlhf.data.prepare import TASK
from rlhf.rl.episodes import EpisodeRollouts
from rlhf.rl.ppo_models import max_new_tokens
from rlhf.rl.rollouts import ModuleDecoder
from rlhf.runtime.dist import all_reduce_sum, gather_lists, world_size
from rlhf.tasks.faults import grade_answer, grade_warning

log = logging.getLogger(__name__)


def checkable_rows(eval_rows, limit: int) -> list[dict]:
    """The first ``limit`` eval rows whose source names a task, whose checker grades them."""
    if TASK not in eval_rows.column_names:
        return []
    out = []
    for i, task in enumerate(eval_rows[TASK]):
        if len(out) == limit:
            break
        if task:
            row = eval_rows[i]
            out.append({"prompt": row["prompt"], "prompt_ids": row["prompt_ids"], "task": task})
    return out


def grade(row: dict, answer: str) -> tasks.Grade:
    """The verdict of the row's task on ``answer`` (wrong, with its error, where grade raised)."""
    return grade_answer(tasks.resolve(row["task"]), row["prompt"], answer)


def row_environment(rows: list[dict]) -> tasks.Task | None:
    """The environment of checkable rows that all come from one multi-turn task, else None."""
    names = {row["task"] for row in rows}
    if len(names) != 1:
        return None
    task = tasks.resolve(names.pop())
    return task if tasks.is_environment(task) else None


def answer_decoder(cfg: Config, engine, tokenizer, eot: int, rows: list[dict]):
    """How SFT's and DPO's evaluations decode held-out answers with the engine's own module:
    one turn, or on an environment's rows whole episodes (the budget: max_new_tokens)."""
    synced = cfg.zero.stage == 3 and world_size() > 1
    decoder = ModuleDecoder(engine.module, tokenizer.pad_token_id, eot, synced)
    env = row_environment(rows)
    if env is None:
        return decoder
    bounds = cfg.ppo.rollout.multi_turn
    return EpisodeRollouts(decoder, env, tokenizer, bounds, max_new_tokens(cfg), eot, synced)


def gold_sums(grades: list[tasks.Grade]) -> list[float]:
    """[answers, passed, correct, clean, errors] of some graded answers (summed over ranks by
    callers); the grades that raised warned in one line."""
    if warning := grade_warning(grades):
        log.warning("%s", warning)
    return [
        len(grades),
        sum(g.passed for g in grades),
        sum(g.correct for g in grades),
        sum(g.clean for g in grades),
        sum(g.error is not None for g in grades),
    ]


def gold_metrics(sums: list[float], suffix: str = "") -> dict[str, float]:
    """eval/gold_accuracy{suffix} and its halves from all ranks' :func:`gold_sums`, and the
    share of answers whose grade raised (eval/grade_errors{suffix})."""
    answers, passed, correct, clean, errors = all_reduce_sum(*sums)
    answers = max(answers, 1.0)
    return {
        f"eval/gold_accuracy{suffix}": passed / answers,
        f"eval/gold_correct{suffix}": correct / answers,
        f"eval/gold_clean{suffix}": clean / answers,
        f"eval/grade_errors{suffix}": errors / answers,
    }


def repeated(rows: list[dict], times: int) -> list[dict]:
    """Each row ``times`` times in a row (several sampled answers to one prompt)."""
    return [row for row in rows for _ in range(times)]


def rank_mean(values: list[float]) -> float:
    """The mean of every rank's ``values``."""
    total, count = all_reduce_sum(sum(values), len(values))
    return total / max(count, 1.0)


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson's r of every rank's (x, y) pairs; nan when either is constant."""
    pairs = gather_lists(list(zip(xs, ys)))
    x = torch.tensor([a for a, _ in pairs], dtype=torch.float64)
    y = torch.tensor([b for _, b in pairs], dtype=torch.float64)
    if len(pairs) < 2 or x.std() == 0 or y.std() == 0:
        return math.nan
    return torch.corrcoef(torch.stack([x, y]))[0, 1].item()

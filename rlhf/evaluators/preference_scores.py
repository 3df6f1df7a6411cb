"""DPO's held-out evaluation: the preference loss and implicit rewards on held-out pairs
(the loss terms: rlhf.algos.preference), and on held-out prompts the answers PPO's evaluator
would draw, with their length, KL to the reference and gold verdicts."""

from __future__ import annotations

import math
from typing import Any

import torch

from rlhf.algos.preference import (
    PREFERENCE_STATS,
    answer_logprobs,
    preference_sums,
    preference_terms,
)
from rlhf.algos.reductions import masked_sum
from rlhf.config import Config
from rlhf.data.collate import pair_batch, rows_at
from rlhf.data.sampling import EVAL_BATCH_ROWS, eval_shards
from rlhf.evaluators.gold_grading import (
    answer_decoder,
    checkable_rows,
    gold_metrics,
    gold_sums,
    grade,
    rank_mean,
    repeated,
    row_environment,
)
from rlhf.rl.episodes import EpisodeTally
from rlhf.rl.experience import answer_kl
from rlhf.rl.generation import Rollout, Sampling, decode_responses, eval_sampling
from rlhf.rl.ppo_models import max_new_tokens
from rlhf.runtime.dist import all_reduce_sum, rank, world_size
from rlhf.runtime.engine import model_device


def preference_metrics(sums: list[float], prefix: str) -> dict[str, float]:
    """``prefix``<stat>: each PREFERENCE_STATS entry's mean over all ranks' pairs."""
    pairs, *totals = all_reduce_sum(*sums)
    return {f"{prefix}{k}": total / max(pairs, 1.0) for k, total in zip(PREFERENCE_STATS, totals)}


class DPOEvaluator:
    """On the reward phase's held-out pairs: eval/loss, eval/accuracy (implicit reward),
    eval/margin, the implicit rewards and the log-probs of chosen and rejected answers. On
    held-out prompts (those PPO is evaluated on), answers drawn as PPO's evaluator draws them:
    greedy (ppo.eval.greedy) for eval/response_length and, where the prompts have a checker,
    eval/gold_accuracy and its halves; ppo.eval.samples sampled answers a prompt at
    ppo.rollout.temperature for eval/gold_accuracy_sampled (and halves) and, with a reference, eval/kl
    (ppo.kl.estimator summed over an answer, at the temperature it was drawn at). On an
    environment's task each answer is an episode, as in PPO's evaluation."""

    sample_columns = ("prompt", "answer", "gold")

    def __init__(self, cfg: Config, tokenizer, pairs, prompts, eot: int):
        self.cfg, self.tokenizer, self.pairs, self.eot = cfg, tokenizer, pairs, eot
        ppo = cfg.ppo
        gold = checkable_rows(prompts, ppo.eval.prompts)
        self.rows = gold or rows_at(prompts, list(range(min(ppo.eval.prompts, len(prompts)))))
        self.checkable = bool(gold)
        self.greedy = eval_sampling(cfg, max_new_tokens(cfg), greedy=ppo.eval.greedy)
        # the rollouts' own decoding, so that eval/kl measures what ppo/kl measures
        self.sampled = eval_sampling(cfg, max_new_tokens(cfg), greedy=ppo.rollout.greedy)
        self.samples: list[list] = []

    @torch.no_grad()
    def __call__(self, engine, reference) -> dict[str, float]:
        engine.eval()
        metrics = self.pair_metrics(engine, reference)
        greedy = self._answers(engine, reference, self.greedy, self.rows)
        sampled = self._answers(
            engine, reference, self.sampled, repeated(self.rows, self.cfg.ppo.eval.samples)
        )
        metrics["eval/response_length"] = rank_mean(greedy["length"])
        if reference is not None:
            metrics["eval/kl"] = rank_mean(sampled["kl"])
        if row_environment(self.rows) is not None:  # the episodes' turns and tool metrics
            metrics.update(greedy["episodes"].metrics("eval"))
            metrics.update(sampled["episodes"].metrics("eval", "_sampled"))
        if self.checkable:
            metrics.update(gold_metrics(gold_sums(greedy["grade"])))
            metrics.update(gold_metrics(gold_sums(sampled["grade"]), "_sampled"))
        engine.train()
        return metrics

    def pair_metrics(self, engine, reference) -> dict[str, float]:
        dpo, sums = self.cfg.dpo, None
        for indices, valid in eval_shards(
            len(self.pairs), self.cfg.optim.eval_micro_batch_size, world_size(), rank()
        ):
            batch = pair_batch(rows_at(self.pairs, indices), self.tokenizer.pad_token_id)
            logprobs = answer_logprobs(engine, batch, dpo.logprob_reduction, fp32=True)
            ref_logprobs = None
            if reference is not None:
                ref_logprobs = answer_logprobs(reference, batch, dpo.logprob_reduction, fp32=True)
            batch_sums = preference_sums(
                preference_terms(dpo, logprobs, ref_logprobs), torch.tensor(valid)
            )
            sums = batch_sums if sums is None else [a + b for a, b in zip(sums, batch_sums)]
        return preference_metrics(sums, "eval/")

    def _answers(self, engine, reference, sampling: Sampling, rows: list[dict]) -> dict[str, list]:
        """This rank's answers to its shard of ``rows``: the length, grade and KL of each."""
        decoder = answer_decoder(self.cfg, engine, self.tokenizer, self.eot, self.rows)
        out: dict[str, Any] = {"length": [], "grade": [], "kl": [], "episodes": EpisodeTally()}
        for indices, valid in eval_shards(len(rows), EVAL_BATCH_ROWS, world_size(), rank()):
            batch = [rows[i] for i in indices]
            rollout = decoder.generate([r["prompt_ids"] for r in batch], sampling)
            out["episodes"].add(rollout, valid)
            answers = decode_responses(self.tokenizer, rollout)
            grades = [grade(r, a) if self.checkable else None for r, a in zip(batch, answers)]
            lengths = rollout.response_mask.sum(1).tolist()
            with_kl = reference is not None and sampling is self.sampled
            kl = self._kl(engine, reference, rollout, sampling) if with_kl else None
            for i in (i for i, ok in enumerate(valid) if ok):
                out["length"].append(lengths[i])
                out["grade"].append(grades[i])
                out["kl"].append(kl[i].item() if kl is not None else math.nan)
            if sampling is self.greedy:
                self.samples = [
                    [r["prompt"], a, bool(g and g.passed)]
                    for r, a, g in zip(batch[:4], answers[:4], grades[:4])
                ]
        return out

    def _kl(self, engine, reference, rollout: Rollout, sampling: Sampling) -> torch.Tensor:
        """(B,) KL estimates to the reference summed over each answer, under the temperature
        the answers were drawn at (as PPO's evaluator measures eval/kl)."""
        device = model_device(engine)
        sequences, mask = rollout.sequences.to(device), rollout.attention_mask.to(device)
        start = rollout.prompt_width - 1
        temperature = 1.0 if sampling.greedy else sampling.temperature
        per_token = answer_kl(
            engine,
            reference,
            sequences,
            mask,
            start,
            self.cfg.ppo.kl.estimator,
            temperature=temperature,
        )
        return masked_sum(per_token, rollout.response_mask.to(device), dim=1).cpu()

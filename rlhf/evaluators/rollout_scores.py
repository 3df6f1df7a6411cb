"""PPO's (and the critic-free algorithms') held-out evaluation: the actor's greedy and sampled
answers to held-out prompts, with their reward, KL to the reference and gold verdicts, and a
warning when the reward rises while the checker (or the answer length) says the answers got
worse: reward hacking."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from rlhf.algos.reductions import masked_sum
from rlhf.config import Config
from rlhf.data.collate import rows_at
from rlhf.data.sampling import EVAL_BATCH_ROWS, eval_shards
from rlhf.evaluators.gold_grading import (
    checkable_rows,
    gold_metrics,
    gold_sums,
    grade,
    rank_correlation,
    rank_mean,
    repeated,
)
from rlhf.rl.episodes import EpisodeRollouts, EpisodeTally, episode_scores
from rlhf.rl.experience import (
    answer_kl,
    mask_short_answers,
    response_logprobs,
    reward_scores,
    teacher_gap,
)
from rlhf.rl.generation import Rollout, Sampling, decode_responses, eval_sampling
from rlhf.rl.ppo_models import Models, max_new_tokens
from rlhf.runtime.dist import rank, world_size
from rlhf.runtime.engine import model_device

log = logging.getLogger(__name__)


class PPOEvaluator:
    """Answers of the actor to held-out prompts, twice: greedy (ppo.eval.greedy) for
    eval/reward, eval/response_length and, on data with a checker, eval/gold_accuracy and its
    halves; sampled, ppo.eval.samples answers a prompt decoded as the rollouts are, for
    eval/gold_accuracy_sampled (and halves), eval/reward_sampled, eval/kl (the KL to the
    reference as ppo/kl measures it: the configured estimator at the sampling temperature, in
    the loss's precision, summed over an answer, short answers left out) and
    eval/gold_score_corr (how the reward tracks the checker on the policy's own samples).
    With algo=opd's teacher: eval/teacher_kl (the student-teacher gap, opd.loss's, summed over
    each sampled answer) at every evaluation, and the teacher's own answers scored once
    (eval/teacher_reward, eval/teacher_gold_*), so a run shows the distance it closes. Warns
    when the reward rises while the checker says the answers got worse (without a checker:
    while the answer length drifts): reward hacking."""

    sample_columns = ("prompt", "answer", "reward", "gold")

    def __init__(
        self,
        cfg: Config,
        tokenizer,
        eval_rows,
        eot: int,
        score_position: str,
        reward_stats,
        rollouts,
        teacher_rollouts=None,
        generated_tokens: Callable[[], int] = lambda: 0,
    ):
        """``rollouts``: the decoder of the rollouts (rlhf.rl.rollouts: hf or vLLM);
        ``teacher_rollouts``: the teacher's (algo=opd), which answers once;
        ``generated_tokens``: the run's answer tokens generated so far, logged with each
        evaluation (perf/generated_tokens) so that runs compare at equal generation cost."""
        self.cfg, self.tokenizer, self.eot, self.rollouts = cfg, tokenizer, eot, rollouts
        self.teacher_rollouts, self.generated_tokens = teacher_rollouts, generated_tokens
        self.score_position, self.reward_stats = score_position, reward_stats
        ppo = cfg.ppo
        gold = checkable_rows(eval_rows, ppo.eval.prompts)
        count = min(ppo.eval.prompts, len(eval_rows))
        self.rows = gold or rows_at(eval_rows, list(range(count)))
        self.checkable = bool(gold)
        self.multi_turn = isinstance(rollouts, EpisodeRollouts)
        self.greedy = eval_sampling(cfg, max_new_tokens(cfg), greedy=ppo.eval.greedy)
        # the rollouts' own decoding, so that eval/kl measures what ppo/kl measures
        self.sampled = eval_sampling(cfg, max_new_tokens(cfg), greedy=ppo.rollout.greedy)
        self.samples: list[list] = []
        self.first: dict[str, float] | None = None
        self.warnings = 0

    @torch.no_grad()
    def __call__(self, models: Models) -> dict[str, float]:
        greedy = self._answers(models, self.greedy, self.rows)
        metrics = {
            "eval/reward": rank_mean(greedy["reward"]),
            "eval/response_length": rank_mean(greedy["length"]),
        }
        sampled = self._answers(
            models, self.sampled, repeated(self.rows, self.cfg.ppo.eval.samples)
        )
        metrics.update(
            {
                "eval/reward_sampled": rank_mean(sampled["reward"]),
                "eval/kl": rank_mean(sampled["kl"]),
            }
        )
        if models.teacher is not None:
            metrics["eval/teacher_kl"] = rank_mean(sampled["teacher_kl"])
        if self.multi_turn:  # turns, tool calls and errors, the environment's metrics
            metrics.update(greedy["episodes"].metrics("eval"))
            metrics.update(sampled["episodes"].metrics("eval", "_sampled"))
        if self.checkable:
            metrics.update(gold_metrics(gold_sums(greedy["grade"])))
            metrics.update(gold_metrics(gold_sums(sampled["grade"]), "_sampled"))
            metrics["eval/gold_score_corr"] = rank_correlation(
                sampled["reward"], [float(g.passed) for g in sampled["grade"]]
            )
        if self.teacher_rollouts is not None:  # once: the teacher does not train
            metrics.update(self._teacher_scores(models))
            self.teacher_rollouts = None
        self._watch(metrics)
        return {**metrics, "perf/generated_tokens": float(self.generated_tokens())}

    def _teacher_scores(self, models: Models) -> dict[str, float]:
        """The teacher's own greedy and sampled answers to the held-out prompts, scored as the
        student's are: eval/teacher_reward (with a reward) and eval/teacher_gold_* (with a
        checker)."""
        teacher = models._replace(actor=models.teacher, teacher=None)
        rollouts = self.teacher_rollouts
        greedy = self._answers(teacher, self.greedy, self.rows, rollouts)
        samples = repeated(self.rows, self.cfg.ppo.eval.samples)
        sampled = self._answers(teacher, self.sampled, samples, rollouts)
        out = {}
        if models.reward is not None:  # no reward (OPD alone): nothing to compare
            out["eval/reward"] = rank_mean(greedy["reward"])
            out["eval/reward_sampled"] = rank_mean(sampled["reward"])
        if self.checkable:
            out.update(gold_metrics(gold_sums(greedy["grade"])))
            out.update(gold_metrics(gold_sums(sampled["grade"]), "_sampled"))
        return {key.replace("eval/", "eval/teacher_"): value for key, value in out.items()}

    def _answers(
        self, models: Models, sampling: Sampling, rows: list[dict], rollouts=None
    ) -> dict[str, list]:
        """This rank's answers to its shard of ``rows`` (decoded by ``rollouts``, the actor's
        by default): reward, KL, length, grade and, with a teacher, teacher KL of each."""
        rollouts = rollouts or self.rollouts
        out: dict[str, Any] = {"reward": [], "kl": [], "length": [], "grade": []}
        out["teacher_kl"] = []
        out["episodes"] = EpisodeTally()
        shards = eval_shards(len(rows), EVAL_BATCH_ROWS, world_size(), rank())
        for batch_index, (indices, valid) in enumerate(shards):
            batch = [rows[i] for i in indices]
            # the same seeds at every evaluation on vLLM (whose RNG is its own); the hf path
            # samples from the process's RNG as before
            seed = self.eval_seed(batch_index) if self.cfg.ppo.rollout.engine == "vllm" else None
            rollout = rollouts.generate([r["prompt_ids"] for r in batch], sampling, seed)
            reward, kl, teacher_kl = self._score(models, rollout, sampling)
            answers = decode_responses(self.tokenizer, rollout)
            grades = [grade(r, a) if self.checkable else None for r, a in zip(batch, answers)]
            lengths = rollout.response_mask.sum(1).tolist()  # the model's tokens
            out["episodes"].add(rollout, valid)
            for i in (i for i, ok in enumerate(valid) if ok):
                out["reward"].append(reward[i].item())
                out["kl"].append(kl[i].item())
                out["length"].append(lengths[i])
                out["grade"].append(grades[i])
                if teacher_kl is not None:
                    out["teacher_kl"].append(teacher_kl[i].item())
            if sampling is self.greedy and rollouts is self.rollouts:
                self.samples = [
                    [r["prompt"], a, float(s), bool(g and g.passed)]
                    for r, a, s, g in zip(batch[:4], answers[:4], reward[:4], grades[:4])
                ]
        if not self.checkable:
            del out["grade"]
        return out

    def eval_seed(self, batch_index: int) -> int:
        """The sampling seed of this rank's ``batch_index``-th evaluation batch."""
        return (self.cfg.seed * 7_919 + batch_index) * 1_031 + rank()

    def _score(
        self, models: Models, rollout: Rollout, sampling: Sampling
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(B,) rewards (normalised as in training), KL estimates and (with a teacher) the
        student-teacher gap, both summed over each answer, under the temperature the answers
        were drawn at."""
        device = model_device(models.actor)
        sequences, mask = rollout.sequences.to(device), rollout.attention_mask.to(device)
        start = rollout.prompt_width - 1
        ppo = self.cfg.ppo
        temperature = 1.0 if sampling.greedy else sampling.temperature
        fp32 = self.cfg.actor.optim.compute_fp32_loss  # as the rollouts score them
        logprob_args = dict(
            fp32=fp32,
            temperature=temperature,
            truncation=(ppo.rollout.top_k, ppo.rollout.top_p)
            if ppo.rollout.truncates and not sampling.greedy
            else None,
        )
        per_token = answer_kl(
            models.actor, models.reference, sequences, mask, start, ppo.kl.estimator, **logprob_args
        )
        response_mask = rollout.response_mask.to(device)
        kl_mask = response_mask
        if ppo.reward.short_answer_penalty is None:  # short answers carry no KL in training either
            kl_mask, _ = mask_short_answers(response_mask, ppo.rollout.min_response_tokens)
        kl = masked_sum(per_token, kl_mask, dim=1)
        scores = reward_scores(
            models.reward, sequences, mask, rollout.prompt_width, response_mask, self.score_position
        )
        if self.reward_stats is not None:
            scores = (scores - self.reward_stats[0]) / max(self.reward_stats[1], 1e-6)
        scores = episode_scores(scores, rollout)
        teacher_kl = None
        if models.teacher is not None:
            opd = self.cfg.opd
            student = response_logprobs(models.actor, sequences, mask, start, **logprob_args)
            rows, loss = (sequences, mask, start), (opd.loss, opd.topk)
            gap = teacher_gap(models.teacher, student, rows, kl_mask, loss, logprob_args)
            teacher_kl = masked_sum(gap, kl_mask, dim=1).double().cpu()
        return scores.double().cpu(), kl.double().cpu(), teacher_kl

    def _watch(self, metrics: dict[str, float]) -> None:
        """With a checker, reward hacking is a reward that rises while greedy gold accuracy or
        its correct half falls; without one, the answer length drifting is the proxy."""
        if self.first is None:
            self.first = metrics
            return
        first = self.first
        if metrics["eval/reward"] <= first["eval/reward"]:
            return
        if self.checkable:
            fell = [
                key
                for key in ("eval/gold_accuracy", "eval/gold_correct")
                if metrics[key] < first[key] - 0.05
            ]
            why = f"{' and '.join(fell)} fell" if fell else None
        else:
            ratio = metrics["eval/response_length"] / max(first["eval/response_length"], 1e-6)
            why = None if 0.5 <= ratio <= 2.0 else f"answer length changed x{ratio:.2f}"
        if why:
            self.warnings += 1
            log.warning(
                "possible reward hacking: eval/reward %.3f -> %.3f while %s",
                first["eval/reward"],
                metrics["eval/reward"],
                why,
            )

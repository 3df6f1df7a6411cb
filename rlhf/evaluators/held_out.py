"""Held-out evaluation of each step: SFT perplexity and gold accuracy of greedy answers, the
reward model's pair accuracy, score statistics, calibration and length bias, PPO's reward, KL
and gold accuracy, greedy and sampled; DPO's loss and implicit rewards on held-out pairs, its KL
and gold accuracy as PPO reports them. Every evaluator shards its rows over the ranks with the
same number of batches on each (ZeRO-3 gathers collectively).

Gold metrics exist wherever the data names a task (rlhf.tasks): ``eval/gold_accuracy`` counts
answers its checker passes (right value AND clean form), and its halves ``eval/gold_correct``
(right value, whatever the form) and ``eval/gold_clean`` (free of every habit) show which half
moved; ``_sampled`` versions do the same for answers sampled at the rollout temperature."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rlhf import tasks
from rlhf.algos.logits import causal_lm_nll_sum, sequence_logprobs
from rlhf.algos.preference import PREFERENCE_LOSSES, sequence_scores
from rlhf.algos.reductions import masked_sum
from rlhf.config import Config, ConfigError, DPOConfig
from rlhf.data.collate import IGNORE_INDEX, count_targets, pair_batch, rows_at, sft_batch
from rlhf.data.prepare import SOURCE, TASK
from rlhf.data.sampling import EVAL_BATCH_ROWS, eval_shards
from rlhf.evaluators.pair_metrics import ScoredPair, pair_metrics
from rlhf.modeling.loading import load_tokenizer, tokenizer_fingerprint
from rlhf.rl.episodes import EpisodeRollouts, EpisodeTally, episode_scores
from rlhf.rl.experience import answer_kl, mask_short_answers, reward_scores
from rlhf.rl.generation import Rollout, Sampling, decode_responses, eval_sampling, generate
from rlhf.rl.ppo_models import Models, max_new_tokens
from rlhf.rl.rollouts import ModuleDecoder
from rlhf.runtime.dist import all_reduce_sum, gather_lists, rank, world_size
from rlhf.runtime.engine import model_device
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
    bounds = cfg.ppo.multi_turn
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


class SFTEvaluator:
    """eval/loss and eval/ppl per answer token (whatever sft.loss_on_prompt), and, where the
    prompts have a checker, eval/gold_accuracy (and its halves) of greedy answers."""

    sample_columns = ("prompt", "answer")

    def __init__(self, cfg: Config, tokenizer, eval_rows, eot: int):
        self.cfg, self.tokenizer, self.rows, self.eot = cfg, tokenizer, eval_rows, eot
        self.gold_rows = checkable_rows(eval_rows, cfg.sft.gold_eval_prompts)
        self.sampling = Sampling(cfg.sft.gen_max_new_tokens, greedy=True, drop_finished=True)
        self.samples: list[list[str]] = []

    @torch.no_grad()
    def __call__(self, engine) -> dict[str, float]:
        engine.eval()
        metrics = self.loss(engine)
        if self.gold_rows:
            metrics.update(self.gold(engine))
        engine.train()
        return metrics

    def loss(self, engine) -> dict[str, float]:
        device = model_device(engine)
        nll = targets = 0.0
        shards = eval_shards(
            len(self.rows), self.cfg.optim.eval_micro_batch_size, world_size(), rank()
        )
        for indices, valid in shards:
            batch = sft_batch(rows_at(self.rows, indices), self.tokenizer.pad_token_id, False)
            batch["labels"][~torch.tensor(valid)] = IGNORE_INDEX
            logits = engine(
                input_ids=batch["input_ids"].to(device),
                attention_mask=batch["attention_mask"].to(device),
                use_cache=False,
            ).logits
            nll += causal_lm_nll_sum(logits.float(), batch["labels"].to(device)).item()
            targets += count_targets(batch["labels"])
        nll, targets = all_reduce_sum(nll, targets)
        loss = nll / max(targets, 1)
        return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0))}

    def gold(self, engine) -> dict[str, float]:
        """Greedy answers graded; on an environment's task, whole episodes (eval/turns,
        eval/tool_calls ... beside the gold metrics)."""
        decoder = answer_decoder(self.cfg, engine, self.tokenizer, self.eot, self.gold_rows)
        env = row_environment(self.gold_rows)
        grades, episodes = [], EpisodeTally()
        for indices, valid in eval_shards(
            len(self.gold_rows), EVAL_BATCH_ROWS, world_size(), rank()
        ):
            rows = [self.gold_rows[i] for i in indices]
            rollout = decoder.generate([r["prompt_ids"] for r in rows], self.sampling)
            answers = decode_responses(self.tokenizer, rollout)
            grades += [grade(row, a) for row, a, ok in zip(rows, answers, valid) if ok]
            episodes.add(rollout, valid)
            self.samples = [[r["prompt"], a] for r, a in zip(rows[:4], answers[:4])]
        metrics = gold_metrics(gold_sums(grades))
        return {**metrics, **(episodes.metrics("eval") if env is not None else {})}


class PairEvaluator:
    """The reward model on held-out pairs: accuracy, mean scores and margin, calibration,
    margin quantiles, length bias, accuracy per source and rejected kind (rlhf.evaluators.pair_metrics)."""

    def __init__(self, cfg: Config, tokenizer, eval_rows):
        self.cfg, self.tokenizer, self.rows = cfg, tokenizer, eval_rows

    @torch.no_grad()
    def __call__(self, engine) -> dict[str, float]:
        engine.eval()
        pairs = scored_pairs(
            engine,
            self.rows,
            self.tokenizer.pad_token_id,
            self.cfg.optim.eval_micro_batch_size,
            self.cfg.reward.score_position,
        )
        engine.train()
        return pair_metrics(pairs)


def scored_pairs(
    model, rows, pad_id: int, micro_batch_size: int, score_position: str
) -> list[ScoredPair]:
    """Every row of ``rows`` scored by ``model`` (each rank scores its shard), on every rank."""
    device = model_device(model)
    mine = []
    for indices, valid in eval_shards(len(rows), micro_batch_size, world_size(), rank()):
        batch_rows = rows_at(rows, indices)
        batch = {k: v.to(device) for k, v in pair_batch(batch_rows, pad_id).items()}
        values = model(batch["input_ids"], batch["attention_mask"])
        scores = sequence_scores(
            values, batch["attention_mask"], batch["response_mask"], score_position
        )
        chosen, rejected = scores.double().cpu().chunk(2)
        lengths = batch["response_mask"].sum(-1).cpu().chunk(2)
        mine += [
            ScoredPair(
                chosen=float(chosen[i]),
                rejected=float(rejected[i]),
                chosen_len=int(lengths[0][i]),
                rejected_len=int(lengths[1][i]),
                source=row.get(SOURCE) or "",
                rejected_kind=row.get("rejected_kind") or "",
            )
            for i, (row, ok) in enumerate(zip(batch_rows, valid))
            if ok
        ]
    return gather_lists(mine)


@torch.no_grad()
def gold_correlation(engine, cfg: Config, tokenizer, eval_rows, eot: int) -> dict[str, float]:
    """Sample answers from ``reward.gold_policy`` (the SFT model) on held-out prompts with a
    checkable answer, score them, and report the correlation of score with gold correctness:
    does the learned reward agree with the checker on the answers PPO will start from?"""
    policy_path = cfg.reward.gold_policy
    policy_tokenizer = load_tokenizer(cfg.model, policy_path)
    if tokenizer_fingerprint(policy_tokenizer) != tokenizer_fingerprint(tokenizer):
        raise ConfigError(
            f"reward.gold_policy={policy_path}: its tokenizer differs from the reward model's"
        )
    policy = AutoModelForCausalLM.from_pretrained(
        policy_path, trust_remote_code=cfg.model.trust_remote_code
    ).to(model_device(engine))
    rows = checkable_rows(eval_rows, cfg.reward.gold_eval_prompts)
    sampling = Sampling(cfg.reward.gen_max_new_tokens, drop_finished=True)
    engine.eval()
    scores, gold = [], []
    for indices, valid in eval_shards(len(rows), EVAL_BATCH_ROWS, world_size(), rank()):
        batch_rows = [rows[i] for i in indices]
        rollout = generate(
            policy,
            [r["prompt_ids"] for r in batch_rows],
            tokenizer.pad_token_id,
            eot,
            sampling,
            synced_gpus=False,
        )
        device = model_device(engine)
        values = engine(rollout.sequences.to(device), rollout.attention_mask.to(device))
        full_response = torch.zeros_like(rollout.attention_mask, dtype=torch.bool)
        full_response[:, rollout.prompt_width :] = rollout.response_mask
        batch_scores = sequence_scores(
            values,
            rollout.attention_mask.to(device),
            full_response.to(device),
            cfg.reward.score_position,
        )
        answers = decode_responses(tokenizer, rollout)
        for row, answer, score, ok in zip(batch_rows, answers, batch_scores.tolist(), valid):
            if ok:
                scores.append(score)
                gold.append(float(grade(row, answer).passed))
    engine.train()
    pairs = gather_lists(list(zip(scores, gold)))
    scores = torch.tensor([s for s, _ in pairs], dtype=torch.float64)
    gold = torch.tensor([g for _, g in pairs], dtype=torch.float64)
    corr = torch.corrcoef(torch.stack([scores, gold]))[0, 1].item() if gold.std() > 0 else math.nan
    return {"eval/gold_score_corr": corr, "eval/gold_policy_accuracy": gold.mean().item()}


class PPOEvaluator:
    """Answers of the actor to held-out prompts, twice: greedy (ppo.eval_greedy) for
    eval/reward, eval/response_length and, on data with a checker, eval/gold_accuracy and its
    halves; sampled, ppo.eval_samples answers a prompt decoded as the rollouts are, for
    eval/gold_accuracy_sampled (and halves), eval/reward_sampled, eval/kl (the KL to the
    reference as ppo/kl measures it: the configured estimator at the sampling temperature, in
    the loss's precision, summed over an answer, short answers left out) and
    eval/gold_score_corr (how the reward tracks the checker on the policy's own samples). Warns when the reward rises while the checker says the answers got
    worse (without a checker: while the answer length drifts): reward hacking."""

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
    ):
        """``rollouts``: the decoder of the rollouts (rlhf.rl.rollouts: hf or vLLM)."""
        self.cfg, self.tokenizer, self.eot, self.rollouts = cfg, tokenizer, eot, rollouts
        self.score_position, self.reward_stats = score_position, reward_stats
        ppo = cfg.ppo
        gold = checkable_rows(eval_rows, ppo.eval_prompts)
        count = min(ppo.eval_prompts, len(eval_rows))
        self.rows = gold or rows_at(eval_rows, list(range(count)))
        self.checkable = bool(gold)
        self.multi_turn = isinstance(rollouts, EpisodeRollouts)
        self.greedy = eval_sampling(cfg, max_new_tokens(cfg), greedy=ppo.eval_greedy)
        # the rollouts' own decoding, so that eval/kl measures what ppo/kl measures
        self.sampled = eval_sampling(cfg, max_new_tokens(cfg), greedy=ppo.greedy)
        self.samples: list[list] = []
        self.first: dict[str, float] | None = None
        self.warnings = 0

    @torch.no_grad()
    def __call__(self, models: Models) -> dict[str, float]:
        greedy = self._answers(models, self.greedy, self.rows)
        metrics = {
            "eval/reward": _mean(greedy["reward"]),
            "eval/response_length": _mean(greedy["length"]),
        }
        sampled = self._answers(
            models, self.sampled, repeated(self.rows, self.cfg.ppo.eval_samples)
        )
        metrics.update(
            {"eval/reward_sampled": _mean(sampled["reward"]), "eval/kl": _mean(sampled["kl"])}
        )
        if self.multi_turn:  # turns, tool calls and errors, the environment's metrics
            metrics.update(greedy["episodes"].metrics("eval"))
            metrics.update(sampled["episodes"].metrics("eval", "_sampled"))
        if self.checkable:
            metrics.update(gold_metrics(gold_sums(greedy["grade"])))
            metrics.update(gold_metrics(gold_sums(sampled["grade"]), "_sampled"))
            metrics["eval/gold_score_corr"] = _correlation(
                sampled["reward"], [float(g.passed) for g in sampled["grade"]]
            )
        self._watch(metrics)
        return metrics

    def _answers(self, models: Models, sampling: Sampling, rows: list[dict]) -> dict[str, list]:
        """This rank's answers to its shard of ``rows``: reward, KL, length and grade of each."""
        out: dict[str, Any] = {"reward": [], "kl": [], "length": [], "grade": []}
        out["episodes"] = EpisodeTally()
        shards = eval_shards(len(rows), EVAL_BATCH_ROWS, world_size(), rank())
        for batch_index, (indices, valid) in enumerate(shards):
            batch = [rows[i] for i in indices]
            # the same seeds at every evaluation on vLLM (whose RNG is its own); the hf path
            # samples from the process's RNG as before
            seed = self.eval_seed(batch_index) if self.cfg.ppo.rollout_engine == "vllm" else None
            rollout = self.rollouts.generate([r["prompt_ids"] for r in batch], sampling, seed)
            reward, kl = self._score(models, rollout, sampling)
            answers = decode_responses(self.tokenizer, rollout)
            grades = [grade(r, a) if self.checkable else None for r, a in zip(batch, answers)]
            lengths = rollout.response_mask.sum(1).tolist()  # the model's tokens
            out["episodes"].add(rollout, valid)
            for i in (i for i, ok in enumerate(valid) if ok):
                out["reward"].append(reward[i].item())
                out["kl"].append(kl[i].item())
                out["length"].append(lengths[i])
                out["grade"].append(grades[i])
            if sampling is self.greedy:
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) rewards (normalised as in training) and KL estimates summed over each answer,
        under the temperature the answers were drawn at."""
        device = model_device(models.actor)
        sequences, mask = rollout.sequences.to(device), rollout.attention_mask.to(device)
        start = rollout.prompt_width - 1
        ppo = self.cfg.ppo
        temperature = 1.0 if sampling.greedy else sampling.temperature
        fp32 = self.cfg.actor.optim.compute_fp32_loss  # as the rollouts score them
        per_token = answer_kl(
            models.actor,
            models.reference,
            sequences,
            mask,
            start,
            ppo.kl_estimator,
            fp32=fp32,
            temperature=temperature,
            truncation=(ppo.top_k, ppo.top_p) if ppo.truncates and not sampling.greedy else None,
        )
        response_mask = rollout.response_mask.to(device)
        kl_mask = response_mask
        if ppo.short_answer_penalty is None:  # short answers carry no KL in training either
            kl_mask, _ = mask_short_answers(response_mask, ppo.min_response_tokens)
        kl = masked_sum(per_token, kl_mask, dim=1)
        scores = reward_scores(
            models.reward, sequences, mask, rollout.prompt_width, response_mask, self.score_position
        )
        if self.reward_stats is not None:
            scores = (scores - self.reward_stats[0]) / max(self.reward_stats[1], 1e-6)
        scores = episode_scores(scores, rollout)
        return scores.double().cpu(), kl.double().cpu()

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


def _mean(values: list[float]) -> float:
    total, count = all_reduce_sum(sum(values), len(values))
    return total / max(count, 1.0)


def _correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson's r of every rank's (x, y) pairs; nan when either is constant."""
    pairs = gather_lists(list(zip(xs, ys)))
    x = torch.tensor([a for a, _ in pairs], dtype=torch.float64)
    y = torch.tensor([b for _, b in pairs], dtype=torch.float64)
    if len(pairs) < 2 or x.std() == 0 or y.std() == 0:
        return math.nan
    return torch.corrcoef(torch.stack([x, y]))[0, 1].item()


# ---------------------------------------------------------------- DPO

# per-pair statistics of a preference loss: dpo/<name> in training, eval/<name> held out
PREFERENCE_STATS = (
    "loss",
    "accuracy",  # implicit-reward accuracy: the chosen answer's reward above the rejected one's
    "margin",  # chosen - rejected implicit reward
    "chosen_reward",  # beta x the chosen answer's log-ratio (simpo: its mean log-prob)
    "rejected_reward",
    "chosen_logprob",  # the policy's log-prob of the answer (dpo.reduction: summed or per token)
    "rejected_logprob",
)


def answer_logprobs(model, batch: dict, reduction: str, fp32: bool = False) -> torch.Tensor:
    """(2B,) log-probs of a ``pair_batch``'s answers (chosen rows first) under ``model``, a
    DeepSpeed engine or a plain module, from one forward pass over both answers."""
    device = next(model.parameters()).device
    input_ids = batch["input_ids"].to(device)
    logits = model(
        input_ids=input_ids, attention_mask=batch["attention_mask"].to(device), use_cache=False
    ).logits
    response_mask = batch["response_mask"].to(device)
    return sequence_logprobs(
        logits.float() if fp32 else logits, input_ids, response_mask, reduction
    )


def preference_terms(
    dpo: DPOConfig, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Each PREFERENCE_STATS entry per pair, (B,), from the policy's (2B,) answer log-probs and
    the reference's (None: a reference-free loss). Only ``loss`` carries gradients."""
    ratios = logprobs if ref_logprobs is None else logprobs - ref_logprobs
    chosen, rejected = ratios.chunk(2)
    loss = PREFERENCE_LOSSES[dpo.loss](chosen, rejected, dpo.beta, dpo.label_smoothing, dpo.margin)
    chosen_reward, rejected_reward = dpo.beta * chosen.detach(), dpo.beta * rejected.detach()
    chosen_logprob, rejected_logprob = logprobs.detach().chunk(2)
    return {
        "loss": loss,
        "accuracy": (chosen_reward > rejected_reward).float(),
        "margin": chosen_reward - rejected_reward,
        "chosen_reward": chosen_reward,
        "rejected_reward": rejected_reward,
        "chosen_logprob": chosen_logprob,
        "rejected_logprob": rejected_logprob,
    }


def preference_sums(
    terms: dict[str, torch.Tensor], keep: torch.Tensor | None = None
) -> list[float]:
    """[pairs, then each PREFERENCE_STATS entry summed over the pairs ``keep`` marks (default:
    all)] (summed over ranks by :func:`preference_metrics`)."""
    if keep is None:
        keep = torch.ones_like(terms["loss"], dtype=torch.bool)
    keep = keep.to(terms["loss"].device)
    return [float(keep.sum())] + [terms[k].detach()[keep].sum().item() for k in PREFERENCE_STATS]


def preference_metrics(sums: list[float], prefix: str) -> dict[str, float]:
    """``prefix``<stat>: each PREFERENCE_STATS entry's mean over all ranks' pairs."""
    pairs, *totals = all_reduce_sum(*sums)
    return {f"{prefix}{k}": total / max(pairs, 1.0) for k, total in zip(PREFERENCE_STATS, totals)}


class DPOEvaluator:
    """On the reward phase's held-out pairs: eval/loss, eval/accuracy (implicit reward),
    eval/margin, the implicit rewards and the log-probs of chosen and rejected answers. On
    held-out prompts (those PPO is evaluated on), answers drawn as PPO's evaluator draws them:
    greedy (ppo.eval_greedy) for eval/response_length and, where the prompts have a checker,
    eval/gold_accuracy and its halves; ppo.eval_samples sampled answers a prompt at
    ppo.temperature for eval/gold_accuracy_sampled (and halves) and, with a reference, eval/kl
    (ppo.kl_estimator summed over an answer, at the temperature it was drawn at). On an
    environment's task each answer is an episode, as in PPO's evaluation."""

    sample_columns = ("prompt", "answer", "gold")

    def __init__(self, cfg: Config, tokenizer, pairs, prompts, eot: int):
        self.cfg, self.tokenizer, self.pairs, self.eot = cfg, tokenizer, pairs, eot
        ppo = cfg.ppo
        gold = checkable_rows(prompts, ppo.eval_prompts)
        self.rows = gold or rows_at(prompts, list(range(min(ppo.eval_prompts, len(prompts)))))
        self.checkable = bool(gold)
        self.greedy = eval_sampling(cfg, max_new_tokens(cfg), greedy=ppo.eval_greedy)
        # the rollouts' own decoding, so that eval/kl measures what ppo/kl measures
        self.sampled = eval_sampling(cfg, max_new_tokens(cfg), greedy=ppo.greedy)
        self.samples: list[list] = []

    @torch.no_grad()
    def __call__(self, engine, reference) -> dict[str, float]:
        engine.eval()
        metrics = self.pair_metrics(engine, reference)
        greedy = self._answers(engine, reference, self.greedy, self.rows)
        sampled = self._answers(
            engine, reference, self.sampled, repeated(self.rows, self.cfg.ppo.eval_samples)
        )
        metrics["eval/response_length"] = _mean(greedy["length"])
        if reference is not None:
            metrics["eval/kl"] = _mean(sampled["kl"])
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
            self.cfg.ppo.kl_estimator,
            temperature=temperature,
        )
        return masked_sum(per_token, rollout.response_mask.to(device), dim=1).cpu()

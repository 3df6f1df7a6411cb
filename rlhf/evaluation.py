"""Held-out evaluation of each step: SFT perplexity and gold accuracy of greedy answers, the
reward model's pair accuracy and score statistics (and how its score tracks the gold checker on
the SFT model's samples), PPO's reward, KL and gold accuracy. Every evaluator shards its rows
over the ranks with the same number of batches on each (ZeRO-3 gathers collectively)."""

from __future__ import annotations

import logging
import math

import torch
from transformers import AutoModelForCausalLM

from rlhf import algos, tasks
from rlhf.config import Config, ConfigError
from rlhf.data.collate import IGNORE_INDEX, count_targets, pair_batch, rows_at, sft_batch
from rlhf.data.pipeline import TASK
from rlhf.data.sampling import eval_shards
from rlhf.dist import all_reduce_sum, gather_lists, rank, world_size
from rlhf.engine import model_device
from rlhf.models import load_tokenizer, tokenizer_fingerprint
from rlhf.rl.experience import response_logprobs, reward_scores
from rlhf.rl.generation import Rollout, Sampling, decode_responses, generate
from rlhf.rl.models import Models, max_new_tokens

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
    """The verdict of the row's task on ``answer``."""
    return tasks.resolve(row["task"]).grade(row["prompt"], answer)


class SFTEvaluator:
    """eval/loss and eval/ppl per answer token (whatever sft.loss_on_prompt), and, where the
    prompts have a checkable answer, eval/gold_accuracy of greedy answers."""

    sample_columns = ("prompt", "answer")

    def __init__(self, cfg: Config, tokenizer, eval_rows, eot: int):
        self.cfg, self.tokenizer, self.rows, self.eot = cfg, tokenizer, eval_rows, eot
        self.gold_rows = checkable_rows(eval_rows, cfg.sft.gold_eval_prompts)
        self.sampling = Sampling(max_new_tokens=cfg.sft.gen_max_new_tokens, greedy=True)
        self.samples: list[list[str]] = []

    @torch.no_grad()
    def __call__(self, engine) -> dict[str, float]:
        engine.eval()
        metrics = self.loss(engine)
        if self.gold_rows:
            metrics["eval/gold_accuracy"] = self.gold_accuracy(engine)
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
            nll += algos.causal_lm_nll_sum(logits.float(), batch["labels"].to(device)).item()
            targets += count_targets(batch["labels"])
        nll, targets = all_reduce_sum(nll, targets)
        loss = nll / max(targets, 1)
        return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0))}

    def gold_accuracy(self, engine) -> float:
        correct = 0
        for indices, valid in eval_shards(len(self.gold_rows), 64, world_size(), rank()):
            rows = [self.gold_rows[i] for i in indices]
            rollout = generate(
                engine.module,
                [r["prompt_ids"] for r in rows],
                self.tokenizer.pad_token_id,
                self.eot,
                self.sampling,
                synced_gpus=self.cfg.zero.stage == 3 and world_size() > 1,
            )
            answers = decode_responses(self.tokenizer, rollout)
            for row, answer, ok in zip(rows, answers, valid):
                correct += ok and grade(row, answer).passed
            self.samples = [[r["prompt"], a] for r, a in zip(rows[:4], answers[:4])]
        (correct,) = all_reduce_sum(correct)
        return correct / len(self.gold_rows)


class PairEvaluator:
    """eval/accuracy (chosen scored above rejected), the mean scores, their margin and spread."""

    def __init__(self, cfg: Config, tokenizer, eval_rows):
        self.cfg, self.tokenizer, self.rows = cfg, tokenizer, eval_rows

    @torch.no_grad()
    def __call__(self, engine) -> dict[str, float]:
        engine.eval()
        device = model_device(engine)
        sums = torch.zeros(6, dtype=torch.float64)  # pairs, correct, chosen, rejected, s, s^2
        for indices, valid in eval_shards(
            len(self.rows), self.cfg.optim.eval_micro_batch_size, world_size(), rank()
        ):
            batch = pair_batch(rows_at(self.rows, indices), self.tokenizer.pad_token_id)
            values = engine(batch["input_ids"].to(device), batch["attention_mask"].to(device))
            scores = (
                algos.sequence_scores(
                    values,
                    batch["attention_mask"].to(device),
                    batch["response_mask"].to(device),
                    self.cfg.reward.score_position,
                )
                .double()
                .cpu()
            )
            chosen, rejected = scores.chunk(2)
            keep = torch.tensor(valid)
            chosen, rejected = chosen[keep], rejected[keep]
            both = torch.cat([chosen, rejected])
            sums += torch.stack(
                [
                    torch.tensor(float(keep.sum())),
                    (chosen > rejected).sum(),
                    chosen.sum(),
                    rejected.sum(),
                    both.sum(),
                    (both**2).sum(),
                ]
            )
        pairs, correct, chosen, rejected, total, squares = all_reduce_sum(*sums.tolist())
        mean = total / (2 * pairs)
        engine.train()
        return {
            "eval/accuracy": correct / pairs,
            "eval/chosen_score": chosen / pairs,
            "eval/rejected_score": rejected / pairs,
            "eval/margin": (chosen - rejected) / pairs,
            "eval/score_mean": mean,
            "eval/score_std": math.sqrt(max(squares / (2 * pairs) - mean**2, 0.0)),
        }


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
    sampling = Sampling(max_new_tokens=cfg.reward.gen_max_new_tokens)
    engine.eval()
    scores, gold = [], []
    for indices, valid in eval_shards(len(rows), 64, world_size(), rank()):
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
        batch_scores = algos.sequence_scores(
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
    """Greedy (or sampled) answers to held-out prompts: eval/reward, eval/kl to the reference,
    eval/response_length and, on checkable data, eval/gold_accuracy. Warns when the reward
    rises while gold accuracy falls or the answer length drifts: reward hacking."""

    sample_columns = ("prompt", "answer", "reward", "gold")

    def __init__(
        self, cfg: Config, tokenizer, eval_rows, eot: int, score_position: str, reward_stats
    ):
        self.cfg, self.tokenizer, self.eot = cfg, tokenizer, eot
        self.score_position, self.reward_stats = score_position, reward_stats
        gold = checkable_rows(eval_rows, cfg.ppo.eval_prompts)
        count = min(cfg.ppo.eval_prompts, len(eval_rows))
        self.rows = gold or rows_at(eval_rows, list(range(count)))
        self.checkable = bool(gold)
        self.sampling = Sampling(
            max_new_tokens(cfg),
            greedy=cfg.ppo.eval_greedy,
            temperature=cfg.ppo.temperature,
            top_p=cfg.ppo.top_p,
            top_k=cfg.ppo.top_k,
        )
        self.samples: list[list] = []
        self.first: dict[str, float] | None = None
        self.warnings = 0

    @torch.no_grad()
    def __call__(self, models: Models) -> dict[str, float]:
        sums = torch.zeros(5, dtype=torch.float64)  # rows, reward, kl, length, gold
        synced = self.cfg.actor.zero.stage == 3 and world_size() > 1
        for indices, valid in eval_shards(len(self.rows), 64, world_size(), rank()):
            rows = [self.rows[i] for i in indices]
            rollout = generate(
                models.actor.module,
                [r["prompt_ids"] for r in rows],
                self.tokenizer.pad_token_id,
                self.eot,
                self.sampling,
                synced,
            )
            reward, kl = self._score(models, rollout)
            answers = decode_responses(self.tokenizer, rollout)
            gold = [float(self.checkable and grade(r, a).passed) for r, a in zip(rows, answers)]
            keep = torch.tensor(valid, dtype=torch.float64)
            sums += torch.stack(
                [
                    keep.sum(),
                    (reward * keep).sum(),
                    (kl * keep).sum(),
                    (rollout.response_mask.sum(1) * keep).sum(),
                    (torch.tensor(gold, dtype=torch.float64) * keep).sum(),
                ]
            )
            self.samples = [
                [r["prompt"], a, float(s), bool(g)]
                for r, a, s, g in zip(rows[:4], answers[:4], reward[:4], gold[:4])
            ]
        rows, reward, kl, length, gold = all_reduce_sum(*sums.tolist())
        metrics = {
            "eval/reward": reward / rows,
            "eval/kl": kl / rows,
            "eval/response_length": length / rows,
        }
        if self.checkable:
            metrics["eval/gold_accuracy"] = gold / rows
        self._watch(metrics)
        return metrics

    def _score(self, models: Models, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        device = model_device(models.actor)
        sequences, mask = rollout.sequences.to(device), rollout.attention_mask.to(device)
        start = rollout.prompt_width - 1
        logprobs, _ = response_logprobs(models.actor, sequences, mask, start)
        ref_logprobs, _ = response_logprobs(models.reference, sequences, mask, start)
        response_mask = rollout.response_mask.to(device)
        kl = algos.masked_sum(logprobs.float() - ref_logprobs.float(), response_mask, dim=1)
        scores = reward_scores(
            models.reward, sequences, mask, rollout.prompt_width, response_mask, self.score_position
        )
        if self.reward_stats is not None:
            scores = (scores - self.reward_stats[0]) / max(self.reward_stats[1], 1e-6)
        return scores.double().cpu(), kl.double().cpu()

    def _watch(self, metrics: dict[str, float]) -> None:
        if self.first is None:
            self.first = metrics
            return
        rising = metrics["eval/reward"] > self.first["eval/reward"]
        gold_falls = (
            "eval/gold_accuracy" in metrics
            and metrics["eval/gold_accuracy"] < self.first["eval/gold_accuracy"] - 0.05
        )
        length_ratio = metrics["eval/response_length"] / max(
            self.first["eval/response_length"], 1e-6
        )
        if rising and (gold_falls or not 0.5 <= length_ratio <= 2.0):
            self.warnings += 1
            log.warning(
                "possible reward hacking: eval/reward %.3f -> %.3f while %s",
                self.first["eval/reward"],
                metrics["eval/reward"],
                "gold accuracy fell"
                if gold_falls
                else f"answer length changed x{length_ratio:.2f}",
            )

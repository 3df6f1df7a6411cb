"""SFT's held-out evaluation: eval/loss and eval/ppl per answer token, and, where the prompts
have a checker, the gold accuracy of greedy answers (rlhf.evaluators.gold_grading)."""

from __future__ import annotations

import math

import torch

from rlhf.algos.logits import causal_lm_nll_sum
from rlhf.config import Config
from rlhf.data.collate import IGNORE_INDEX, count_targets, rows_at, sft_batch
from rlhf.data.sampling import EVAL_BATCH_ROWS, eval_shards
from rlhf.evaluators.gold_grading import (
    answer_decoder,
    checkable_rows,
    gold_metrics,
    gold_sums,
    grade,
    row_environment,
)
from rlhf.rl.episodes import EpisodeTally
from rlhf.rl.generation import Sampling, decode_responses
from rlhf.runtime.dist import all_reduce_sum, rank, world_size
from rlhf.runtime.engine import model_device


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

"""The reward step's held-out evaluation: every held-out pair scored by the reward model
(rlhf.evaluators.pair_metrics turns the scores into the ``eval/`` table), and the correlation of
its scores with the checker's verdicts on answers the SFT model samples (reward.gold_policy)."""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM

from rlhf.algos.preference import sequence_scores
from rlhf.config import Config, ConfigError
from rlhf.data.collate import pair_batch, rows_at
from rlhf.data.prepare import SOURCE
from rlhf.data.sampling import EVAL_BATCH_ROWS, eval_shards
from rlhf.evaluators.gold_grading import checkable_rows, grade
from rlhf.evaluators.pair_metrics import ScoredPair, pair_metrics
from rlhf.modeling.loading import load_tokenizer, tokenizer_fingerprint
from rlhf.rl.generation import Sampling, decode_responses, generate
from rlhf.runtime.dist import gather_lists, rank, world_size
from rlhf.runtime.engine import model_device


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

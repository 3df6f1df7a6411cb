"""What is done with PPO experiences once scored, batch by batch and across ranks: stacking them,
whitening the advantages, DAPO's dynamic sampling, the KL after an on-policy update, and the
rollout's metrics."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlhf.algos.advantages import varied_groups
from rlhf.algos.kl import compute_rewards
from rlhf.algos.reductions import masked_sum, masked_whiten, whiten_moments
from rlhf.config import PPOConfig
from rlhf.registry import rollout_correction
from rlhf.rl.experience import Experience
from rlhf.runtime.dist import all_reduce_sum


def whiten_advantages(experiences: list[Experience]) -> list[Experience]:
    """Advantages to zero mean, unit variance over every real response token of all ranks: two
    passes in float64 (mean, then the squared deviations from it), the variance unbiased and
    1e-8 inside the square root, as masked_whiten takes them."""
    tokens = [e.advantages[e.response_mask].double() for e in experiences]
    total, count = all_reduce_sum(
        sum(t.sum().item() for t in tokens), sum(t.numel() for t in tokens)
    )
    mean = total / max(count, 1.0)
    (deviations,) = all_reduce_sum(sum(((t - mean) ** 2).sum().item() for t in tokens))
    moments = whiten_moments(total, count, deviations)
    return [
        e._replace(advantages=masked_whiten(e.advantages, e.response_mask, moments=moments))
        for e in experiences
    ]


def keep_varied_groups(
    experiences: list[Experience],
    group_size: int,
    draw: Callable[[int], Experience],
    max_rounds: int,
) -> tuple[list[Experience], dict[str, float]]:
    """DAPO's dynamic sampling on this rank's rollout: the groups whose answers' rewards are all
    equal (their advantages are 0) are dropped, and more generation batches are drawn
    (``draw(round)``, round = 1, 2, ...) until every rank holds as many groups with a spread as
    it generated at first, at most ``max_rounds`` times; groups of equal rewards fill what is
    then still missing. Every rank keeps its batch size and runs the same rounds (generation
    and scoring are collective under ZeRO-3). Returns the batch, one Experience, and
    ppo/groups_dropped, ppo/groups_padded (equal groups left out and kept, all ranks) and
    ppo/sampling_rounds."""
    target = sum(len(e.scores) for e in experiences) // group_size
    varied: list[Experience] = []
    equal: list[Experience] = []

    def sort(e: Experience) -> None:
        returns = masked_sum(e.rewards, e.response_mask, dim=-1)  # what the groups compare
        spread = varied_groups(returns, group_size)
        rows = spread.repeat_interleave(group_size)
        varied.append(e.rows(rows.nonzero().squeeze(1)))
        equal.append(e.rows((~rows).nonzero().squeeze(1)))

    def groups(parts: list[Experience]) -> int:
        return sum(len(e.scores) for e in parts) // group_size

    for e in experiences:
        sort(e)
    rounds = 0
    while rounds < max_rounds and all_reduce_sum(float(groups(varied) < target))[0] > 0:
        rounds += 1
        sort(draw(rounds))
    padded = max(target - groups(varied), 0)
    batch = concat([*varied, *equal])  # varied groups first: the padding comes last
    batch = batch.rows(torch.arange(target * group_size, device=batch.scores.device))
    dropped, padded = all_reduce_sum(groups(equal) - padded, padded)
    stats = {"ppo/groups_dropped": dropped, "ppo/groups_padded": padded}
    return [batch], {**stats, "ppo/sampling_rounds": rounds}


def with_update_kl(rollout: Experience, estimator: str) -> Experience:
    """The rollout whose old log-probs an on-policy update filled (ppo.update.on_policy_shortcut), with
    its per-token KL to the reference computed from them as make_experience computes it."""
    zeros = torch.zeros_like(rollout.scores, dtype=torch.float32)
    mask = rollout.response_mask
    _, kl = compute_rewards(
        zeros, rollout.old_logprobs, rollout.ref_logprobs, mask, 0.0, None, estimator
    )
    return rollout._replace(kl=kl)


def rollout_metrics(experiences: list[Experience]) -> dict[str, float]:
    """Reward, KL to the reference (the configured estimator, summed over each answer), answer
    length: means over the rows of all ranks that are not short; the count of short answers and
    the share of all answers cut at max_new_tokens (ppo/unterminated)."""
    sums = torch.zeros(9, dtype=torch.float64)
    for e in experiences:
        keep = ~e.short
        mask = e.response_mask & keep.unsqueeze(1)  # short rows kept by a penalty: not counted
        sums += torch.tensor(
            [
                float(keep.sum()),
                e.scores[keep].sum().item(),
                masked_sum(e.kl, mask).item(),
                mask.sum().item(),
                float(e.short.sum()),
                masked_sum(e.advantages, e.response_mask).item(),
                e.response_mask.sum().item(),
                float(e.unterminated.sum()) if e.unterminated is not None else 0.0,
                float(len(e.short)),
            ],
            dtype=torch.float64,
        )
    rows, reward, kl, length, short, advantages, tokens, cut, answers = all_reduce_sum(
        *sums.tolist()
    )
    rows = max(rows, 1.0)
    return {
        "ppo/reward": reward / rows,
        "ppo/kl": kl / rows,
        "ppo/response_length": length / rows,
        "ppo/short_answers": short,
        "ppo/unterminated": cut / max(answers, 1.0),
        "ppo/advantage_mean": advantages / max(tokens, 1.0),
    }


def teacher_metrics(experiences: list[Experience]) -> dict[str, float]:
    """ppo/teacher_kl: algo=opd's student-teacher gap (opd.loss's) summed over each answer,
    the mean over the rows of all ranks that are not short (as ppo/kl)."""
    rows = gap = 0.0
    for e in experiences:
        keep = ~e.short
        rows += float(keep.sum())
        gap += masked_sum(e.teacher_gap, e.response_mask & keep.unsqueeze(1)).item()
    rows, gap = all_reduce_sum(rows, gap)
    return {"ppo/teacher_kl": gap / max(rows, 1.0)}


def correction_metrics(experiences: list[Experience], ppo: PPOConfig) -> dict[str, float]:
    """ppo/tis_weight_mean, ppo/tis_clipfrac, ppo/tis_masked_frac, ppo/tis_ratio_mean: the
    sampler / trainer correction (ppo.rollout.correction) over every rank's answer tokens."""
    correct = rollout_correction(ppo)
    names = ("tis_weight_mean", "tis_clipfrac", "tis_masked_frac", "tis_ratio_mean")
    sums = [0.0] * (len(names) + 1)
    for e in experiences:
        if e.sampler_logprobs is None:
            continue
        _, _, stats = correct(e.old_logprobs, e.sampler_logprobs, e.response_mask)
        tokens = float(e.response_mask.sum())
        for i, name in enumerate(names):
            sums[i] += stats[name].item() * tokens
        sums[-1] += tokens
    *totals, tokens = all_reduce_sum(*sums)
    return {f"ppo/{name}": total / max(tokens, 1.0) for name, total in zip(names, totals)}


def concat(experiences: list[Experience]) -> Experience:
    """Stack generation batches (their widths may differ: pad on the right with masked zeros)."""
    if len(experiences) == 1:
        return experiences[0]
    prompt_width = max(e.prompt_width for e in experiences)
    response_width = max(e.response_mask.shape[1] for e in experiences)
    stacked = {}
    for name in Experience._fields:
        if name == "prompt_width":
            stacked[name] = prompt_width
        elif name in OPTIONAL and all(getattr(e, name) is None for e in experiences):
            stacked[name] = None
        else:
            stacked[name] = torch.cat(
                [_pad(e, name, prompt_width, response_width) for e in experiences]
            )
    return Experience(**stacked)


OPTIONAL = ("sampler_logprobs", "teacher_gap")  # None in every batch: None stacked


def _pad(e: Experience, field: str, prompt_width: int, response_width: int) -> torch.Tensor:
    value = getattr(e, field)
    if field == "unterminated" and value is None:
        return torch.zeros_like(e.short)
    if field == "sampler_logprobs" and value is None:  # the trainer's own: no mismatch
        value = e.old_logprobs
    if field in ("scores", "short", "unterminated"):
        return value
    if field in ("sequences", "attention_mask"):  # left-pad prompts, right-pad responses
        left = prompt_width - e.prompt_width
        right = response_width - e.response_mask.shape[1]
        return torch.nn.functional.pad(value, (left, right), value=0)  # masked either way
    return torch.nn.functional.pad(value, (0, response_width - value.shape[1]), value=0)

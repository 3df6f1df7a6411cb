"""One rank of the ZeRO-3 micro-batch check (run by tests/test_ppo_micro_batches.py with torchrun
--nproc_per_node 2 and the repository on PYTHONPATH): every parameter of the actor and the
critic partitioned, each rank with its own rollout (rank 1's answers longer), one PPO update of
two optimizer steps from the same weights in four layouts: fixed rows, micro batches by tokens,
rows dealt over the ranks by tokens, and both with the rows packed. For every estimator the
gathered weights and the stats of the layouts must agree with the fixed rows'. Each rank prints
one "rank R ok ..." line or fails."""

from __future__ import annotations

import argparse
import copy

import deepspeed
import torch
from rank_report import report  # tests/, the script's own directory
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf import registry
from rlhf.config import register_configs, to_config
from rlhf.modeling.loading import ValueModel
from rlhf.rl.experience import Experience, response_logprobs
from rlhf.rl.micro_batches import UpdateRows
from rlhf.runtime.dist import init_distributed, rank, teardown
from rlhf.steps.loop import NonFiniteGuard, TrainState
from rlhf.steps.ppo_update import ppo_update
from tests.conftest import compose

ROWS, PROMPT, ANSWER = 8, 6, 12
LAYOUTS = {
    "fixed": [],
    "tokens": ["ppo.update.micro_batch_tokens=24"],
    "balanced": ["ppo.update.balance_ranks=true"],
    "tokens+balanced": [  # and packed: bins of the rollout's width grouped by the budget
        "ppo.update.micro_batch_tokens=24",
        "ppo.update.balance_ranks=true",
        "ppo.update.packing=true",
    ],
}


def rollout(actor: torch.nn.Module, vocab: int) -> Experience:
    """ROWS rows of left-padded prompts and answers of this rank's lengths (rank 1's longer),
    scored as if by an earlier actor (old log-probs off the actor's by a little)."""
    g = torch.Generator().manual_seed(100 + rank())
    prompts = torch.randint(2, PROMPT + 1, (ROWS,), generator=g)
    answers = torch.randint(1, ANSWER // 2 + 1, (ROWS,), generator=g) + rank() * ANSWER // 2
    sequences = torch.randint(4, vocab, (ROWS, PROMPT + ANSWER), generator=g)
    columns = torch.arange(PROMPT + ANSWER)
    attention = (columns >= PROMPT - prompts[:, None]) & (columns < PROMPT + answers[:, None])
    sequences[~attention] = 1
    response_mask = attention[:, PROMPT:]
    with torch.no_grad():
        logprobs, _ = response_logprobs(actor, sequences, attention.long(), PROMPT - 1)

    def noise(scale: float) -> torch.Tensor:
        return torch.randn(ROWS, ANSWER, generator=g) * scale * response_mask

    zeros = torch.zeros(ROWS, ANSWER)
    no = torch.zeros(ROWS, dtype=torch.bool)
    return Experience(
        sequences=sequences,
        attention_mask=attention.long(),
        prompt_width=PROMPT,
        response_mask=response_mask,
        old_logprobs=(logprobs + noise(0.1)) * response_mask,
        ref_logprobs=(logprobs + noise(0.2)) * response_mask,
        old_values=noise(0.5),
        scores=torch.randn(ROWS, generator=g),
        rewards=zeros,
        kl=zeros,
        advantages=noise(1.0),
        returns=noise(1.0),
        short=no,
        unterminated=no,
    )


def engine(module: torch.nn.Module, grad_accum: int):
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    trained, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds)
    return trained


def gathered(trained) -> list[torch.Tensor]:
    params = list(trained.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def update(estimator: str, layout: list[str], base, base_critic, exp: Experience):
    overrides = [
        "step=sft",
        f"ppo.advantage.estimator={estimator}",
        "ppo.update.per_device_batch_size=2",
        "ppo.update.grad_accum=2",  # 8 rows: two optimizer steps of 2 x 2
        "ppo.update.on_policy_shortcut=false",
        *layout,
    ]
    cfg = to_config(compose(overrides))
    actor = engine(copy.deepcopy(base), cfg.ppo.update.grad_accum)
    needs_critic = registry.ESTIMATORS[estimator].needs_critic
    critic = engine(copy.deepcopy(base_critic), cfg.ppo.update.grad_accum) if needs_critic else None
    models = type("Models", (), {"actor": actor, "critic": critic, "reference": base})
    stats = ppo_update(models, exp, cfg, TrainState(), None, NonFiniteGuard(3), 0.1)
    weights = gathered(actor) + (gathered(critic) if critic is not None else [])
    return weights, stats


def first_step_plan(layout: list[str], exp: Experience) -> str:
    """What the layout makes of the first optimizer step on this rank: its micro batches' row
    counts, and with the deal how many rows came from the other rank."""
    cfg = to_config(compose(["step=sft", "ppo.update.per_device_batch_size=2", *layout]))
    update = cfg.ppo.update
    update.grad_accum = 2
    source = UpdateRows(exp, update)
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0))
    micro = source.micro_batches(order[:4])
    foreign = (
        sum(int(((m + source.offset) // ROWS != rank()).sum()) for m in micro)
        if source.source is not exp
        else 0
    )
    return f"{[len(m) for m in micro]} foreign {foreign}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    args = parser.parse_args()
    init_distributed("cpu")
    register_configs()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(args.model_dir)
    base_critic = ValueModel(
        AutoModelForSequenceClassification.from_pretrained(args.model_dir, num_labels=1)
    )
    exp = rollout(base.eval(), base.config.vocab_size)
    estimators = sorted(n for n, e in registry.ESTIMATORS.items() if not e.teacher)
    worst = 0.0
    for estimator in estimators:
        fixed, fixed_stats = update(estimator, LAYOUTS["fixed"], base, base_critic, exp)
        moved = max((w - p).abs().max().item() for w, p in zip(fixed, base.parameters()))
        assert moved > 1e-4, (estimator, moved)  # the update did something to compare
        for name, layout in LAYOUTS.items():
            if name == "fixed":
                continue
            weights, stats = update(estimator, layout, base, base_critic, exp)
            gap = max((w - f).abs().max().item() for w, f in zip(weights, fixed, strict=True))
            assert gap < 1e-5, (estimator, name, gap)
            worst = max(worst, gap)
            for key, value in fixed_stats.items():
                # a clip fraction counts "clipped term > unclipped term", equal in exact
                # arithmetic inside the clip range: rounding flips a token or two of ~100
                tolerance = 0.02 if key.endswith("clipfrac") else 1e-5 * max(1.0, abs(value))
                assert abs(stats[key] - value) <= tolerance, (
                    estimator,
                    name,
                    key,
                    stats[key],
                    value,
                )
    plans = "; ".join(f"{name} {first_step_plan(layout, exp)}" for name, layout in LAYOUTS.items())
    report(
        f"rank {rank()} ok: estimators {','.join(estimators)}; largest weight gap {worst:.1e}; "
        f"first step: {plans}"
    )
    teardown()


if __name__ == "__main__":
    main()

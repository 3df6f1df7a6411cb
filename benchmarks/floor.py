"""``python -m benchmarks floor``: is the PPO iteration at its floor? Each repeat times the
parts of an iteration alone on the batch the next iteration draws (the engine's raw generate of
its prompts with its seed, so the very answers; each model's forward over them as the scoring
pass makes it), then that iteration, then the update (forward, backward, optimizer steps) on
the same batch and the weight push; the ratio is iteration / sum of parts, its median over the
repeats, for each rollout engine. 1.0 is the floor: the iteration spends nothing beyond its
parts. Writes floor.json in --out.

    python -m benchmarks floor --scenario dschat                 # bf16, 2 ranks, ZeRO-2
    python -m benchmarks floor --rollout-engine hf --repeats 5   # one engine, more repeats
    python -m benchmarks floor --set ppo.update.on_policy_shortcut=false  # any rlhf override on top

The shapes and the exported models are the steps bench's (benchmarks/steps.py, its options
apply). Each engine is one real ``python -m rlhf step=ppo`` run (torchrun for several ranks)
whose PPO recipe is replaced by :func:`floor_recipe`: the real setup, --warmup iterations, then
the repeats; every rank times the same things between barriers."""

from __future__ import annotations

import argparse
import importlib.util
import json
import runpy
import statistics
import sys
import time
from pathlib import Path

from benchmarks import steps
from benchmarks.runs import run_logged
from benchmarks.workload import data_overrides, run_overrides

ENGINES = ("hf", "vllm")
PARTS = ("generate", "actor_forward", "reference_forward", "critic_forward", "reward_forward")
PARTS += ("update", "sync")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m benchmarks floor", description=__doc__)
    p.add_argument("--rollout-engine", default="hf,vllm", help="engines, comma separated")
    p.add_argument("--warmup", type=int, default=2, help="iterations before the timed ones")
    p.add_argument("--repeats", type=int, default=3, help="timed iterations, each with its parts")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an rlhf override on top of the bench's (repeatable): ppo.advantage.estimator=grpo",
    )
    own, rest = p.parse_known_args(argv)
    own.engines = [e for e in own.rollout_engine.split(",") if e]
    if unknown := set(own.engines) - set(ENGINES):
        p.error(f"--rollout-engine: unknown {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    if "vllm" in own.engines and importlib.util.find_spec("vllm") is None:
        p.error(
            "--rollout-engine vllm: vLLM is not installed (scripts/install_vllm.sh), or pass hf"
        )
    if own.warmup < 1 or own.repeats < 1:
        p.error("--warmup and --repeats: at least 1")
    bench = steps.parse_args([*rest, "--sections", "ppo", "--no-trl"])
    return own, bench


def main(argv: list[str]) -> dict:
    own, args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = steps.prepared_data(args)
    actor, critic = steps.build_models(args, data)
    results = {}
    for engine in own.engines:
        args.rollout_engine = engine
        run_dir = args.out / "runs" / f"floor-{engine}"
        run_dir.mkdir(parents=True, exist_ok=True)
        bench = steps.merged(
            [*data_overrides(args, data), *run_overrides(args, own.warmup + own.repeats)],
            [
                *steps.section_modes("ppo", args, actor, critic)["fast"],
                "ppo.rollout.batches=1",
                "ppo.rollout.seeded=true",  # a part's generate draws the iteration's answers
            ],
        )
        overrides = steps.merged(bench, own.set)
        spec = {"warmup": own.warmup, "repeats": own.repeats, "out": str(run_dir / "floor.json")}
        (run_dir / "spec.json").write_text(json.dumps(spec))
        print(f"floor, rollouts on {engine} ...", flush=True)
        module = ["benchmarks", "floor", "_worker", str(run_dir / "spec.json")]
        run_logged([*module, *overrides, f"hydra.run.dir={run_dir}"], run_dir, args)
        results[engine] = json.loads((run_dir / "floor.json").read_text())
    report = {
        "command": " ".join(["python -m benchmarks floor", *argv]),
        "scenario": args.scenario,
        "overrides": own.set,
        "engines": results,
    }
    (args.out / "floor.json").write_text(json.dumps(report, indent=2))
    print(format_report(results))
    print(f"\nwrote {args.out / 'floor.json'}")
    return report


def format_report(results: dict) -> str:
    lines = [f"{'engine':<6} {'iteration':>10} {'sum of parts':>13} {'ratio':>6}  parts (s)"]
    for engine, r in results.items():
        parts = ", ".join(f"{k} {r[f'{k}_s']:.3f}" for k in PARTS if r.get(f"{k}_s"))
        lines.append(
            f"{engine:<6} {r['iteration_s']:>9.3f}s {r['parts_s']:>12.3f}s {r['ratio']:>6.3f}  "
            + parts
        )
    return "\n".join(lines)


# --- inside the run (every rank) ---------------------------------------------------------------


def worker(spec_path: str, overrides: list[str]) -> None:
    """``python -m rlhf OVERRIDES`` with the PPO recipe replaced by :func:`floor_recipe`."""
    from rlhf.steps import all as pipeline

    spec = json.loads(Path(spec_path).read_text())
    pipeline.RECIPES["ppo"] = lambda cfg, info: floor_recipe(cfg, info, spec)
    sys.argv = ["rlhf", *overrides]
    runpy.run_module("rlhf", run_name="__main__", alter_sys=True)  # as `python -m rlhf`


def floor_recipe(cfg, info, spec: dict) -> dict:
    from rlhf.rl.rollouts import close_engine
    from rlhf.runtime.dist import barrier, is_main
    from rlhf.steps import ppo

    setup = ppo.PPOTrainer(cfg, info)
    for _ in range(spec["warmup"]):
        ppo.iteration(setup)
    repeats = [one_repeat(setup, barrier) for _ in range(spec["repeats"])]
    close_engine(setup.rollouts)
    iterations = [r.pop("iteration") for r in repeats]
    parts = {name: statistics.median(r[name] for r in repeats) for name in repeats[0]}
    ratios = [i / sum(r.values()) for i, r in zip(iterations, repeats, strict=True)]
    result = {
        "iteration_s": statistics.median(iterations),
        "iterations_s": iterations,
        **{f"{name}_s": seconds for name, seconds in parts.items()},
        "parts_s": sum(parts.values()),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "on_policy_shortcut": setup.cfg.ppo.update.on_policy_shortcut,
        "rollout_logprobs": setup.collect.rollout_logprobs,
    }
    if is_main():
        Path(spec["out"]).write_text(json.dumps(result, indent=2))
    return {"bench/floor_ratio": result["ratio"]}


def timed(fn, barrier) -> tuple[float, object]:
    """Seconds of ``fn()`` on this rank, the ranks lined up before and after it (the slowest
    rank's time is what the next collective waits for, so every rank times the same span), and
    what it returned."""
    barrier()
    started = time.perf_counter()
    out = fn()
    barrier()
    return time.perf_counter() - started, out


def one_repeat(setup, barrier) -> dict[str, float]:
    """One iteration and each of its parts alone, on its own batch: the next iteration's prompts
    and seed (ppo.rollout.seeded), so with the same weights the raw generate draws the very
    answers the iteration then draws; the forwards the scoring pass makes over them (the actor's
    only where the old log-probs are neither the sampler's nor the update's); then the
    iteration; then the update once more on the batch as scored before it, and the push."""
    import torch

    from rlhf.rl.experience import (
        eval_modules,
        kl_needs_logits,
        normalised_scores,
        reference_args,
        response_logprobs,
        response_values,
        scoring_args,
    )
    from rlhf.rl.rollouts import release_engine, sync_weights
    from rlhf.rl.shaping import iteration_shaping
    from rlhf.runtime.dist import rank
    from rlhf.runtime.engine import model_device
    from rlhf.steps import ppo
    from rlhf.steps.ppo_update import ppo_update

    cfg, models, collect, state = setup.cfg, setup.models, setup.collect, setup.run.state
    shaping = iteration_shaping(cfg, setup.kl.value, setup.score_position, setup.reward_stats)
    [rows] = setup.plan.micro_batches(state.epoch, state.step_in_epoch, rank())
    prompts = [setup.prompts[i]["prompt_ids"] for i in rows]
    seed = ppo.rollout_seed(cfg, state.global_step, rank())  # the iteration's only batch
    record = collect.rollout_logprobs or collect.keep_sampler_logprobs
    temperature = shaping.temperature if record else None
    out = {}
    out["generate"], rollout = timed(
        lambda: setup.rollouts.generate(
            prompts, collect.sampling, seed, shaping.group_size, temperature
        ),
        barrier,
    )
    device = model_device(models.actor)
    sequences = rollout.sequences.to(device)
    mask = rollout.attention_mask.to(device)
    start = rollout.prompt_width - 1
    args = scoring_args(shaping, sequences, mask)  # as the scoring pass reads the rollout
    forwards = {}
    if not (collect.rollout_logprobs or collect.old_from_update) or kl_needs_logits(
        shaping.kl_estimator
    ):
        forwards["actor_forward"] = lambda: response_logprobs(
            models.actor, sequences, mask, start, **args
        )
    forwards["reference_forward"] = lambda: response_logprobs(
        models.reference, sequences, mask, start, **reference_args(args)
    )
    if models.critic is not None:
        forwards["critic_forward"] = lambda: response_values(
            models.critic, sequences, mask, start, args["packing"]
        )
    forwards["reward_forward"] = lambda: normalised_scores(
        models.reward, sequences, mask, rollout, shaping, args["packing"]
    )
    with torch.no_grad(), eval_modules(*(m for m in (models.actor, models.critic) if m)):
        out.update({name: timed(fn, barrier)[0] for name, fn in forwards.items()})
    experience = collect(prompts, shaping, seed=seed)  # as the iteration will score it
    out["iteration"], _ = timed(lambda: ppo.iteration(setup), barrier)
    fresh = experience._replace(old_logprobs=experience.old_logprobs.clone())
    out["update"], _ = timed(
        lambda: ppo_update(models, fresh, cfg, state, setup.ptx, setup.run.guard, setup.kl.value),
        barrier,
    )
    out["sync"], _ = timed(
        lambda: (release_engine(setup.rollouts), sync_weights(setup.rollouts)), barrier
    )
    return out

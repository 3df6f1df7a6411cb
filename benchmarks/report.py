"""The bench's report: medians per section and mode, the paired ratios, the targets, the table
it prints, and the machine it ran on."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.runs import CORES
from benchmarks.trl_runs import trl_version

# (name, what is compared, the fast run must be at least this much better; issue 19's targets)
TARGETS = (
    ("sft", "samples/s vs baseline", 2.0),
    ("sft", "samples/s vs TRL", 1.3),
    ("reward", "samples/s vs baseline", 2.0),
    ("reward", "samples/s vs TRL", 1.3),
    ("ppo", "s/iter vs baseline", 1.5),
)


COLUMNS = (  # (metric, header, format)
    ("samples_per_s", "samples/s", "{:.1f}"),
    ("tokens_per_s", "train tok/s", "{:.0f}"),
    ("s_per_iter", "s/iter", "{:.2f}"),
    ("gen_tokens_per_s", "gen tok/s", "{:.0f}"),
    ("response_length", "answer len", "{:.0f}"),  # PPO: means over the run's iterations
    ("kl", "KL", "{:.2f}"),
    ("peak_mem_gb", "peak GB", "{:.2f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("wall_s", "wall s", "{:.0f}"),
    ("eval_share", "eval", "{:.0%}"),
)


def medians(runs: list[dict]) -> dict[str, float]:
    keys = {k for run in runs for k, v in run.items() if isinstance(v, int | float)}
    return {k: statistics.median(r[k] for r in runs if r.get(k) is not None) for k in keys}


def paired(pairs: list[tuple[dict, dict]], key: str, faster_is: str = "higher") -> float:
    """The median over repeats of fast / other (other / fast when lower is better). Each
    repeat's runs are minutes apart, so their ratio holds when the machine's load shifts
    between repeats, where a ratio of medians would pair runs from different loads."""
    ratios = [f[key] / o[key] if faster_is == "higher" else o[key] / f[key] for f, o in pairs]
    return statistics.median(ratios)


def summarize(results: dict, flops: dict, peak: float) -> dict:
    """Medians per section and mode, the paired ratios and the targets. Each run's MFU divides
    its model FLOP/s by the matmul peak measured just before it (else by ``peak``)."""
    for section, modes in results.items():
        for run in (r for runs in modes.values() for r in runs):
            if flops.get(section) and run.get("tokens_per_s"):
                run["model_flops_per_s"] = run["tokens_per_s"] * flops[section]
                run["mfu"] = run["model_flops_per_s"] / (run.get("peak_flops") or peak)
    table = {s: {m: medians(runs) for m, runs in modes.items()} for s, modes in results.items()}
    ratios = {}
    for section, modes in results.items():
        for other in ("baseline", "trl"):
            if other not in modes:
                continue
            name = "TRL" if other == "trl" else other
            pairs = list(zip(modes["fast"], modes[other]))  # the runs of one repeat: adjacent
            if section == "ppo":
                ratios[f"ppo: s/iter vs {name}"] = paired(pairs, "s_per_iter", faster_is="lower")
            else:
                ratios[f"{section}: samples/s vs {name}"] = paired(pairs, "samples_per_s")
            if other == "baseline":
                ratios[f"{section}: peak memory vs baseline"] = paired(pairs, "peak_mem_gb")
    targets = [
        {"target": f"{key} >= {goal}x", "value": ratios[key], "ok": ratios[key] >= goal}
        for key, goal in ((f"{s}: {what}", goal) for s, what, goal in TARGETS)
        if key in ratios
    ]
    for key, value in ratios.items():
        if key.endswith("peak memory vs baseline"):  # 2%: the noise of a process's peak RSS
            targets.append({"target": f"{key} <= 1.02", "value": value, "ok": value <= 1.02})
    if "mfu" in table.get("mfu", {}).get("fast", {}):
        mfu = table["mfu"]["fast"]["mfu"]
        targets.append({"target": "mfu: SFT MFU >= 50%", "value": mfu, "ok": mfu >= 0.5})
    return {"table": table, "ratios": ratios, "targets": targets}


def format_report(report: dict) -> str:
    header = ["section", "mode", *(h for _, h, _ in COLUMNS)]
    lines = [header]
    for section, modes in report["table"].items():
        for mode, row in modes.items():
            cells = [fmt.format(row[k]) if row.get(k) is not None else "" for k, _, fmt in COLUMNS]
            lines.append([section, mode, *cells])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    text += [
        "(train tok/s: real, non-padding tokens of the training steps, PPO's update included;",
        " gen tok/s: answer tokens of PPO's generation; MFU: model FLOP/s / matmul peak;",
        " wall s: the whole run, start-up included; eval: its share spent evaluating)",
        "",
    ]
    text += [f"{k}: {v:.2f}x" for k, v in report["ratios"].items()]
    text.append("")
    for t in report["targets"]:
        value = f"{t['value']:.1%}" if t["target"].startswith("mfu") else f"{t['value']:.2f}"
        text.append(f"[{'ok' if t['ok'] else 'MISS'}] {t['target']}: {value}")
    return "\n".join(text)


def machine() -> dict:
    import platform

    import torch

    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    versions = {"torch": torch.__version__, "trl": trl_version()}
    for name in ("transformers", "deepspeed"):
        versions[name] = __import__(name).__version__
    return {"cpu": model, "cores": CORES, "python": platform.python_version(), **versions}

"""Compare runs without W&B: the sweep table for any run or sweep dirs, and PNG plots over steps.

    python -m rlhf.cli.compare outputs/multirun/2026-01-01_12-00-00            # a sweep: its jobs
    python -m rlhf.cli.compare RUN_A RUN_B --metrics eval/loss,train/loss --out cmp
    python -m rlhf.cli.compare RUN --columns 'eval/*,perf/*'                  # step=all: its steps

A sweep dir expands to its job dirs and a step=all run dir to its sft/reward/ppo sub-runs.
Writes ``summary.md``, ``summary.csv`` and one ``<metric>.png`` per metric into the folder
``--out`` (default ./compare; those files are replaced, others left alone) and prints the table.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from rlhf.tools import sweep_summary
from rlhf.tools.sweep_summary import RunRecord

# plotted when --metrics is not given, those that any run logged
DEFAULT_METRICS = (
    "train/loss",
    "eval/loss",
    "eval/accuracy",
    "ppo/reward",
    "eval/reward",
    "eval/gold_accuracy",
)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        paths = sweep_summary.expand([Path(d) for d in args.dirs])
        out = out_dir(args.out)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    records = sweep_summary.load_records(paths)
    columns = _split(args.columns) or None
    markdown = sweep_summary.to_markdown(records, columns)
    (out / "summary.md").write_text(markdown)
    sweep_summary.write_csv(records, out / "summary.csv")
    print(markdown)
    metrics = _split(args.metrics) or _logged(records, DEFAULT_METRICS)
    for metric in metrics:
        path = plot_metric(records, metric, out)
        print(f"{metric}: {path}" if path else f"{metric}: no run logged it", file=sys.stderr)
    return 0


def out_dir(value: str) -> Path:
    """--out, made if missing. It is a folder: the files compare writes there (summary.md,
    summary.csv, <metric>.png) are replaced, others are left as they are; a file of that name
    is not overwritten."""
    out = Path(value)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"--out={value}: that is a file; --out is a folder for summary.md, summary.csv and "
            "the plots (made if missing): give another --out"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PermissionError(
            f"--out={value}: cannot make the folder ({err.strerror}: {err.filename}); give "
            "another --out"
        ) from None
    return out


def plot_metric(records: list[RunRecord], metric: str, out_dir: Path) -> Path | None:
    """One line per run that logged ``metric``: its value at each logged step."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    legends, _ = sweep_summary.differing_overrides(records)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    plotted = 0
    for record, own in zip(records, legends):
        steps, values = _series(record, metric)
        if not steps:
            continue
        label = record.label + (f"  {_shorten(' '.join(own), 90)}" if own else "")
        ax.plot(steps, values, marker="o" if len(steps) <= 20 else None, markersize=3, label=label)
        plotted += 1
    if not plotted:
        plt.close(fig)
        return None
    ax.set(xlabel="step", ylabel=metric, title=metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(0.0, -0.14))  # below the axes
    path = out_dir / f"{metric.replace('/', '_')}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _series(record: RunRecord, metric: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for row in record.history():
        value = row.get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value) and "step" in row:
            steps.append(row["step"])
            values.append(float(value))
    return steps, values


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _logged(records: list[RunRecord], candidates: tuple[str, ...]) -> list[str]:
    seen = {key for r in records for row in r.history() for key in row}
    return [m for m in candidates if m in seen]


def _split(values: list[str] | None) -> list[str]:
    """``--metrics a,b --metrics c`` -> [a, b, c]."""
    return [m.strip() for v in values or [] for m in v.split(",") if m.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rlhf.cli.compare",
        description="A table of final metrics and PNG plots over steps for run or sweep dirs.",
    )
    p.add_argument("dirs", nargs="+", help="run dirs, step=all run dirs or sweep dirs")
    p.add_argument(
        "--metrics",
        action="append",
        help="comma-separated metric keys to plot over steps (default: the usual losses, "
        "accuracies and rewards that the runs logged)",
    )
    p.add_argument(
        "--columns",
        action="append",
        help="comma-separated summary keys or patterns for the table, e.g. 'eval/*,perf/*' "
        "(default: the headline metrics)",
    )
    p.add_argument(
        "--out",
        default="compare",
        help="output folder, made if missing; its summary.md, summary.csv and plots are "
        "replaced (default: ./compare)",
    )
    return p


if __name__ == "__main__":
    sys.exit(main())

"""One table for a set of runs: a row per run with its overrides, status, final metrics,
throughput, peak memory and wall time. The sweep launcher writes it as ``summary.md`` and
``summary.csv`` at the end of every multirun; ``python -m rlhf.cli.compare`` builds it for any dirs.

What a row reads from a run directory:
  job.json            written by the rlhf launcher: index, overrides, status, exit code, wall time
  summary.json        the run's final metrics (flat; step=all prefixes them with sft/, reward/, ppo/,
                      dpo/, and the table adds last/: its pipeline's last step's, ppo/ or dpo/)
  .hydra/overrides.yaml   the command-line overrides, when there is no job.json
  resolved.yaml       its sweep.objective and sweep.direction: the table marks the best run
                      (one objective) or the Pareto set (several) among runs that share them
  job.log             the job's output: its last ``error:`` line explains a failed job
Standard library only (Hydra imports this module while scanning plugins).
"""

from __future__ import annotations

import csv
import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.tools.sweep_best import (
    best_marks,
    fmt,
    is_number,
    objective_line,
    read_objective,
    shared_objective,
)

JOB_FILE = "job.json"
_NO_INDEX = 1 << 30
LOG_FILE = "job.log"
STEP_DIRS = ("sft", "reward", "ppo", "dpo")  # in pipeline order
LAST = "last/"  # step=all: the metrics of the pipeline's last step, PPO's or DPO's alike

# The metrics a markdown table shows by default, in this order; step=all's prefixed keys
# (sft/eval/ppl) match on their suffix. The CSV has every key.
HEADLINE = (
    "eval/loss",
    "eval/ppl",
    "eval/accuracy",
    "eval/reward",
    "eval/kl",
    "eval/gold_accuracy",
    "train/loss",
    "perf/tokens_per_s",
    "perf/gen_tokens_per_s",
    "perf/peak_mem_gb",
)


@dataclass
class RunRecord:
    """What one run directory holds, as far as the table is concerned."""

    path: Path
    label: str
    status: str  # COMPLETED | FAILED | RUNNING | INCOMPLETE
    overrides: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    wall_s: float | None = None  # the whole job (process start to exit) when known
    note: str = ""  # why a job failed
    objective: dict[str, str] = field(default_factory=dict)  # metric -> maximize | minimize

    def history(self) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl (empty when there is none)."""
        path = self.path / "metrics.jsonl"
        if not path.is_file():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
        return rows


# --- finding runs ------------------------------------------------------------------------------


def is_run_dir(path: Path) -> bool:
    return any((path / name).exists() for name in (JOB_FILE, "summary.json", "metrics.jsonl"))


def is_sweep_dir(path: Path) -> bool:
    """Hydra writes multirun.yaml in a sweep dir; a run dir has .hydra/ (rank 0's config)."""
    if (path / "multirun.yaml").is_file():
        return True
    if is_run_dir(path) or (path / ".hydra").is_dir():
        return False
    return any(is_run_dir(p) for p in _subdirs(path))


def job_dirs(sweep_dir: Path) -> list[Path]:
    """A sweep's job directories, in launch order when the launcher recorded it."""
    jobs = [p for p in _subdirs(sweep_dir) if is_run_dir(p) or (p / ".hydra").is_dir()]
    return sorted(jobs, key=lambda p: (_job_index(p), p.name))


def step_dirs(run_dir: Path) -> list[Path]:
    """step=all's sub-runs, in pipeline order; empty for a single-step run."""
    return [run_dir / s for s in STEP_DIRS if is_run_dir(run_dir / s)]


def expand(paths: list[Path]) -> list[Path]:
    """Sweep dirs become their job dirs, step=all run dirs their sub-steps; others stay."""
    out: list[Path] = []
    for path in paths:
        if is_sweep_dir(path):
            out += expand(job_dirs(path))
        elif step_dirs(path):
            out += step_dirs(path)
        elif is_run_dir(path) or (path / ".hydra").is_dir():
            out.append(path)
        else:
            raise FileNotFoundError(f"{path}: not a run or sweep directory")
    return out


def unique_labels(paths: list[Path]) -> list[str]:
    """Short names: a sweep's job is ``<sweep>#<index>``, a step=all sub-run ``<run>/<step>``,
    where ``<sweep>`` and ``<run>`` are paths relative to the deepest folder all share."""
    anchors = [_anchor(p.resolve()) for p in paths]
    bases = list(dict.fromkeys(base for base, _ in anchors))
    if len(bases) == 1:
        names = {bases[0]: bases[0].name}
    else:
        common = Path(*_common_prefix([b.parts for b in bases]))
        names = {b: str(b.relative_to(common)) for b in bases}
    return [names[base] + suffix for base, suffix in anchors]


def _anchor(path: Path) -> tuple[Path, str]:
    """(the folder that names a run, what follows its name)."""
    if path.name in STEP_DIRS and (
        (path.parent / JOB_FILE).is_file() or (path.parent / ".hydra").is_dir()
    ):
        base, suffix = _anchor(path.parent)
        return base, f"{suffix}/{path.name}"
    index = _job_index(path)
    if index < _NO_INDEX:
        return path.parent, f"#{index}"
    return path, ""


# --- reading a run -----------------------------------------------------------------------------


def load_record(path: Path, label: str | None = None) -> RunRecord:
    path = Path(path)
    job = _read_json(path / JOB_FILE)
    metrics = with_last_step(_read_json(path / "summary.json"))
    overrides = job.get("overrides") or _read_overrides(path)
    parent_job = _read_json(path.parent / JOB_FILE) if path.name in STEP_DIRS else {}
    if job.get("status"):
        status = job["status"]
    elif metrics:
        status = "COMPLETED"
    else:  # a step=all sub-run without a summary shares its job's fate
        status = parent_job.get("status", "INCOMPLETE")
    wall = job.get("wall_s")
    if wall is None:
        walls = [v for k, v in metrics.items() if k.endswith("perf/wall_s") and is_number(v)]
        wall = sum(walls) if walls else None
    note = job.get("note", "") or (_error_line(path / LOG_FILE) if status == "FAILED" else "")
    objective = read_objective(path)
    return RunRecord(
        path, label or path.name, status, list(overrides), metrics, wall, note, objective
    )


def with_last_step(metrics: dict[str, Any]) -> dict[str, Any]:
    """A step=all summary plus its last step's metrics as last/<key>, so PPO and DPO runs of an
    algorithm sweep share columns."""
    steps = [s for s in STEP_DIRS if any(k.startswith(f"{s}/") for k in metrics)]
    if not steps:
        return metrics
    prefix = f"{steps[-1]}/"
    return {
        **metrics,
        **{LAST + k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix)},
    }


def load_records(paths: list[Path]) -> list[RunRecord]:
    return [load_record(p, lbl) for p, lbl in zip(paths, unique_labels(paths))]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _read_overrides(run_dir: Path) -> list[str]:
    """``.hydra/overrides.yaml`` is a YAML list of strings; one ``- item`` a line."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    import yaml  # omegaconf's dependency

    return [str(o) for o in yaml.safe_load(path.read_text()) or []]


def _error_line(log_path: Path) -> str:
    """The last ``error:`` line of a job's log (the config checks' message), or its last line."""
    if not log_path.is_file():
        return ""
    raw = log_path.read_text(errors="replace").splitlines()
    lines = [ln for ln in raw if ln.strip() and not ln.startswith(_HYDRA_HINTS)]
    if not lines:
        return ""
    starts = [i for i, ln in enumerate(lines) if re.match(r"(error|\w*Error|\w*Exception)\b", ln)]
    start = starts[-1] if starts else len(lines) - 1
    message = [lines[start].strip()]
    for line in lines[start + 1 :]:  # the indented lines of a multi-line message
        if not line.startswith((" ", "\t")):
            break
        message.append(line.strip())
    return _shorten(" ".join(message), 200)


_HYDRA_HINTS = ("Set the environment variable HYDRA_FULL_ERROR", "See https://hydra.cc")


# --- the table ---------------------------------------------------------------------------------


def metric_columns(records: list[RunRecord], patterns: list[str] | None = None) -> list[str]:
    """Metric keys to show. Patterns (fnmatch, e.g. ``eval/*``) pick keys in pattern order;
    without, the HEADLINE keys present in any row, bare keys first then each step's."""
    keys = sorted({k for r in records for k in r.metrics if k != "step"})
    objective = [k for k in shared_objective(records) if k in keys]  # its columns come first
    if patterns:
        chosen: list[str] = list(objective)
        for pattern in patterns:
            chosen += [k for k in keys if fnmatch.fnmatchcase(k, pattern) and k not in chosen]
        return chosen
    prefixes = ("", *(f"{s}/" for s in STEP_DIRS))
    return objective + [
        p + h for p in prefixes for h in HEADLINE if p + h in keys and p + h not in objective
    ]


def differing_overrides(records: list[RunRecord]) -> tuple[list[list[str]], list[str]]:
    """Each row's overrides that are not shared by every row, and the shared ones."""
    if not records:
        return [], []
    shared = set(records[0].overrides).intersection(*(r.overrides for r in records[1:]))
    if len(records) == 1:
        shared = set()
    rows = [[o for o in r.overrides if o not in shared] for r in records]
    return rows, [o for o in records[0].overrides if o in shared]


def table(
    records: list[RunRecord], columns: list[str] | None = None, first: str = "run"
) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, rows of formatted cells, the overrides every row shares)."""
    metrics = metric_columns(records, columns)
    own, shared = differing_overrides(records)
    best = ["best"] if shared_objective(records) else []  # "best" / "pareto" (best_marks)
    header = [first, "overrides", "status", *best, *metrics, "wall_s", "note"]
    rows = [
        [
            r.label,
            " ".join(o) or "-",
            r.status,
            *([mark] if best else []),
            *(fmt(r.metrics.get(k)) for k in metrics),
            fmt(r.wall_s),
            r.note,
        ]
        for r, o, mark in zip(records, own, best_marks(records))
    ]
    return header, rows, shared


def to_markdown(
    records: list[RunRecord], columns: list[str] | None = None, first: str = "run"
) -> str:
    header, rows, shared = table(records, columns, first)
    if not any(row[-1] for row in rows):  # no notes: drop the column
        header, rows = header[:-1], [row[:-1] for row in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    counts = _status_counts(records)
    head = f"{len(records)} run(s): {counts}"
    if objective_line(records):
        head += "\n" + objective_line(records)
    if shared:
        head += "\nshared overrides: " + " ".join(shared)
    return head + "\n\n" + "\n".join(lines) + "\n"


def write_csv(records: list[RunRecord], path: Path, first: str = "run") -> None:
    """Every metric key, unformatted, and each row's full overrides."""
    keys = sorted({k for r in records for k in r.metrics})
    keys = metric_columns(records) + [k for k in keys if k not in metric_columns(records)]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        header = [first, "path", "status", "best", "overrides", "wall_s", "note", *keys]
        writer.writerow(header)
        for r, mark in zip(records, best_marks(records)):
            row = [r.label, str(r.path), r.status, mark, " ".join(r.overrides), r.wall_s, r.note]
            writer.writerow(row + [r.metrics.get(k, "") for k in keys])


def write_summary(
    records: list[RunRecord], out_dir: Path, first: str = "run", columns: list[str] | None = None
) -> str:
    """``summary.md`` (``columns``: metric_columns' patterns) and ``summary.csv`` in
    ``out_dir``; returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = to_markdown(records, columns, first=first)
    (out_dir / "summary.md").write_text(markdown)
    write_csv(records, out_dir / "summary.csv", first=first)
    return markdown


def _status_counts(records: list[RunRecord]) -> str:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.status] = counts.get(r.status, 0) + 1
    return ", ".join(f"{n} {s.lower()}" for s, n in counts.items())


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _subdirs(path: Path) -> list[Path]:
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def job_index(path: Path) -> int | None:
    """The index a launcher recorded for the job in ``path`` (job.json), or None."""
    index = _read_json(path / JOB_FILE).get("index")
    return index if isinstance(index, int) else None


def _job_index(path: Path) -> int:
    index = job_index(path)
    return _NO_INDEX if index is None else index


def _common_prefix(parts: list[tuple[str, ...]]) -> tuple[str, ...]:
    prefix: list[str] = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        prefix.append(items[0])
    # keep at least one part of the shortest path so no label is empty
    shortest = min(len(p) for p in parts)
    return tuple(prefix[: shortest - 1])

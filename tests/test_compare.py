"""``python -m rlhf.cli.compare`` and the table it shares with the sweep summary, on run, sweep and
step=all dirs synthesised here (what a run writes: metrics.jsonl, summary.json, .hydra/)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from rlhf.cli import compare
from rlhf.tools import sweep_summary
from tests.conftest import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_dir(path: Path, overrides: list[str], losses: list[float], **final) -> Path:
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    rows = [
        {"step": 10 * i, "train/loss": v, "perf/tokens_per_s": 1000.0} for i, v in enumerate(losses)
    ]
    rows += [{"step": 10 * (len(losses) - 1), "eval/loss": losses[-1] + 0.1}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"eval/loss": losses[-1] + 0.1, "train/loss": losses[-1], "perf/wall_s": 12.5}
    (path / "summary.json").write_text(json.dumps({**summary, **final}))
    return path


def _job(sweep: Path, index: int, name: str, status: str, log: str = "") -> Path:
    job = sweep / name
    if status == "COMPLETED":
        _run_dir(job, ["step=sft", name], [3.0, 2.0])
    else:
        job.mkdir(parents=True)
    (job / "job.log").write_text(log)
    record = {"index": index, "overrides": ["step=sft", name], "status": status, "wall_s": 3.0}
    (job / "job.json").write_text(json.dumps(record))
    return job


@pytest.fixture
def runs(tmp_path) -> dict[str, Path]:
    a = _run_dir(tmp_path / "runs" / "a", ["step=sft", "optim.lr=0.001"], [5.0, 4.0, 3.0])
    b = _run_dir(tmp_path / "runs" / "b", ["step=sft", "optim.lr=0.01"], [5.0, 3.5, 2.0, 1.5])
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    _job(
        sweep,
        1,
        "optim.lr=-1",
        "FAILED",
        "boom\nerror: invalid configuration:\n  optim.lr=-1.0: expected a positive float\n",
    )
    _job(sweep, 0, "optim.lr=0.1", "COMPLETED")
    pipeline = tmp_path / "all"
    (pipeline / ".hydra").mkdir(parents=True)
    _run_dir(pipeline / "sft", [], [4.0, 3.0])
    _run_dir(pipeline / "reward", [], [0.7, 0.5], **{"eval/accuracy": 0.9})
    (pipeline / "summary.json").write_text(
        json.dumps({"sft/eval/loss": 3.1, "reward/eval/accuracy": 0.9})
    )
    return {"a": a, "b": b, "sweep": sweep, "all": pipeline}


def test_compare_two_runs_writes_plots_and_the_table(runs, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [str(runs["a"]), str(runs["b"]), "--metrics", "eval/loss,train/loss", "--out", str(out)]
    assert compare.main(argv) == 0
    for metric in ("eval_loss", "train_loss"):
        png = out / f"{metric}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000
        with Image.open(png) as image:
            assert image.width > 300 and image.height > 200
    printed = capsys.readouterr().out
    assert "shared overrides: step=sft" in printed
    assert "| a | optim.lr=0.001 | COMPLETED | 3.1 |" in printed
    assert "| b | optim.lr=0.01 | COMPLETED | 1.6 |" in printed
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["a", "b"]
    assert [float(r["eval/loss"]) for r in rows] == pytest.approx([3.1, 1.6])
    assert (out / "summary.md").read_text().strip() == printed.strip()


def test_different_runs_draw_different_pictures(runs, tmp_path):
    """The plot shows the data: another run's curve changes the image."""
    one, two = tmp_path / "one", tmp_path / "two"
    compare.main([str(runs["a"]), "--metrics", "train/loss", "--out", str(one)])
    compare.main([str(runs["a"]), str(runs["b"]), "--metrics", "train/loss", "--out", str(two)])
    assert (one / "train_loss.png").read_bytes() != (two / "train_loss.png").read_bytes()


def test_a_sweep_dir_expands_to_its_jobs_in_launch_order(runs):
    paths = sweep_summary.expand([runs["sweep"]])
    assert [p.name for p in paths] == ["optim.lr=0.1", "optim.lr=-1"]
    records = sweep_summary.load_records(paths)
    assert [(r.label, r.status) for r in records] == [
        ("sweep#0", "COMPLETED"),
        ("sweep#1", "FAILED"),
    ]
    assert (
        records[1].note == "error: invalid configuration: optim.lr=-1.0: expected a positive float"
    )
    markdown = sweep_summary.to_markdown(records)
    assert "2 run(s): 1 completed, 1 failed" in markdown
    assert "| sweep#1 | optim.lr=-1 | FAILED | - | - |" in markdown


def test_a_step_all_run_expands_to_its_steps(runs):
    paths = sweep_summary.expand([runs["all"], runs["a"]])
    assert paths == [runs["all"] / "sft", runs["all"] / "reward", runs["a"]]
    labels = [r.label for r in sweep_summary.load_records(paths)]
    assert labels == ["all/sft", "all/reward", "runs/a"]
    # unexpanded, the pipeline's own summary has step-prefixed keys, shown by their suffix
    record = sweep_summary.load_record(runs["all"])
    assert sweep_summary.metric_columns([record]) == ["sft/eval/loss", "reward/eval/accuracy"]


def test_columns_pick_summary_keys_by_pattern(runs):
    records = sweep_summary.load_records([runs["a"], runs["b"]])
    header, rows, _ = sweep_summary.table(records, ["perf/*", "train/loss"])
    assert header[3:5] == ["perf/wall_s", "train/loss"]
    assert [row[3] for row in rows] == ["12.5", "12.5"]


def test_sweep_summary_files(runs, tmp_path):
    records = [
        sweep_summary.load_record(p, label=str(i))
        for i, p in enumerate(sweep_summary.expand([runs["sweep"]]))
    ]
    markdown = sweep_summary.write_summary(records, tmp_path / "s", first="job")
    assert (tmp_path / "s" / "summary.md").read_text() == markdown
    assert markdown.count("\n| ") == 3  # header and two rows
    with open(tmp_path / "s" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"], r["overrides"]) for r in rows] == [
        ("0", "COMPLETED", "step=sft optim.lr=0.1"),
        ("1", "FAILED", "step=sft optim.lr=-1"),
    ]


def test_a_metric_nobody_logged_makes_no_plot(runs, tmp_path, capsys):
    assert (
        compare.main([str(runs["a"]), "--metrics", "ppo/reward", "--out", str(tmp_path / "o")]) == 0
    )
    assert not (tmp_path / "o" / "ppo_reward.png").exists()
    assert "no run logged it" in capsys.readouterr().err


def test_command_line(runs, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.cli.compare", str(runs["sweep"]), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| sweep#0 |" in proc.stdout and (out / "train_loss.png").is_file()  # default metrics
    missing = subprocess.run(
        [sys.executable, "-m", "rlhf.cli.compare", str(tmp_path / "nope")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "not a run or sweep directory" in missing.stderr


def test_an_out_that_is_a_file_is_one_line_and_left_as_it_is(runs, tmp_path):
    """It was a FileExistsError traceback."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.cli.compare", str(runs["a"]), "--out", str(notes)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.strip() == (
        f"error: --out={notes}: that is a file; --out is a folder for summary.md, summary.csv "
        "and the plots (made if missing): give another --out"
    )
    assert notes.read_text() == "mine\n"


def test_an_out_folder_gets_compares_files_replaced_and_keeps_the_rest(runs, tmp_path):
    out = tmp_path / "out"
    assert compare.main([str(runs["a"]), str(runs["b"]), "--out", str(out)]) == 0
    (out / "notes.txt").write_text("mine\n")
    assert compare.main([str(runs["a"]), "--out", str(out)]) == 0
    assert "| b |" not in (out / "summary.md").read_text()  # this comparison's table
    assert (out / "notes.txt").read_text() == "mine\n"


def test_an_algorithm_sweep_compares_ppo_and_dpo_in_the_same_last_step_columns(tmp_path):
    """step=all jobs of sft -> reward -> ppo and sft -> dpo: last/ holds each pipeline's own
    step, so one column compares them; the launcher's summary_metrics pick the columns."""
    ppo = {"sft/eval/gold_accuracy": 0.03, "reward/eval/accuracy": 0.95}
    ppo |= {"ppo/eval/gold_accuracy": 0.83, "ppo/perf/gen_tokens": 9000.0}
    dpo = {"sft/eval/gold_accuracy": 0.03, "dpo/eval/gold_accuracy": 0.4}
    for name, summary in (("algo=ppo", ppo), ("algo=dpo", dpo)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    records = [sweep_summary.load_record(tmp_path / n) for n in ("algo=ppo", "algo=dpo")]
    assert records[0].metrics["last/eval/gold_accuracy"] == 0.83
    assert records[1].metrics["last/eval/gold_accuracy"] == 0.4
    assert "last/perf/gen_tokens" not in records[1].metrics
    markdown = sweep_summary.write_summary(
        records, tmp_path, "job", ["sft/eval/gold_accuracy", "last/eval/gold_accuracy"]
    )
    assert "| job | overrides | status | sft/eval/gold_accuracy | last/eval/gold_accuracy |" in (
        markdown
    )
    assert "| 0.03 | 0.83 |" in markdown and "| 0.03 | 0.4 |" in markdown
    # a single step's run has no last/ keys
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "summary.json").write_text(json.dumps({"eval/loss": 1.0}))
    assert sweep_summary.load_record(tmp_path / "one").metrics == {"eval/loss": 1.0}

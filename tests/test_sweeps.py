"""Sweeps: the sweep files compose and sweep keys that exist; the rlhf launcher (one process group
per job, failures recorded and the sweep goes on, several ranks a job) and its summary table
(hydra/launcher=slurm: test_slurm.py). The end-to-end sweeps are slow."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from omegaconf import OmegaConf

from rlhf.checks.validate import validated
from rlhf.config import TINY_VOCAB_SIZE, register_configs
from rlhf.tools import launcher as mechanics
from tests.conftest import (
    CONF_DIR,
    FAST,
    SWEEPS_DIR,
    cache_overrides,
    compose,
    compose_sweep,
    run_sweep,
    sweep_axes,
    sweep_jobs,
)

register_configs()

NEW_SWEEPS = {"lr_lora": 12, "kl_epochs": 12, "seeds": 3, "algos": 9}  # file -> number of jobs
LAUNCHER = "hydra_plugins.rlhf_launcher.rlhf_launcher.RlhfLauncher"


# --- the sweep files ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEW_SWEEPS)
def test_sweep_file_has_a_header_with_its_command_line(name):
    lines = (SWEEPS_DIR / f"{name}.yaml").read_text().splitlines()
    assert lines[0].startswith("# ")
    assert any(f"python -m rlhf -cd sweeps -cn {name}" in ln for ln in lines if ln.startswith("#"))


@pytest.mark.parametrize("name", NEW_SWEEPS)
def test_sweep_file_composes_and_every_swept_value_reaches_the_config(name):
    cfg = compose_sweep(name, hydra_config=True)
    assert cfg.hydra.mode.name == "MULTIRUN"
    params = sweep_axes(name)
    assert len(sweep_jobs(params)) == NEW_SWEEPS[name]
    base = compose_sweep(name)
    parser = OverridesParser.create()
    for key, values in params.items():
        is_group = (CONF_DIR / key).is_dir()
        if not is_group:  # a key the schema knows, not one the sweep adds
            assert OmegaConf.select(base, key, default="<absent>") != "<absent>", key
        for value in values:
            job = compose_sweep(name, [f"{key}={value}"])
            validated(job)  # validates
            if is_group:
                hydra_cfg = compose_sweep(name, [f"{key}={value}"], hydra_config=True).hydra
                assert hydra_cfg.runtime.choices[key] == value
            else:
                assert OmegaConf.select(job, key) == parser.parse_override(f"{key}={value}").value()


def test_lr_lora_sweeps_the_lora_weights_learning_rate_too():
    ranks = {}
    for lora in ("none", "r8", "r128"):
        c = validated(compose_sweep("lr_lora", [f"lora={lora}", "optim.lr=3e-4"]))
        assert c.step.name == "sft" and c.lora.learning_rate is None  # engine: lora lr = optim.lr
        ranks[lora] = c.lora.rank
    assert ranks == {"none": 0, "r8": 8, "r128": 128}


def test_seeds_sweep_moves_the_tiny_models_initialisation():
    inits = {validated(compose_sweep("seeds", [f"seed={s}"])).model.init_seed for s in (1, 2, 3)}
    assert inits == {1, 2, 3}
    assert validated(compose_sweep("seeds")).data.seed == validated(compose()).data.seed


def test_kl_epochs_runs_the_pipeline_or_ppo_on_given_exports(tmp_path):
    assert validated(compose_sweep("kl_epochs")).step.name == "all"
    # an export of the embedded default: its config.json has the shipped tokenizer's vocabulary
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": TINY_VOCAB_SIZE}))
    c = validated(
        compose_sweep(
            "kl_epochs",
            ["step=ppo", f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"],
        )
    )
    assert (c.step.name, c.ppo.kl.coef) == (
        "ppo",
        0.3,
    )  # model=tiny's (conf/tuning/tiny), until the sweep sets it


# --- the launcher: discovery and configuration -------------------------------------------------


def test_launcher_plugin_is_discovered_and_the_default_for_multiruns():
    names = {f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Launcher)}
    assert LAUNCHER in names
    launcher = compose(hydra_config=True).hydra.launcher
    assert (launcher._target_, launcher.nproc_per_node, launcher.timeout_s) == (LAUNCHER, 1, None)
    assert compose_sweep("step1", hydra_config=True).hydra.launcher._target_ == LAUNCHER
    basic = compose(["hydra/launcher=basic"], hydra_config=True).hydra.launcher
    assert basic._target_.endswith("BasicLauncher")


def test_installed_package_exposes_the_plugin_outside_the_repo(tmp_path):
    """Hydra scans the hydra_plugins namespace: the install, not the working directory."""
    code = (
        "from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher;"
        "print(sorted(c.__name__ for c in Plugins.instance().discover(Launcher)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "RlhfLauncher" in out.stdout


# --- the launcher: commands and processes ------------------------------------------------------


def test_job_command_runs_rlhf_in_run_mode_in_the_job_dir():
    job_dir = Path("/s/lora=r8,zero=stage2")
    cmd = mechanics.job_command(["zero=stage2"], job_dir, python="py")
    assert cmd[:3] == ["py", "-m", "rlhf"] and "hydra.mode=RUN" in cmd
    [run_dir] = [a for a in cmd if a.startswith("hydra.run.dir=")]
    assert OverridesParser.create().parse_override(run_dir).value() == str(job_dir)
    [sweep_dir] = [a for a in cmd if a.startswith("hydra.sweep.dir=")]
    assert OverridesParser.create().parse_override(sweep_dir).value() == "/s"
    cmd = mechanics.job_command([], job_dir, nproc_per_node=2, python="py")
    assert cmd[:5] == ["py", "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    assert cmd[cmd.index("-m", 3) + 1] == "rlhf"


def test_job_keeps_the_sweeps_config_sources_and_hydra_settings():
    sources = [
        {"path": "hydra.conf", "schema": "pkg", "provider": "hydra"},
        {"path": "/r/conf", "schema": "file", "provider": "main"},
        {"path": "/r/sweeps", "schema": "file", "provider": "command-line"},
    ]
    assert mechanics.config_args(sources, "step1") == [
        "--config-path=/r/conf",
        "--config-dir=/r/sweeps",
        "--config-name=step1",
    ]
    kept = mechanics.job_hydra_overrides(
        [
            "hydra.mode=MULTIRUN",
            "hydra.sweep.dir=/x",
            "hydra/launcher=rlhf",
            "hydra.launcher.nproc_per_node=2",
            "hydra.job.env_set.FOO=1",
            "hydra.verbose=true",
        ]
    )
    assert kept == ["hydra.job.env_set.FOO=1", "hydra.verbose=true"]


def test_job_dir_names_stay_valid_directory_names():
    assert mechanics.safe_dirname("lora=r8,zero=stage2") == "lora=r8,zero=stage2"
    assert mechanics.safe_dirname("model.path=/ckpt/sft") == "model.path=_ckpt_sft"
    long_a, long_b = "x=" + "a" * 300, "x=" + "a" * 299 + "b"
    assert len(mechanics.safe_dirname(long_a).encode()) <= 240
    assert mechanics.safe_dirname(long_a) != mechanics.safe_dirname(long_b)


def _job(tmp_path, code: str, timeout_s=None):
    job_dir = tmp_path / "job"
    result = mechanics.run_job_process(
        [sys.executable, "-c", code], job_dir, {"index": 5}, timeout_s=timeout_s
    )
    return result, json.loads((job_dir / "job.json").read_text()), job_dir


def test_job_output_and_record(tmp_path):
    result, record, job_dir = _job(
        tmp_path, "import os; print('hello', os.getpgid(0) == os.getpid())"
    )
    assert result.ok and record["status"] == "COMPLETED" and record["index"] == 5
    assert "hello True" in (job_dir / "job.log").read_text()  # its own process group
    assert record["wall_s"] > 0 and record["pid"] != os.getpid()


@pytest.mark.parametrize(
    ("code", "returncode", "note"),
    [
        ("raise SystemExit(3)", 3, ""),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, "SIGKILL (out of memory?)"),
        ("import time; time.sleep(60)", None, "timed out after 1 s"),
    ],
    ids=["exit", "killed", "timeout"],
)
def test_failed_job_is_recorded(tmp_path, code, returncode, note):
    started = time.perf_counter()
    result, record, _ = _job(tmp_path, code, timeout_s=1)
    assert time.perf_counter() - started < 20
    assert not result.ok and record["status"] == "FAILED"
    assert returncode is None or record["returncode"] == returncode
    assert note in record["note"]


def test_what_a_job_leaves_running_is_stopped(tmp_path):
    code = "import subprocess; print(subprocess.Popen(['sleep', '60']).pid)"
    result, _, job_dir = _job(tmp_path, code)
    assert result.ok
    pid = int((job_dir / "job.log").read_text().split()[-1])
    time.sleep(0.5)
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "zombie" in status.read_text()


# --- end to end (slow) -------------------------------------------------------------------------


def test_jobs_sharing_a_directory_stop_the_sweep_before_any_runs(tmp_path):
    """hydra.sweep.subdir=same: the second job would be refused by the first's lock and the
    table would show both with its record; the sweep is refused in one line instead."""
    sweep_dir = tmp_path / "sweep"
    proc = run_sweep(
        ["step=sft", "seed=1,2", "hydra.sweep.subdir=same", f"hydra.sweep.dir={sweep_dir}"]
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert f"jobs 0 and 1 of the sweep get the same directory {sweep_dir / 'same'}" in line
    assert "Traceback" not in proc.stderr
    assert not (sweep_dir / "same").exists() and not (sweep_dir / "summary.md").exists()


# conf/config.yaml's exclude_keys and the FAST keys: job dirs named by what the test sweeps
NOT_IN_NAMES = [
    "hydra.run.dir",
    "hydra.sweep.dir",
    "run_dir",
    "logger.group",
    "cache_dir",
    "data.cache_dir",
    *(o.split("=")[0] for o in FAST),
]


def _table(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_sweep_runs_each_job_apart_and_goes_on_past_a_failure(tmp_path, cache_dir):
    sweep_dir = tmp_path / "sweep"
    proc = run_sweep(
        [
            "step=sft",
            "zero=stage0,stage2",
            "lora=none,r8",
            "optim.lr=1e-3,-1",  # -1 fails validation: half of the jobs
            *FAST,
            "step.max_steps=3",
            "step.eval_at_start=false",
            *cache_overrides(cache_dir),
            f"hydra.sweep.dir={sweep_dir}",
            f"hydra.job.config.override_dirname.exclude_keys=[{','.join(NOT_IN_NAMES)}]",
        ]
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # the failures are reported...
    assert "4 of 8 job(s) failed" in proc.stderr
    assert "| job | overrides | status |" in proc.stdout  # ...after the table
    rows = _table(sweep_dir)
    assert [int(r["job"]) for r in rows] == list(range(8))
    for row in rows:
        bad = "optim.lr=-1" in row["overrides"]
        assert row["status"] == ("FAILED" if bad else "COMPLETED"), row
        if bad:
            assert "optim.lr" in row["note"] and row["eval/loss"] == ""
        else:
            assert float(row["eval/loss"]) > 0 and float(row["perf/tokens_per_s"]) > 0
            assert float(row["perf/peak_mem_gb"]) > 0 and float(row["wall_s"]) > 0
            assert (Path(row["path"]) / "metrics.jsonl").is_file()
    md = (sweep_dir / "summary.md").read_text()
    assert "4 completed, 4 failed" in md and md.count("| FAILED |") == 4
    records = [json.loads((Path(r["path"]) / "job.json").read_text()) for r in rows]
    assert len({r["pid"] for r in records}) == 8  # a process each
    for row, record in zip(rows, records):  # ${hydra.sweep.dir}/${hydra.job.override_dirname}
        named = sorted(o for o in record["overrides"] if o.split("=")[0] not in NOT_IN_NAMES)
        assert Path(row["path"]) == sweep_dir / ",".join(named)
        assert "zero=stage" in Path(row["path"]).name
        if row["status"] == "COMPLETED":  # ${hydra:sweep.dir} in a job is its sweep's
            hydra_yaml = OmegaConf.load(Path(row["path"]) / ".hydra" / "hydra.yaml")
            assert Path(hydra_yaml.hydra.sweep.dir) == sweep_dir

    from rlhf.cli import compare

    out = tmp_path / "cmp"
    assert compare.main([str(sweep_dir), "--metrics", "train/loss", "--out", str(out)]) == 0
    assert (out / "train_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "summary.md").read_text().count("| COMPLETED |") == 4


@pytest.mark.slow
def test_two_rank_job_inside_a_sweep(tmp_path, cache_dir):
    sweep_dir = tmp_path / "sweep"
    proc = run_sweep(
        [
            "step=sft",
            "zero=stage2",
            *FAST,
            "step.max_steps=2",
            "step.eval_at_start=false",
            "step.save_model=false",
            *cache_overrides(cache_dir),
            "hydra.launcher.nproc_per_node=2",
            f"hydra.sweep.dir={sweep_dir}",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = _table(sweep_dir)
    assert row["status"] == "COMPLETED" and float(row["eval/loss"]) > 0
    job_dir = Path(row["path"])
    record = json.loads((job_dir / "job.json").read_text())
    assert record["command"][2:5] == ["torch.distributed.run", "--nproc_per_node", "2"]
    logs = (job_dir / "job.log").read_text() + (job_dir / "__main__.log").read_text()
    assert re.search(r"\b2 rank", logs), logs[-2000:]


def test_the_algos_sweep_runs_every_algorithm_on_the_tool_task():
    """-cd sweeps -cn algos data=toy_tools: every job validates on the multi-turn task, with the
    embedded model's tuning (conf/tuning/tiny/: SFT's lr 2e-3)."""
    params = sweep_axes("algos", ["data=toy_tools"])
    for value in params["algo"]:
        job = validated(compose_sweep("algos", ["data=toy_tools", f"algo={value}"]))
        assert list(job.data.sources) == ["toy_tools"]
        assert job.step.name == "all" and job.model.name == "tiny"
        steps = compose_sweep("algos", ["data=toy_tools", f"algo={value}", "step=sft"])
        assert steps.optim.lr == 2e-3

"""Search through Hydra's sweepers: sweep.objective / sweep.direction resolved per step, the
value a job hands its sweeper (in-process and read back by rlhf's launchers), a metric the
summary lacks or a sweeper searching the other way stopped in one line, the best run or the
Pareto set marked in the table and in W&B, and Hydra's Optuna sweeper end to end (its study in
the sweep dir, continued by the same command) on the local and the SLURM launcher."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from rlhf.cli.compose import register_resolvers
from rlhf.config import ConfigError, register_configs, to_config
from rlhf.config.resolve import Facts, resolve
from rlhf.config.sweep import (
    SweepConfig,
    natural_direction,
    objective_values,
    sweeper_direction_problem,
    sweeper_value,
)
from rlhf.tools import launcher as mechanics
from rlhf.tools.sweep_best import best_marks, objective_line
from rlhf.tools.sweep_summary import RunRecord, load_record, to_markdown
from rlhf.tools.wandb_sweep import best_summary, sweep_rows
from tests.conftest import FAST, REPO, cache_overrides, compose, compose_sweep, run_sweep
from tests.scale_out import slurm_cluster

__all__ = ["slurm_cluster"]  # a fixture
register_configs()

SMALL = [*FAST, "step.max_steps=3", "step.eval_at_start=false"]


def resolved_sweep(*overrides: str, teacher: bool = False) -> SweepConfig:
    return resolve(to_config(compose(list(overrides))), Facts(teacher=teacher)).config.sweep


# --- what a job optimises ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "objective", "direction"),
    [
        (["step=sft"], "eval/loss", "minimize"),
        (["step=reward"], "eval/accuracy", "maximize"),
        (["step=ppo"], "eval/gold_accuracy", "maximize"),  # the toy task has a checker
        (["step=dpo", "model.path=x"], "eval/gold_accuracy", "maximize"),
        (["step=all"], "ppo/eval/gold_accuracy", "maximize"),  # the pipeline's last step's
        (["step=all", "algo=dpo"], "dpo/eval/gold_accuracy", "maximize"),
        (["step=all", "sweep.objective=sft/eval/ppl"], "sft/eval/ppl", "minimize"),
        (["step=ppo", "sweep.objective=eval/kl"], "eval/kl", "minimize"),
        (
            ["step=ppo", "sweep.objective=eval/kl", "sweep.direction=maximize"],
            "eval/kl",
            "maximize",
        ),
    ],
)
def test_each_step_has_a_headline_objective_and_its_natural_direction(
    overrides, objective, direction
):
    sweep = resolved_sweep(*overrides)
    assert (sweep.objective, sweep.direction) == ([objective], [direction])


def test_without_a_checker_rl_optimises_the_reward_and_distillation_the_teacher_kl():
    no_task = ["data=local", "data.sources.local.path=x.jsonl", "step=ppo"]
    assert resolved_sweep(*no_task).objective == ["eval/reward"]
    assert resolved_sweep(*no_task, "algo=opd", teacher=True).objective == ["eval/teacher_kl"]
    assert resolved_sweep(*no_task, "step=dpo", "model.path=x").objective == ["eval/accuracy"]


@pytest.mark.parametrize(
    ("metric", "direction"),
    [
        ("eval/gold_accuracy", "maximize"),
        ("ppo/eval/reward", "maximize"),
        ("perf/tokens_per_s", "maximize"),  # a rate
        ("eval/margin", "maximize"),
        ("sft/eval/ppl", "minimize"),
        ("eval/teacher_kl", "minimize"),
        ("eval/grade_errors", "minimize"),
        ("perf/wall_s", "minimize"),  # a duration
        ("perf/s_per_iter", "minimize"),
        ("perf/peak_mem_gb", "minimize"),
        ("reward/eval/ece", "minimize"),
    ],
)
def test_a_metrics_natural_direction(metric, direction):
    assert natural_direction(metric) == direction


def test_several_objectives_take_one_direction_each_or_one_for_all():
    sweep = resolved_sweep("step=all", "sweep.objective=[ppo/eval/gold_accuracy,ppo/eval/kl]")
    assert sweep.direction == ["maximize", "minimize"]
    sweep = resolved_sweep(
        "step=sft", "sweep.objective=[eval/loss,eval/ppl]", "sweep.direction=minimize"
    )
    assert sweep.direction == ["minimize", "minimize"]


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("sweep.direction=up", "sweep.direction='up': expected maximize or minimize"),
        ("sweep.direction=[maximize,minimize]", "one direction, or one per objective (1"),
        ("sweep.objective=[]", "sweep.objective=[]: expected a summary metric or a list"),
    ],
)
def test_a_bad_sweep_key_is_refused_in_one_line(override, named):
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf", "step=sft", override],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_the_value_handed_to_the_sweeper_is_one_number_or_a_list():
    summary = {"eval/loss": 1.5, "eval/kl": 2, "eval/ppl": 4.4}
    assert sweeper_value(objective_values(summary, ["eval/loss"])) == 1.5
    assert sweeper_value(objective_values(summary, ["eval/kl", "eval/loss"])) == [2.0, 1.5]


def test_a_metric_the_summary_lacks_names_it_and_the_metrics_beside_it():
    summary = {"ppo/eval/gold_accuracy": 0.5, "ppo/eval/kl": 1.0, "sft/eval/loss": 2.0}
    with pytest.raises(ConfigError) as err:
        objective_values(summary, ["ppo/eval/gold_acuracy"])
    message = str(err.value)
    assert message.startswith("sweep.objective=ppo/eval/gold_acuracy: the run's summary has no")
    assert "(did you mean ppo/eval/gold_accuracy?)" in message
    assert message.endswith("it has ppo/eval/gold_accuracy, ppo/eval/kl")  # its own section's
    assert "\n" not in message
    with pytest.raises(ConfigError, match="'n/a', not a number"):
        objective_values({"eval/loss": "n/a"}, ["eval/loss"])


def test_a_sweeper_searching_the_other_way_is_named():
    from hydra_plugins.hydra_optuna_sweeper.config import Direction

    sweep = SweepConfig(["eval/accuracy"], ["maximize"])
    assert sweeper_direction_problem(None, sweep) is None  # a grid has no direction
    assert sweeper_direction_problem(Direction.maximize, sweep) is None
    assert sweeper_direction_problem(["maximize"], sweep) is None
    problem = sweeper_direction_problem(Direction.minimize, sweep)
    assert problem.startswith("hydra.sweeper.direction=['minimize']: the job optimises")
    assert "eval/accuracy (maximize)" in problem and "${sweep.direction}" in problem


def _job_dir(root: Path, name: str, summary: dict, objective, direction) -> Path:
    job = root / name
    job.mkdir(parents=True)
    (job / "summary.json").write_text(json.dumps(summary))
    sweep = {"sweep": {"objective": objective, "direction": direction}}
    (job / "resolved.yaml").write_text(yaml.safe_dump(sweep))
    return job


def test_the_launchers_read_the_jobs_resolved_objective_back(tmp_path):
    job = _job_dir(tmp_path, "a", {"eval/loss": 0.25}, ["eval/loss"], ["minimize"])
    assert mechanics.read_return_value(job) == 0.25
    assert mechanics.direction_problem(job, "minimize") is None
    assert "eval/loss (minimize)" in mechanics.direction_problem(job, "maximize")
    assert mechanics.read_return_value(tmp_path / "gone") is None  # a job that wrote nothing
    bad = _job_dir(tmp_path, "b", {"eval/loss": 0.25}, ["eval/nope"], ["minimize"])
    with pytest.raises(ConfigError, match=r"sweep\.objective=eval/nope"):
        mechanics.read_return_value(bad)


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "hydra/sweeper=optuna", "optim.lr=interval(1e-4,1e-2)"],
        ["-cd", "sweeps", "-cn", "search_ppo"],  # the file's own override
    ],
)
def test_optuna_without_its_extra_names_the_extra(args, monkeypatch):
    import importlib.util

    from hydra._internal.utils import get_args_parser

    from rlhf.checks import preflight

    parsed, _ = get_args_parser().parse_known_args(args)
    monkeypatch.chdir(REPO)
    preflight.check_sweeper_installed(parsed, REPO / "conf")  # installed here: nothing said
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "hydra_plugins.hydra_optuna_sweeper" else real(name, *a),
    )
    with pytest.raises(ConfigError) as err:
        preflight.check_sweeper_installed(parsed, REPO / "conf")
    assert str(err.value).startswith("hydra/sweeper=optuna: Hydra's optuna sweeper is not")
    assert "pip install -e '.[search]'" in str(err.value)


# --- the best runs --------------------------------------------------------------------------------


def _record(label: str, status: str = "COMPLETED", **metrics) -> RunRecord:
    objective = {"eval/acc": "maximize", "eval/kl": "minimize"}
    return RunRecord(Path(label), label, status, [], metrics, objective=objective)


def test_the_pareto_set_is_the_runs_no_other_beats_on_every_objective():
    records = [
        _record("a", **{"eval/acc": 0.9, "eval/kl": 3.0}),  # best accuracy
        _record("b", **{"eval/acc": 0.7, "eval/kl": 1.0}),  # lowest KL
        _record("c", **{"eval/acc": 0.7, "eval/kl": 2.0}),  # b beats it on both
        _record("d", **{"eval/acc": 0.8, "eval/kl": 2.0}),  # a trade-off between them
        _record("e", "FAILED", **{"eval/acc": 1.0, "eval/kl": 0.0}),  # failed: not a candidate
        _record("f", **{"eval/acc": math.nan, "eval/kl": 0.5}),  # no value: not a candidate
    ]
    assert best_marks(records) == ["pareto", "pareto", "", "pareto", "", ""]
    line = objective_line(records)
    assert line == "objective: eval/acc (maximize), eval/kl (minimize); Pareto set: a, b, d"


def test_one_objective_marks_its_best_run_in_its_direction(tmp_path):
    records = [
        load_record(_job_dir(tmp_path, str(i), {"eval/kl": kl}, ["eval/kl"], ["minimize"]))
        for i, kl in enumerate([0.3, 0.1, 0.2])
    ]
    assert best_marks(records) == ["", "best", ""]
    markdown = to_markdown(records, first="job")
    assert "objective: eval/kl (minimize); best: 1 (0.1)" in markdown
    assert "| job | overrides | status | best | eval/kl |" in markdown  # its column first
    header, rows, _ = sweep_rows(records)
    assert header[:5] == ["job", "overrides", "status", "best", "eval/kl"]
    assert [row[3] for row in rows] == ["", "best", ""] and rows[1][4] == 0.1
    assert best_summary(records) == {
        "objective": ["eval/kl"],
        "direction": ["minimize"],
        "best_job": "1",
        "best/eval/kl": 0.1,
    }


def test_runs_with_different_objectives_mark_nothing(tmp_path):
    records = [
        load_record(_job_dir(tmp_path, "a", {"eval/kl": 0.3}, ["eval/kl"], ["minimize"])),
        load_record(_job_dir(tmp_path, "b", {"eval/kl": 0.1}, ["eval/loss"], ["minimize"])),
    ]
    assert best_marks(records) == ["", ""] and objective_line(records) == ""
    assert "best" not in to_markdown(records) and best_summary(records) == {}


# --- the search config ----------------------------------------------------------------------------


def test_the_search_file_is_optunas_over_ppos_keys_and_its_direction_follows_the_job(
    tmp_path,
):
    lines = (REPO / "sweeps" / "search_ppo.yaml").read_text().splitlines()
    assert lines[0].startswith("# ") and any("-cn search_ppo" in ln for ln in lines)
    register_resolvers()
    cfg = compose_sweep("search_ppo", [f"hydra.sweep.dir={tmp_path / 's'}"], hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.n_jobs == 1
    assert list(sweeper.direction) == list(cfg.sweep.direction) == ["maximize"]
    assert sweeper.storage == f"sqlite:///{tmp_path / 's' / 'optuna.db'}"  # in the sweep dir
    assert (tmp_path / "s").is_dir()  # made before Optuna opens it
    base = to_config(compose_sweep("search_ppo"))
    for key in sweeper.params:  # every searched key is one the schema knows
        section, _, leaf = key.rpartition(".")
        node = base
        for part in section.split("."):
            node = getattr(node, part)
        assert hasattr(node, leaf), key


# --- end to end -----------------------------------------------------------------------------------


def _rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_search_whose_summary_lacks_the_objective_stops_at_its_first_job_a_grid_not(
    tmp_path, cache_dir
):
    common = ["step=sft", "sweep.objective=eval/accuracy", *SMALL, *cache_overrides(cache_dir)]
    sweep_dir = tmp_path / "search"
    proc = run_sweep(
        [
            *common,
            "hydra/sweeper=optuna",
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.n_jobs=1",
            "hydra.sweeper.direction=maximize",
            "optim.lr=interval(1e-4,1e-2)",
            f"hydra.sweep.dir={sweep_dir}",
        ]
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith("error: sweep job #0 (")
    assert "sweep.objective=eval/accuracy: the run's summary has no such metric" in line
    assert "eval/loss" in line and "Traceback" not in proc.stderr
    assert len(_rows(sweep_dir)) == 1  # the second trial never ran

    # a grid hands its sweeper nothing to compare: its jobs need not have the metric
    grid_dir = tmp_path / "grid"
    proc = run_sweep([*common, "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={grid_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(grid_dir)
    assert [r["status"] for r in rows] == ["COMPLETED"] * 2 and not any(r["best"] for r in rows)


@pytest.mark.slow
def test_an_optuna_sweeper_searching_the_other_way_stops_at_its_first_job(tmp_path, cache_dir):
    proc = run_sweep(
        [
            "hydra/sweeper=optuna",
            "hydra.sweeper.n_trials=2",
            "step=sft",
            "optim.lr=interval(1e-4,1e-2)",
            "sweep.objective=eval/gold_accuracy",  # up; Optuna's default direction is down
            *SMALL,
            *cache_overrides(cache_dir),
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ]
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "hydra.sweeper.direction=['minimize']: the job optimises eval/gold_accuracy" in (
        proc.stderr
    )


@pytest.mark.slow
def test_in_process_jobs_hand_the_sweeper_their_objective_and_stop_on_a_missing_one(
    tmp_path, cache_dir
):
    """hydra/launcher=basic: the task function's return value is what Optuna records."""
    sweep_dir = tmp_path / "sweep"
    common = [
        "hydra/launcher=basic",
        "step=sft",
        *SMALL,
        *cache_overrides(cache_dir),
        f"hydra.sweep.dir={sweep_dir}",
        "hydra.sweep.subdir=${hydra.job.num}",  # Hydra's own launcher: no name cut to fit
    ]
    proc = run_sweep(
        [
            *common,
            "hydra/sweeper=optuna",
            "hydra.sweeper.n_trials=2",
            "optim.lr=interval(1e-4,1e-2)",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(p.read_text())["eval/loss"] for p in sweep_dir.glob("*/summary.json")]
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())["best_value"]
    assert len(losses) == 2 and best == min(losses)

    search = [*common, f"hydra.sweep.dir={tmp_path / 'missing'}"]  # the later sweep.dir wins
    proc = run_sweep(
        [*search, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "optim.lr=interval(1e-4,1e-2)",
         "sweep.objective=eval/nope", "hydra.sweeper.direction=maximize"]
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: sweep.objective=eval/nope: the run's summary has no such metric" in proc.stderr
    assert len(list((tmp_path / "missing").glob("*/summary.json"))) == 1  # one job, then stopped


def _search(sweep_dir: Path, cache_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_sweep(
        [
            "-cd",
            "sweeps",
            "-cn",
            "search_ppo",
            *SMALL,
            "ppo.rollout.per_device_batch_size=8",
            "ppo.update.per_device_batch_size=8",
            "ppo.eval.prompts=16",
            *cache_overrides(cache_dir),
            f"hydra.sweep.dir={sweep_dir}",
            *extra,
        ],
        timeout=1500,
    )


def _study_values(sweep_dir: Path) -> list[list[float]]:
    import optuna

    storage = f"sqlite:///{sweep_dir / 'optuna.db'}"
    study = optuna.load_study(study_name="search_ppo", storage=storage)
    return [t.values for t in study.trials if t.values is not None]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_an_optuna_search_over_ppos_keys_runs_continues_and_marks_its_best(tmp_path, cache_dir):
    sweep_dir = tmp_path / "search"
    proc = _search(sweep_dir, cache_dir, "hydra.sweeper.n_trials=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _search(sweep_dir, cache_dir, "hydra.sweeper.n_trials=1")  # the same study, on
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Using an existing study with name 'search_ppo'" in proc.stderr
    values = _study_values(sweep_dir)
    rows = [r for r in _rows(sweep_dir) if r["status"] == "COMPLETED"]
    assert len(values) == 3 and len(rows) == 3
    accuracies = [float(r["ppo/eval/gold_accuracy"]) for r in rows]
    assert sorted(v for [v] in values) == sorted(accuracies)  # what each job handed Optuna
    best = [r for r in rows if r["best"] == "best"]
    assert best and all(float(r["ppo/eval/gold_accuracy"]) == max(accuracies) for r in best)
    assert yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())[
        "best_value"
    ] == max(accuracies)
    assert (
        "objective: ppo/eval/gold_accuracy (maximize); best: "
        in (sweep_dir / "summary.md").read_text()
    )
    assert len(list((sweep_dir / "shared").iterdir())) >= 2  # SFT and reward model, once

    # two objectives: a Pareto set, the SFT and reward models of the first search reused
    pareto_dir = tmp_path / "pareto"
    proc = _search(
        pareto_dir,
        cache_dir,
        "hydra.sweeper.n_trials=2",
        "hydra/sweeper/sampler=nsgaii",
        "sweep.objective=[ppo/eval/gold_accuracy,ppo/eval/kl]",
        "sweep.direction=[maximize,minimize]",
        f"pipeline.share_dir={sweep_dir / 'shared'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(len(v) == 2 for v in _study_values(pareto_dir))
    rows = _rows(pareto_dir)
    assert rows and any(r["best"] == "pareto" for r in rows)
    assert "Pareto set: " in (pareto_dir / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_an_optuna_search_runs_its_trials_as_slurm_jobs(slurm_cluster, tmp_path, cache_dir):
    name = f"rlhf-test-{uuid.uuid4().hex[:8]}"
    sweep_dir = tmp_path / "search"
    try:
        proc = run_sweep(
            [
                "hydra/launcher=slurm",
                "hydra.launcher.poll_s=1",
                f"hydra.launcher.name={name}",
                "hydra/sweeper=optuna",
                "hydra.sweeper.n_trials=2",
                "hydra.sweeper.n_jobs=2",  # side by side
                "hydra.sweeper.direction=maximize",
                "hydra.sweeper.study_name=slurm",
                f"hydra.sweeper.storage=sqlite:///{sweep_dir}.db",
                "step=all",  # the two trials share one SFT and reward model
                f"pipeline.share_dir={tmp_path / 'shared'}",
                "sweep.objective=ppo/eval/reward",
                "ppo.kl.coef=tag(log,interval(0.01,1.0))",
                "ppo.rollout.per_device_batch_size=8",
                "ppo.update.per_device_batch_size=8",
                "ppo.eval.prompts=16",
                *SMALL,
                *cache_overrides(cache_dir),
                f"hydra.sweep.dir={sweep_dir}",
            ],
            timeout=800,
        )
    finally:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(sweep_dir)
    assert len(rows) == 2 and all(r["status"] == "COMPLETED" for r in rows)
    assert sum(r["best"] == "best" for r in rows) >= 1
    records = [json.loads((Path(r["path"]) / "job.json").read_text()) for r in rows]
    assert all(r["launcher"] == "slurm" for r in records)
    assert "Best value: " in proc.stderr + proc.stdout

"""W&B as a sweep user reads it: tags and a flat ``overrides`` entry from the command line, the
headline metrics against the step metric (the run table shows summary.json's values), each
export a model artifact and each export a run starts from an input. What rlhf hands to the W&B
client is recorded in place of ``wandb.init`` (no account, no network); one real offline run is
read back from the file ``wandb sync`` uploads."""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path

import pytest
import wandb
import yaml

from rlhf.checks.validate import validated
from rlhf.config import ConfigError, LoggerConfig, register_configs
from rlhf.tools import declare_inputs, sweep_summary, wandb_sweep
from rlhf.tools.sweep_summary import HEADLINE as TABLE_HEADLINE
from rlhf.tracking import Tracker, lineage
from rlhf.tracking.wandb_run import HEADLINE, STEP_METRIC, changed_keys, run_tags, short_tag
from tests.conftest import FAST, cache_overrides, compose, read_metrics, run_rlhf

register_configs()  # the schema Hydra composes against, as the entry point registers it

SWEEP_JOB = [
    "zero=stage3",
    "lora=r8",
    "algo=grpo",
    "seed=2",
    "+optim.extra=1",
    "hydra.run.dir=/tmp/x",
    "hydra/launcher=basic",
    "logger=wandb",
    "cache_dir=/tmp/cache",
]


# --- a recorder in place of the W&B client ---------------------------------------------------


class FakeRun:
    """The calls rlhf makes on a run, in order, as (method, args...)."""

    missing: frozenset[str] = frozenset()  # use_artifact raises for these names (not logged)

    def __init__(self, calls: list, offline: bool, run_id: str = "abc123"):
        self.calls, self.offline, self.id = calls, offline, run_id
        self.project, self.entity, self.disabled = "rlhf", "" if offline else "team", False
        self.summary = FakeSummary(calls)

    def define_metric(self, name, **options):
        self.calls.append(("define_metric", name, options))

    def log(self, row, **options):
        self.calls.append(("log", row, options))

    def log_artifact(self, artifact, aliases=None):
        self.calls.append(("log_artifact", artifact, aliases))

    def use_artifact(self, name, type=None):
        if name in self.missing:
            raise wandb.errors.CommError(f"artifact {name} not found")
        self.calls.append(("use_artifact", name, type))

    def finish(self):
        self.calls.append(("finish",))


class FakeSummary(dict):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def update(self, values):
        self.calls.append(("summary", dict(values)))
        super().update(values)


@pytest.fixture
def recorder(monkeypatch):
    """wandb.init's keyword arguments ("init", kwargs) and then the run's calls."""
    calls: list = []
    runs: list[FakeRun] = []

    def init(**kwargs):
        calls.append(("init", kwargs))
        runs.append(FakeRun(calls, offline=kwargs.get("mode") == "offline"))
        return runs[-1]

    monkeypatch.setattr(wandb, "init", init)
    return calls, runs


def of(calls: list, method: str) -> list:
    return [c[1:] for c in calls if c[0] == method]


def tracker(run_dir: Path, overrides=(), config=None, job="sft", **logger) -> Tracker:
    cfg = LoggerConfig(backend="wandb", mode=logger.pop("mode", "online"), **logger)
    return Tracker(run_dir, cfg, job, "run", config or {"zero": {"stage": 3}}, "g", True, None,
                   list(overrides))  # fmt: skip


def write_export(run_dir: Path, name: str = "model") -> Path:
    export = run_dir / name
    export.mkdir(parents=True, exist_ok=True)
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"weights")
    return export


# --- 1. tags and the overrides entry -----------------------------------------------------------


def test_tags_are_the_jobs_changes_in_short_form_plus_the_users():
    changed = changed_keys(SWEEP_JOB)
    assert "hydra.run.dir" not in changed and "hydra/launcher" not in changed
    assert changed["optim.extra"] == "1"  # "+" is how the key was added, not its name
    tags = run_tags(changed, "ppo", ["baseline", "zero=stage3"])
    assert tags == ["step=ppo", "zero=stage3", "lora=r8", "algo=grpo", "seed=2",
                    "optim.extra=1", "baseline"]  # fmt: skip
    # step=all's sub-run: its own step, not the command line's
    assert run_tags(changed_keys(["step=all", "seed=3"]), "reward", []) == [
        "step=reward",
        "seed=3",
    ]


def test_a_long_value_keeps_its_end_within_the_tag_limit():
    path = "/scratch/team/outputs/all/2024-05-01_12-00-00/zero=stage3,lora=r8/sft/model"
    tag = short_tag("actor.model.path", path)
    assert len(tag) <= 64 and tag.startswith("actor.model.path=...") and tag.endswith("sft/model")
    assert short_tag("a" * 70, "b") == "a" * 61 + "..."
    assert short_tag("zero", "stage3") == "zero=stage3"


def test_the_run_gets_tags_the_nested_config_and_a_flat_overrides_entry(tmp_path, recorder):
    calls, _ = recorder
    config = {"zero": {"stage": 3, "offload": False}, "lora": {"rank": 8}}
    t = tracker(tmp_path, SWEEP_JOB, config, job="reward", tags=["mine"])
    [(init,)] = of(calls, "init")
    assert init["tags"][:3] == ["step=reward", "zero=stage3", "lora=r8"] and "mine" in init["tags"]
    assert not any(tag.startswith(("logger", "cache_dir")) for tag in init["tags"])
    assert init["config"]["zero"] == {"stage": 3, "offload": False}  # nested, as resolved
    assert init["config"]["overrides"]["zero"] == "stage3"
    assert init["config"]["overrides"]["cache_dir"] == "/tmp/cache"  # not a tag, still a change
    assert init["job_type"] == "reward" and init["group"] == "g"
    t.close()


def test_the_runs_wandb_config_is_the_resolved_one_with_its_model_file_keys(tmp_path, recorder):
    from rlhf.config.resolve import ResolvedValues

    calls, _ = recorder
    config = ResolvedValues({"ppo": {"update": {"packing": True}}}, {"ppo.update.packing"})
    t = tracker(tmp_path, SWEEP_JOB, config, job="ppo")
    [(init,)] = of(calls, "init")
    assert init["config"]["ppo"] == {"update": {"packing": True}}
    assert init["config"]["from_model_files"] == ["ppo.update.packing"]
    t.close()


# --- 2. the headline metrics -------------------------------------------------------------------


def test_metrics_are_logged_against_the_step_metric_and_the_headlines_declared(tmp_path, recorder):
    calls, _ = recorder
    t = tracker(tmp_path)
    t.log({"train/loss": 2.0}, step=3)
    t.log_table("eval/samples", ["prompt"], [["hi"]], step=3)
    defined = {name: options for name, options in of(calls, "define_metric")}
    assert defined[STEP_METRIC] == {} and defined["*"] == {"step_metric": STEP_METRIC}
    for key in HEADLINE:
        # no summary=: W&B's own rule (last, under the key itself) is summary.json's
        assert defined[key] == {"step_metric": STEP_METRIC}, key
    rows = of(calls, "log")
    assert rows[0] == ({"train/loss": 2.0, STEP_METRIC: 3}, {})  # no step=: W&B's _step only grows
    assert rows[1][0][STEP_METRIC] == 3 and "eval/samples" in rows[1][0]
    t.close()


def test_every_column_the_sweep_table_shows_first_is_declared():
    assert set(TABLE_HEADLINE) <= set(HEADLINE)


def test_the_summary_w_and_b_gets_is_summary_json(tmp_path, recorder):
    calls, _ = recorder
    t = tracker(tmp_path)
    t.log({"eval/loss": 3.0}, step=0)
    t.log({"eval/loss": 2.5, "train/loss": 2.7}, step=4)
    t.summary({"perf/peak_mem_gb": 1.5, "initial/eval/loss": 3.0})
    t.close()
    written = json.loads((tmp_path / "summary.json").read_text())
    [(summary,)] = of(calls, "summary")
    assert summary == written and written["eval/loss"] == 2.5
    assert calls.index(("finish",)) > calls.index(("summary", summary))


# --- 3. lineage --------------------------------------------------------------------------------


def test_exports_are_logged_as_model_artifacts_by_reference(tmp_path, recorder):
    calls, _ = recorder
    t = tracker(tmp_path, job="ppo")
    actor, critic = write_export(tmp_path, "actor"), write_export(tmp_path, "critic")
    t.summary({"eval/reward": 0.5})
    t.close()
    logged = {artifact.name: (artifact, aliases) for artifact, aliases in of(calls, "log_artifact")}
    assert set(logged) == {"ppo-actor-abc123", "ppo-critic-abc123"}
    artifact, aliases = logged["ppo-actor-abc123"]
    assert artifact.type == "model" and aliases == ["latest"]
    entries = artifact.manifest.entries
    assert {e.ref for e in entries.values()} == {
        (actor / "config.json").as_uri(),
        (actor / "model.safetensors").as_uri(),
    }  # references: the paths and checksums, no copy
    assert artifact.metadata["eval/reward"] == 0.5 and artifact.metadata["export"] == "actor"
    marker = json.loads((tmp_path / lineage.MARKER).read_text())
    assert marker["critic"] == {"name": "ppo-critic-abc123", "project": "rlhf", "entity": "team"}
    assert critic.is_dir()


def test_log_model_upload_adds_the_files_and_none_logs_nothing(tmp_path, recorder, monkeypatch):
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    calls, _ = recorder
    t = tracker(tmp_path / "up", log_model="upload")
    write_export(tmp_path / "up")
    t.close()
    [(artifact, _)] = of(calls, "log_artifact")
    assert all(e.ref is None for e in artifact.manifest.entries.values())  # files, uploaded
    assert set(artifact.manifest.entries) == {"config.json", "model.safetensors"}
    calls.clear()
    t = tracker(tmp_path / "none", log_model="none")
    write_export(tmp_path / "none")
    t.close()
    assert of(calls, "log_artifact") == [] and not (tmp_path / "none" / lineage.MARKER).exists()


def test_an_export_an_earlier_run_left_is_not_this_runs_output(tmp_path, recorder):
    calls, _ = recorder
    old = write_export(tmp_path)
    os.utime(old / "config.json", (1_000_000, 1_000_000))
    tracker(tmp_path).close()
    assert of(calls, "log_artifact") == []


def test_a_vanished_export_is_a_warning_and_the_run_completes(
    tmp_path, recorder, monkeypatch, caplog
):
    t = tracker(tmp_path)
    monkeypatch.setattr(lineage, "exports_written", lambda *_: ["model"])  # listed, then gone
    with caplog.at_level(logging.WARNING):
        t.close()
    assert (tmp_path / "summary.json").is_file()
    assert any("not logged as an artifact" in r.message for r in caplog.records)
    assert not (tmp_path / lineage.MARKER).exists()


def sft_run(tmp_path: Path, recorder) -> Path:
    """An SFT run that logged its export; returns the export."""
    run_dir = tmp_path / "sft"
    t = tracker(run_dir)
    export = write_export(run_dir)
    t.close()
    recorder[0].clear()
    return export


def test_a_run_that_starts_from_a_logged_export_uses_it(tmp_path, recorder):
    sft = sft_run(tmp_path, recorder)
    calls, _ = recorder
    config = {"actor": {"model": {"path": str(sft)}}, "critic": {"model": {"path": str(sft)}}}
    tracker(tmp_path / "ppo", config=config, job="ppo").close()
    [(init,)] = of(calls, "init")
    assert init["config"]["inputs"] == {
        "actor.model.path": "sft-model-abc123",
        "critic.model.path": "sft-model-abc123",
    }
    # once, fully named (the producer's entity and project)
    assert of(calls, "use_artifact") == [("team/rlhf/sft-model-abc123:latest", "model")]


def test_a_path_that_no_run_logged_is_no_input(tmp_path, recorder):
    calls, _ = recorder
    plain = write_export(tmp_path / "downloaded")
    config = {"model": {"path": str(plain)}, "data": {"name": str(plain)}}
    tracker(tmp_path / "run", config=config).close()
    assert of(calls, "use_artifact") == [] and "inputs" not in of(calls, "init")[0][0]["config"]


def test_an_input_w_and_b_cannot_find_is_a_warning(tmp_path, recorder, monkeypatch, caplog):
    sft = sft_run(tmp_path, recorder)
    monkeypatch.setattr(FakeRun, "missing", frozenset({"team/rlhf/sft-model-abc123:latest"}))
    with caplog.at_level(logging.WARNING):
        tracker(tmp_path / "dpo", config={"model": {"path": str(sft)}}, job="dpo").close()
    assert any("not declared" in r.message for r in caplog.records)
    assert (tmp_path / "dpo" / "summary.json").is_file()


# --- 4. the sweep in W&B -----------------------------------------------------------------------


def fake_sweep(sweep_dir: Path) -> list[Path]:
    """Three job dirs as the launchers leave them: two completed, one failed."""
    jobs = []
    for index, (lr, summary) in enumerate(
        [("1e-3", {"eval/loss": 1.5, "perf/tokens_per_s": 900.0}), ("1e-4", {"eval/loss": 2.5}),
         ("-1", None)]
    ):  # fmt: skip
        job = sweep_dir / f"optim.lr={lr}"
        job.mkdir(parents=True)
        status = "FAILED" if summary is None else "COMPLETED"
        note = "optim.lr=-1: expected > 0" if summary is None else ""
        record = {"index": index, "overrides": ["step=sft", f"optim.lr={lr}"], "status": status,
                  "wall_s": 10.0 + index, "note": note}  # fmt: skip
        (job / sweep_summary.JOB_FILE).write_text(json.dumps(record))
        if summary is not None:
            (job / "summary.json").write_text(json.dumps({"step": 4, **summary}))
        jobs.append(job)
    return jobs


def sweep_records(jobs: list[Path]) -> list:
    return [sweep_summary.load_record(d, label=str(i)) for i, d in enumerate(jobs)]


def test_the_sweep_table_is_logged_as_summary_md_shows_it(tmp_path, recorder):
    calls, _ = recorder
    sweep_dir = tmp_path / "2026-12-04_10-00-00"
    records = sweep_records(fake_sweep(sweep_dir))
    markdown = sweep_summary.write_summary(records, sweep_dir, "job")
    wandb_sweep.log_sweep(sweep_dir, records, LoggerConfig(backend="wandb", mode="offline"))
    [(init,)] = of(calls, "init")
    assert init["job_type"] == "sweep" and init["group"] == sweep_dir.name  # the jobs' group
    assert init["id"] == wandb_sweep.sweep_run_id(sweep_dir) and init["resume"] == "allow"
    assert init["config"]["shared_overrides"] == ["step=sft"]
    [(row, _)] = of(calls, "log")
    table = row[wandb_sweep.TABLE_KEY]
    header = [c.strip() for c in markdown.splitlines()[3].strip("|").split("|")]
    assert table.columns == header  # summary.md's columns, in its order
    by_job = {r[0]: dict(zip(table.columns, r)) for r in table.data}
    assert by_job["0"]["eval/loss"] == 1.5 and by_job["0"]["perf/tokens_per_s"] == 900.0
    assert by_job["1"]["perf/tokens_per_s"] is None and by_job["1"]["wall_s"] == 11.0
    assert by_job["2"]["status"] == "FAILED" and by_job["2"]["note"] == "optim.lr=-1: expected > 0"
    assert by_job["2"]["overrides"] == "optim.lr=-1"
    assert of(calls, "summary") == [({"jobs": 3, "jobs_completed": 2, "jobs_failed": 1},)]
    assert calls[-1] == ("finish",)


def test_the_sweep_run_marks_the_best_job_of_the_jobs_objective(tmp_path, recorder):
    calls, _ = recorder
    jobs = fake_sweep(tmp_path)
    for job in jobs:  # what each job resolved (resolved.yaml): eval/loss, down
        sweep = {"objective": ["eval/loss"], "direction": ["minimize"]}
        (job / "resolved.yaml").write_text(yaml.safe_dump({"sweep": sweep}))
    records = sweep_records(jobs)
    wandb_sweep.log_sweep(tmp_path, records, LoggerConfig(backend="wandb", mode="offline"))
    [(row, _)] = of(calls, "log")
    table = row[wandb_sweep.TABLE_KEY]
    assert table.columns[3:5] == ["best", "eval/loss"]
    assert [r[3] for r in table.data] == ["best", "", ""]  # the failed job is no candidate
    [(summary,)] = of(calls, "summary")
    assert summary["best_job"] == "0" and summary["best/eval/loss"] == 1.5
    assert summary["objective"] == ["eval/loss"] and summary["direction"] == ["minimize"]


def test_no_sweep_run_without_wandb_and_a_wandb_error_is_a_warning(
    tmp_path, recorder, monkeypatch, caplog
):
    calls, _ = recorder
    records = sweep_records(fake_sweep(tmp_path))
    wandb_sweep.log_sweep(tmp_path, records, LoggerConfig(backend="tensorboard"))
    wandb_sweep.log_sweep(tmp_path, records, LoggerConfig(backend="wandb", mode="disabled"))
    assert calls == []

    def down(**kwargs):
        raise wandb.errors.CommError("server unreachable")

    monkeypatch.setattr(wandb, "init", down)
    with caplog.at_level(logging.WARNING):
        wandb_sweep.log_sweep(tmp_path, records, LoggerConfig(backend="wandb", mode="online"))
    assert "the sweep's table was not logged (server unreachable)" in caplog.text


def test_the_basic_launchers_callback_logs_the_sweep_and_the_rlhf_launchers_do_not(
    tmp_path, recorder
):
    """conf/config.yaml registers the callback; Hydra calls it where the sweep ends."""
    from hydra.utils import instantiate

    calls, _ = recorder
    sweep_dir = tmp_path / "sweep"
    fake_sweep(sweep_dir)
    (sweep_dir / "multirun.yaml").write_text("{}")
    for launcher, logged in (("basic", 1), ("rlhf", 0)):
        calls.clear()
        cfg = compose([f"hydra/launcher={launcher}", f"hydra.sweep.dir={sweep_dir}",
                       "logger=wandb", "logger.mode=offline"], hydra_config=True)  # fmt: skip
        callback = instantiate(cfg.hydra.callbacks.sweep_to_wandb)
        assert isinstance(callback, wandb_sweep.SweepToWandb)
        callback.on_multirun_end(config=cfg)
        assert len(of(calls, "init")) == logged, launcher


def test_the_rlhf_launcher_logs_its_table_failed_jobs_included(tmp_path, recorder):
    from hydra_plugins.rlhf_launcher.rlhf_launcher import RlhfLauncher

    calls, _ = recorder
    sweep_dir = tmp_path / "sweep"
    launcher = RlhfLauncher()
    launcher.config = compose(["logger=wandb", "logger.mode=offline"])
    launcher.jobs = [(i, d, []) for i, d in enumerate(fake_sweep(sweep_dir))]
    launcher._log_to_wandb(sweep_dir)
    [(row, _)] = of(calls, "log")
    statuses = [r[2] for r in row[wandb_sweep.TABLE_KEY].data]
    assert statuses == ["COMPLETED", "COMPLETED", "FAILED"]
    calls.clear()
    launcher.config = compose([])  # logger=none: no sweep run
    launcher._log_to_wandb(sweep_dir)
    assert calls == []


# --- 5. TensorBoard's HParams ------------------------------------------------------------------


def read_tensorboard(run_dir: Path):
    """(the session start's hparams, whether the session ended, {tag: [(step, value)]}) from
    the event files, as TensorBoard's HParams plugin reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    ended = metadata.SESSION_END_INFO_TAG in content
    assert metadata.EXPERIMENT_TAG not in content  # inferred from all the sweep's jobs
    hparams = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in
               start.hparams.items()}  # fmt: skip
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    return hparams, ended, scalars


def test_tensorboard_gets_the_sweep_axes_as_hparams_and_the_headlines(tmp_path):
    overrides = [*SWEEP_JOB, "optim.lr=1e-4", "zero.offload=true", "logger=tensorboard"]
    t = Tracker(tmp_path, LoggerConfig(backend="tensorboard"), "reward", "run", {}, "g", True,
                None, overrides)  # fmt: skip
    t.log({"train/loss": 2.0}, step=1)
    t.log({"train/loss": 1.5, "eval/accuracy": 0.75}, step=2)
    t.summary({"perf/tokens_per_s": 123.0, "perf/wall_s": 9.0})
    t.close()
    hparams, ended, scalars = read_tensorboard(tmp_path)
    # typed: a number axis sorts as numbers; where the job writes or logs is no axis
    assert hparams == {
        "step": "reward",
        "zero": "stage3",
        "lora": "r8",
        "algo": "grpo",
        "seed": 2.0,
        "optim.extra": 1.0,
        "optim.lr": 1e-4,
        "zero.offload": True,
    }
    assert ended
    assert scalars["train/loss"] == [(1, 2.0), (2, 1.5)] and scalars["eval/accuracy"] == [(2, 0.75)]
    # a headline only the summary holds is a scalar at the last step; others are not written
    assert scalars["perf/tokens_per_s"] == [(2, 123.0)] and "perf/wall_s" not in scalars


def test_a_tensorboard_run_that_did_not_end_has_no_session_end(tmp_path):
    t = Tracker(tmp_path, LoggerConfig(backend="tensorboard"), "sft", "run", {}, None, True, None,
                ["seed=3"])  # fmt: skip
    t.log({"train/loss": 2.0}, step=1)
    t._tensorboard.writer.flush()  # a run killed here: its events are on disk, its end is not
    hparams, ended, _ = read_tensorboard(tmp_path)
    assert hparams == {"step": "sft", "seed": 3.0} and not ended
    t._tensorboard.writer.close()


def test_tensorboard_holds_the_resolved_config_as_text(tmp_path):
    """The run's config as TensorBoard shows it: resolved.yaml, the model-file values marked."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlhf.config.resolve import FROM_MODEL, ResolvedValues
    from rlhf.tracking.tensorboard_run import CONFIG_TAG

    config = ResolvedValues({"ppo": {"update": {"packing": True}}}, {"ppo.update.packing"})
    t = Tracker(tmp_path, LoggerConfig(backend="tensorboard"), "ppo", "run", config, None, True,
                None, ["seed=3"])  # fmt: skip
    t.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    [tag] = [t for t in events.Tags()["tensors"] if t.startswith(CONFIG_TAG)]
    [text] = events.Tensors(tag)
    shown = text.tensor_proto.string_val[0].decode()
    assert f"packing: true  {FROM_MODEL}" in shown and "    ppo:" in shown


# --- 6. offline --------------------------------------------------------------------------------


def test_offline_the_inputs_wait_for_sync_and_declare_inputs_declares_them(tmp_path, recorder):
    sft = sft_run(tmp_path, recorder)
    calls, _ = recorder
    run_dir = tmp_path / "reward"
    tracker(run_dir, config={"model": {"path": str(sft)}}, job="reward", mode="offline").close()
    assert of(calls, "use_artifact") == []  # W&B refuses it offline
    pending = json.loads((run_dir / lineage.PENDING).read_text())
    assert pending["id"] == "abc123" and pending["inputs"][0]["name"] == "sft-model-abc123"
    calls.clear()
    assert declare_inputs.main([str(tmp_path)]) == 0
    [(init,)] = of(calls, "init")
    assert init["id"] == "abc123" and init["resume"] == "must" and init["mode"] == "online"
    assert of(calls, "use_artifact") == [("team/rlhf/sft-model-abc123:latest", "model")]
    assert not (run_dir / lineage.PENDING).exists()  # declared once
    assert declare_inputs.pending_files([tmp_path]) == []


def read_records(path: Path, starts: list[int] | None = None):
    """The records of a W&B transaction log (what ``wandb sync`` uploads): a 7-byte header, then
    LevelDB-log blocks of 32 KiB whose chunks (7-byte header: crc, length, type) join into
    protobuf Records. ``starts``: each record's first chunk's offset is appended to it."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if starts is not None and not pending:
            starts.append(pos)
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.fixture
def real_offline_wandb(tmp_path, monkeypatch):
    """The real client, offline, in a W&B session of this test's own: a session an earlier test
    of this worker started would ignore the settings below."""
    wandb.teardown()
    for name, value in (
        ("WANDB_MODE", "offline"),
        ("WANDB_DIR", tmp_path),
        ("WANDB_CACHE_DIR", tmp_path / "cache"),
        ("WANDB_CONFIG_DIR", tmp_path / "config"),
        # wandb.init leaves its service's address in os.environ; unset again after this test, or
        # every rlhf process a later test of this worker starts joins that service, where a
        # resumed run's id is still "in use" by the killed run before it
        ("WANDB_SERVICE", ""),
    ):
        monkeypatch.setenv(name, str(value))
    yield
    wandb.teardown()


def test_an_offline_run_dir_holds_what_sync_uploads(tmp_path, real_offline_wandb):
    """The real client offline: tags, the overrides entry, the step metric, the artifact by
    reference and, as the run's final summary, summary.json's headline values."""
    run_dir = tmp_path / "run"
    t = tracker(run_dir, ["zero=stage3", "lora=r8"], mode="offline")
    for step, loss in ((0, 3.0), (2, 2.0), (4, 2.5)):
        t.log({"eval/loss": loss, "train/loss": loss + 0.1}, step=step)
    export = write_export(run_dir)
    t.summary({"perf/peak_mem_gb": 1.25})
    t.close()
    wandb.teardown()  # finish() may return before the service has written the file out
    [log_file] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = {}
    for record in read_records(log_file):
        records.setdefault(record.WhichOneof("record_type"), []).append(record)
    [run] = [r.run for r in records["run"]]
    assert list(run.tags) == ["step=sft", "zero=stage3", "lora=r8"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["overrides"] == {"zero": "stage3", "lora": "r8"}
    metrics = {m.metric.name: m.metric.step_metric for m in records["metric"] if m.metric.name}
    assert metrics["eval/loss"] == STEP_METRIC
    [artifact] = [a.artifact for a in records["artifact"] if a.artifact.type == "model"]
    assert artifact.name == f"sft-model-{run.run_id}"
    assert {c.ref for c in artifact.manifest.contents} == {
        p.as_uri() for p in sorted(export.iterdir())
    }
    final: dict = {}
    for record in records["summary"]:
        final.update({u.key or u.nested_key[0]: u.value_json for u in record.summary.update})
    written = json.loads((run_dir / "summary.json").read_text())
    for key in ("eval/loss", "train/loss", "perf/peak_mem_gb", STEP_METRIC):
        assert json.loads(final[key]) == written[key], key  # the run table is summary.csv's
    assert written["eval/loss"] == 2.5  # the last, not the best


def test_an_offline_sweep_run_holds_the_table(tmp_path, real_offline_wandb):
    """The real client offline: the sweep's run (job type sweep, the jobs' group) and its table
    are in the file ``wandb sync`` uploads."""
    sweep_dir = tmp_path / "sweep"
    records = sweep_records(fake_sweep(sweep_dir))
    wandb_sweep.log_sweep(sweep_dir, records, LoggerConfig(backend="wandb", mode="offline"))
    wandb.teardown()  # as above: the file is complete once the service has stopped
    [log_file] = sweep_dir.glob("wandb/offline-run-*/run-*.wandb")
    found = {}
    for record in read_records(log_file):
        found.setdefault(record.WhichOneof("record_type"), []).append(record)
    [run] = [r.run for r in found["run"]]
    assert run.job_type == "sweep" and run.run_group == "sweep"
    assert run.run_id == wandb_sweep.sweep_run_id(sweep_dir)
    logged = {item.key or item.nested_key[0] for r in found["history"] for item in r.history.item}
    assert wandb_sweep.TABLE_KEY in logged


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "logger.log_model=full",
            "logger.log_model='full': expected one of none, reference, upload",
        ),
        ("logger.tags=baseline", "logger.tags='baseline': expected a list of tags of 1 to 64"),
        ("logger.tags=[[a,b]]", "logger.tags=[['a', 'b']]: expected a list of tags"),
        (f"logger.tags=[{'x' * 65}]", "expected a list of tags of 1 to 64 characters"),
    ],
)
def test_a_bad_logger_value_is_one_line_before_training(override, line):
    with pytest.raises(ConfigError) as err:
        validated(compose(["step=sft", "logger=wandb", override]))
    [found] = [ln for ln in str(err.value).splitlines() if line in ln]
    assert "logger.tags=[baseline,try-2]" in found or "log_model" in found


def test_a_mapping_of_tags_is_one_line_not_hydras_merge_error():
    import subprocess
    import sys

    from tests.conftest import REPO

    cmd = [sys.executable, "-m", "rlhf", "step=sft", "logger=wandb", "logger.tags={a:1}"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: logger.tags={'a': 1}: expected a list of tags of 1 to 64 characters, as in "
        "logger.tags=[baseline,try-2]"
    )


def test_the_default_is_reference_and_good_tags_pass():
    config = validated(compose(["step=sft", "logger=wandb", "logger.tags=[baseline,2]"]))
    assert config.logger.log_model == "reference" and config.logger.tags == ["baseline", 2]


@pytest.mark.slow
def test_step_all_offline_leaves_the_pipeline_to_sync(tmp_path, cache_dir):
    """step=all with W&B offline: each step logs its exports, and each later step records the
    earlier ones as its inputs (reward <- SFT, PPO <- SFT and reward) for declare_inputs."""
    run_dir = tmp_path / "run"
    small = ["reward.gold_eval_prompts=8", "ppo.rollout.max_new_tokens=16", "ppo.eval.prompts=8"]
    batches = ["ppo.rollout.per_device_batch_size=8", "ppo.update.per_device_batch_size=8"]
    fast = [o for o in FAST if not o.startswith("data.sources.toy.num_rows")]
    run_rlhf(
        ["step=all", "logger=wandb", "logger.mode=offline", "step.max_steps=2",
         "data.sources.toy.num_rows=320", *fast, *small, *batches, *cache_overrides(cache_dir)],
        run_dir=run_dir,
        extra_env={"WANDB_MODE": "offline", "HOME": str(tmp_path)},
    )  # fmt: skip
    logged = {
        step: json.loads((run_dir / step / lineage.MARKER).read_text())
        for step in ("sft", "reward", "ppo")
    }
    assert set(logged["ppo"]) == {"actor", "critic"}
    inputs = {
        step: {ref["name"] for ref in json.loads((run_dir / step / lineage.PENDING).read_text())["inputs"]}
        for step in ("reward", "ppo")
    }  # fmt: skip
    assert inputs["reward"] == {logged["sft"]["model"]["name"]}
    assert inputs["ppo"] == {logged["sft"]["model"]["name"], logged["reward"]["model"]["name"]}
    for step in ("sft", "reward", "ppo"):
        [log_file] = (run_dir / step).glob("wandb/offline-run-*/run-*.wandb")
        [run] = [r.run for r in read_records(log_file) if r.WhichOneof("record_type") == "run"]
        assert f"step={step}" in run.tags and "data.sources.toy.num_rows=320" in run.tags


# --- a resumed run's W&B history: each step once --------------------------------------------


def test_a_wandb_that_stops_answering_is_one_warning_and_the_run_goes_on(
    tmp_path, recorder, caplog
):
    """SLURM's requeue or scancel sends SIGTERM to every process of the job, W&B's service
    among them, while the run goes on to its checkpoint: its next log call fails."""
    calls, runs = recorder
    t = tracker(tmp_path, mode="offline")
    t.log({"train/loss": 1.0}, step=1)

    def lost(row, **options):
        raise ConnectionResetError("Connection lost")

    runs[0].log = lost
    with caplog.at_level(logging.WARNING):
        t.log({"train/loss": 0.9}, step=2)
        t.log({"train/loss": 0.8}, step=3)
        t.close()
    [warning] = [r.message for r in caplog.records if "W&B" in r.message]
    assert warning.startswith("W&B stopped answering (ConnectionResetError: Connection lost)")
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]
    assert of(calls, "finish") == []  # nothing more is asked of the dead service
    assert t.state(3)["wandb_id"] == "abc123"  # the resumed run continues the same W&B run


def test_a_resumed_tracker_sends_wandb_what_its_log_lacks_and_nothing_it_holds(
    tmp_path, recorder, monkeypatch
):
    """Checkpoint at step 3. W&B's log of the killed run holds steps 1-2 and 4 (the service
    had not written step 3 when the run was killed at 4): step 3 is sent from metrics.jsonl at
    the start, step 4 is not sent again, step 5 is."""
    from rlhf import tracking

    calls, _ = recorder
    rows = [{"step": s, "train/loss": 1.0 / s} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = {1: {"train/loss"}, 2: {"train/loss"}, 4: {"train/loss"}}
    monkeypatch.setattr(tracking, "held_history", lambda run_dir, run_id, metric: held)
    resume = {"step": 3, "summary": {}, "wandb_id": "abc123", "rows": {"metrics.jsonl": 3}}
    cfg = LoggerConfig(backend="wandb", mode="offline")
    t = Tracker(tmp_path, cfg, "sft", "run", {}, "g", True, resume, [])
    t.log({"train/loss": 0.25}, step=4)  # recomputed by the exact resume: W&B has it
    t.log({"train/loss": 0.2}, step=5)
    sent = [row[STEP_METRIC] for row, _ in of(calls, "log")]
    assert sent == [3, 5]
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]


def test_the_transaction_log_reader_stops_at_a_torn_record(tmp_path, real_offline_wandb):
    """What a SIGKILL mid-write leaves: the last record cut short. The reader gives every whole
    row before it, as the test's own reader of the format does."""
    from rlhf.tracking.wandb_log import history_rows

    run_dir = tmp_path / "run"
    t = tracker(run_dir, mode="offline")
    for step in range(1, 6):
        t.log({"train/loss": 1.0 / step}, step=step)
    t.close()
    wandb.teardown()
    [log_file] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    steps = [row["step"] for row in history_rows(log_file)]
    assert steps == [1, 2, 3, 4, 5]
    starts: list[int] = []
    kinds = [r.WhichOneof("record_type") for r in read_records(log_file, starts)]
    fifth = starts[[i for i, kind in enumerate(kinds) if kind == "history"][4]]
    log_file.write_bytes(log_file.read_bytes()[: fifth + 12])  # step 5's row, cut short
    assert [row["step"] for row in history_rows(log_file)] == [1, 2, 3, 4]


def test_a_resumed_tensorboard_run_purges_what_the_killed_run_logged_after_its_checkpoint(
    tmp_path,
):
    """The killed run logged steps 1-6 (its checkpoint at 4, then killed: no close); the
    resumed one starts at 5 with purge_step 5 and logs 5-8: TensorBoard reads each step once,
    5 and 6 the resumed run's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlhf.tracking.tensorboard_run import TensorBoardRun

    killed = TensorBoardRun(tmp_path, "sft", [])
    for step in range(1, 7):
        killed.log({"train/loss": float(step)}, step)
    killed.writer.flush()
    resumed = TensorBoardRun(tmp_path, "sft", [], purge_step=5)
    for step in range(5, 9):
        resumed.log({"train/loss": 10.0 * step}, step)
    resumed.close({})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert scalars == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (5, 50.0),
        (6, 60.0),
        (7, 70.0),
        (8, 80.0),
    ]

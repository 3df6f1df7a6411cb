"""The pipeline as a W&B graph: each export a run writes is logged as a model artifact (by
reference unless logger.log_model=upload), and a run that starts from an export another run
logged declares it with ``use_artifact``. The producer names its artifacts in ``MARKER`` beside
its exports, which is how a later run, in this process or another, finds them from a path.

W&B refuses ``use_artifact`` offline: an offline run records its inputs in its config
(``inputs``) and in ``PENDING``; ``python -m rlhf.tools.declare_inputs RUN_DIR`` declares them
once ``wandb sync`` has uploaded the runs. Nothing here fails a run: W&B's errors are warnings."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MARKER = "wandb_artifacts.json"  # in a run dir: {export: the artifact it was logged as}
PENDING = "wandb_inputs.json"  # in an offline run's dir: the inputs to declare after sync
EXPORTS = ("model", "actor", "critic", "actor_ema")  # the export directories a step writes
BEST = ()  # exports that are a best-so-far copy (alias `best`); no step writes one yet
ARTIFACT_TYPE = "model"
# a shared file system stamps files with its own clock, which may lag this node's a little
CLOCK_SLACK_S = 60.0


@dataclass(frozen=True)
class ArtifactRef:
    """A logged export: the artifact's name, and where it was logged (entity None: the
    consumer's own, as for a producer that logged offline)."""

    name: str
    project: str
    entity: str | None = None

    def qualified(self, default_entity: str | None) -> str:
        entity = self.entity or default_entity
        where = f"{entity}/{self.project}/" if entity else ""
        return f"{where}{self.name}:latest"


# --- the producer ------------------------------------------------------------------------------


def exports_written(run_dir: Path, since: float) -> list[str]:
    """The exports in ``run_dir`` written since ``since`` (an earlier run's left in the same
    dir are not this run's outputs)."""
    out = []
    for name in EXPORTS:
        config = run_dir / name / "config.json"
        if config.is_file() and config.stat().st_mtime >= since - CLOCK_SLACK_S:
            out.append(name)
    return out


def log_exports(
    run, run_dir: Path, job_type: str, how: str, since: float, metadata: dict[str, Any]
) -> dict[str, ArtifactRef]:
    """Log each export written since ``since`` as ``<job type>-<export>-<run id>``
    (``how``: logger.log_model); name them in MARKER. Returns what was logged."""
    if how == "none" or getattr(run, "disabled", False):
        return {}
    logged = {}
    for export in exports_written(run_dir, since):
        name = f"{job_type}-{export}-{run.id}"
        if _log_one(run, run_dir / export, name, how, {**metadata, "export": export}):
            logged[export] = ArtifactRef(name, run.project, run.entity or None)
    if logged:
        _write_json(run_dir / MARKER, {k: asdict(v) for k, v in logged.items()})
    return logged


def _log_one(run, path: Path, name: str, how: str, metadata: dict[str, Any]) -> bool:
    import wandb

    aliases = ["latest", *(["best"] if path.name in BEST else [])]
    try:
        artifact = wandb.Artifact(name, type=ARTIFACT_TYPE, metadata=metadata)
        if how == "upload":  # exports are replaced whole, never edited: no staging copy needed
            artifact.add_dir(str(path), policy="immutable")
        else:
            artifact.add_reference(path.resolve().as_uri())
        run.log_artifact(artifact, aliases=aliases)
    except Exception as err:  # a vanished path or a W&B error costs the artifact, not the run
        log.warning("W&B: %s not logged as an artifact (%s); the run goes on", path, err)
        return False
    return True


# --- the consumer ------------------------------------------------------------------------------


def inputs(config: dict[str, Any]) -> dict[str, ArtifactRef]:
    """``{key: artifact}`` for each ``*.path`` key of the resolved ``config`` that points at an
    export a run logged (actor.model.path=RUN/sft/model, ...)."""
    found = {}
    for key, value in _paths(config):
        ref = logged_export(Path(value).expanduser())
        if ref is not None:
            found[key] = ref
    return found


def named(found: dict[str, ArtifactRef]) -> dict[str, str]:
    """What the config's ``inputs`` entry shows: each key's artifact."""
    return {key: ref.name for key, ref in found.items()}


def logged_export(path: Path) -> ArtifactRef | None:
    """The artifact ``path`` (an export directory) was logged as, from its run's MARKER."""
    marker = path.parent / MARKER
    if not marker.is_file():
        return None
    try:
        entry = json.loads(marker.read_text()).get(path.name)
        return ArtifactRef(**entry) if entry else None
    except (json.JSONDecodeError, TypeError, AttributeError):  # not ours, or cut short
        log.warning("W&B: %s is unreadable; %s is not declared as an input", marker, path)
        return None


def use_inputs(run, found: dict[str, ArtifactRef], run_dir: Path) -> None:
    """Declare each input once; offline, record them in PENDING for after ``wandb sync``."""
    refs = list(dict.fromkeys(found.values()))
    if not refs or getattr(run, "disabled", False):
        return
    if run.offline:
        pending = {"id": run.id, "project": run.project, "inputs": [asdict(r) for r in refs]}
        _write_json(run_dir / PENDING, pending)
        log.info(
            "W&B offline: inputs %s are in the run's config; after `wandb sync`, "
            "`python -m rlhf.tools.declare_inputs %s` declares them",
            ", ".join(ref.name for ref in refs),
            run_dir,
        )
        return
    for ref in refs:
        declare(run, ref.qualified(run.entity))


def declare(run, name: str) -> bool:
    """``use_artifact(name)``; a missing artifact (its run not synced yet) is a warning."""
    try:
        run.use_artifact(name, type=ARTIFACT_TYPE)
    except Exception as err:  # the W&B client raises several kinds; none should stop training
        log.warning("W&B: input %s not declared (%s); the run goes on", name, err)
        return False
    return True


def _paths(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, value) of each non-empty string under a key named ``path``."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, f"{prefix}{key}.")
    elif isinstance(node, str) and node and prefix.rstrip(".").rsplit(".", 1)[-1] == "path":
        yield prefix.rstrip("."), node


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
    os.replace(tmp, path)

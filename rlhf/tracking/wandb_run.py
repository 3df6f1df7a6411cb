"""A W&B run as a sweep user compares it: tags from the job's command-line overrides, the
config resolved with a flat ``overrides`` entry, the headline metrics declared against the
training step, and the exports it starts from declared as inputs (rlhf.tracking.lineage)."""

from __future__ import annotations

import contextlib
import logging
import netrc
import os
from pathlib import Path
from typing import Any

from rlhf.config import LoggerConfig
from rlhf.config.logger import TAG_LIMIT
from rlhf.tracking import lineage

log = logging.getLogger(__name__)

# The x axis of every chart: metrics.jsonl's own "step" column, logged in each row. W&B's
# internal _step only grows, so a resumed run that logs its last steps again would lose them.
STEP_METRIC = "step"
# The metrics summary.md / summary.csv show first (rlhf/tools/sweep_summary.py's HEADLINE) and
# the other headlines a step's report gives. summary.json keeps each one's final value (the final
# evaluation is logged last), which is W&B's own summary rule; an explicit summary="last" would
# nest the value as <key>.last, a column summary.csv does not have, so none is passed.
HEADLINE = (
    "eval/loss",
    "eval/ppl",
    "eval/accuracy",
    "eval/chosen_score",
    "eval/rejected_score",
    "eval/reward",
    "eval/kl",
    "eval/gold_accuracy",
    "eval/gold_accuracy_sampled",
    "eval/gold_correct",
    "eval/gold_clean",
    "train/loss",
    "perf/tokens_per_s",
    "perf/gen_tokens_per_s",
    "perf/peak_mem_gb",
)
# Overrides that say where a job writes or how it is tracked, not what it trains: in the
# config's ``overrides`` entry, never tags
UNTAGGED = ("hydra", "logger", "run_dir", "cache_dir", "data.cache_dir")


def job_overrides() -> list[str]:
    """This job's command-line overrides (a sweep's job: its own values too); none outside a
    Hydra app (a test, a tool)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [str(o) for o in HydraConfig.get().overrides.task]


def changed_keys(overrides: list[str]) -> dict[str, str]:
    """``{key: value}`` of ``key=value`` overrides, ``+`` dropped; deletions (``~key``) and
    Hydra's own keys (run and sweep dirs, the launcher) left out."""
    out = {}
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.lstrip("+")
        if sep and not key.startswith("~") and not _is_under(key, ("hydra",)):
            out[key] = value
    return out


def run_tags(changed: dict[str, str], job_type: str, user_tags: list) -> list[str]:
    """``step=<job type>`` (step=all's sub-runs: their own step), a short ``key=value`` for each
    other changed key, then the user's ``logger.tags``; each once."""
    tags = [short_tag(k, v) for k, v in changed.items() if k != "step" and not is_untagged(k)]
    return list(dict.fromkeys([f"step={job_type}", *tags, *map(str, user_tags)]))


def short_tag(key: str, value: str) -> str:
    """``key=value`` within W&B's tag limit: a long value keeps its end (a path's last parts
    tell exports apart, its first parts are alike)."""
    tag = f"{key}={value}"
    if len(tag) <= TAG_LIMIT:
        return tag
    room = TAG_LIMIT - len(key) - len("=...")
    if room < 8:  # a long key too: its start, cut
        return tag[: TAG_LIMIT - 3] + "..."
    return f"{key}=...{value[-room:]}"


def is_untagged(key: str) -> bool:
    return _is_under(key, UNTAGGED)


def _is_under(key: str, prefixes: tuple[str, ...]) -> bool:
    """``key`` is one of ``prefixes`` or below one (``hydra.run.dir``, ``hydra/launcher``)."""
    return any(key == p or key.startswith((f"{p}.", f"{p}/")) for p in prefixes)


def declare_metrics(run) -> None:
    """Every metric against the step metric, the headlines by name, so the run table and the
    charts read as metrics.jsonl and summary.json do."""
    run.define_metric(STEP_METRIC)
    run.define_metric("*", step_metric=STEP_METRIC)
    for key in HEADLINE:
        run.define_metric(key, step_metric=STEP_METRIC)


def start_wandb(
    run_dir: Path,
    cfg: LoggerConfig,
    job_type: str,
    run_name: str,
    config: dict[str, Any],
    group: str | None,
    run_id: str | None = None,
    overrides: list[str] | None = None,
):
    """The run: ``config`` (resolved, nested) plus ``overrides`` (what the job changed, flat),
    ``from_model_files`` (the keys resolved from the model files) and ``inputs`` (the logged
    exports it starts from); tagged, its metrics declared, its
    inputs used. ``overrides``: the command line's (None: Hydra's, see job_overrides)."""
    import wandb

    mode = wandb_mode(cfg.mode)
    if mode == "offline" and cfg.mode == "auto":
        log.warning(
            "W&B: no API key found, logging offline to %s (upload with `wandb sync`)",
            run_dir / "wandb",
        )
    changed = changed_keys(job_overrides() if overrides is None else overrides)
    inputs = lineage.inputs(config)
    extra = {"overrides": changed, **({"inputs": lineage.named(inputs)} if inputs else {})}
    if from_model := sorted(getattr(config, "from_model", ())):  # resolved.yaml's marks
        extra["from_model_files"] = from_model
    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        group=cfg.group or group,
        job_type=job_type,
        name=cfg.name or run_name,
        tags=run_tags(changed, job_type, cfg.tags),
        config={**config, **extra},
        dir=str(run_dir),
        mode=mode,
        id=run_id,
        resume="allow" if run_id else None,
    )
    declare_metrics(run)
    lineage.use_inputs(run, inputs, run_dir)
    return run


def _api_key_known() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return bool(netrc.netrc().authenticators("api.wandb.ai"))
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


DEFAULT_SERVER = "https://api.wandb.ai"
PROBE_TIMEOUT_S = 10


def wandb_problem(cfg: LoggerConfig) -> str | None:
    """logger.mode=online without an API key, or with a server that does not answer: W&B would
    fail at its first request (or ask for a key on a terminal, or retry for minutes); say so
    before anything runs."""
    if cfg.backend != "wandb" or cfg.mode != "online":
        return None
    if not _api_key_known():
        return (
            "logger.mode=online: no W&B API key (WANDB_API_KEY, or `wandb login`); log in, or "
            "use logger.mode=offline (upload later with `wandb sync`) or auto"
        )
    server = os.environ.get("WANDB_BASE_URL") or DEFAULT_SERVER
    why = unreachable(server)
    if why is None:
        return None
    return (
        f"logger.mode=online: the W&B server {server} does not answer ({why}); check the "
        "network (or WANDB_BASE_URL), or use logger.mode=offline (upload later with `wandb sync`)"
    )


def unreachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``url`` gives no HTTP answer (any status is an answer), or None. Through the
    environment's proxies, as the W&B client goes."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        return str(reason) or type(err).__name__
    return None


def wandb_mode(requested: str) -> str:
    """'auto' logs online when an API key is known and offline otherwise (sync later with
    ``wandb sync``), so runs never block on a login prompt."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if _api_key_known() else "offline"


class WandbStream:
    """The tracker's W&B run. It sends each step's metrics once: not those W&B's log of the run
    already holds (``held``, from :func:`rlhf.tracking.wandb_log.held_history`: a killed run's
    steps after its checkpoint, which an exact resume recomputes), and, on resume, the rows of
    metrics.jsonl it lacks (:meth:`backfill`). When W&B stops answering it warns once and logs
    on to metrics.jsonl alone: a SIGTERM to every process of a job (SLURM's requeue, scancel,
    preemption) ends W&B's service while the run goes on to its checkpoint; the next run in
    the run dir sends what this one could not."""

    def __init__(self, run, held: dict[int, set[str]]):
        self.run, self.held = run, held
        self.id = run.id

    def log(self, metrics: dict[str, Any], step: int) -> None:
        fresh = {k: v for k, v in metrics.items() if k not in self.held.get(step, ())}
        if fresh:
            self._call(lambda run: run.log({**fresh, STEP_METRIC: step}))
            self.held.setdefault(step, set()).update(fresh)

    def backfill(self, rows: list[dict[str, Any]]) -> None:
        """The rows (metrics.jsonl's, up to the checkpoint) whose metrics W&B lacks: those a
        run lost W&B before sending, or that its service had not written when it was killed."""
        for row in rows:
            self.log({k: v for k, v in row.items() if k != STEP_METRIC}, row[STEP_METRIC])

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        if name in self.held.get(step, ()):
            return
        import wandb

        table = wandb.Table(columns=columns, data=rows)
        self._call(lambda run: run.log({name: table, STEP_METRIC: step}))

    def finish(self, summary: dict[str, Any], exports) -> None:
        """The summary, the exports as artifacts (``exports(run)``), then the end of the run."""
        self._call(lambda run: run.summary.update(summary))
        self._call(exports)
        self._call(lambda run: run.finish())

    def _call(self, action) -> None:
        """``action(run)``, unless W&B has stopped answering (then nothing)."""
        if self.run is None:
            return
        try:
            action(self.run)
        except Exception as err:  # any failure of W&B's client or service: the run goes on
            log.warning(
                "W&B stopped answering (%s: %s); metrics go on to metrics.jsonl, and the run "
                "that resumes this one sends W&B what it missed",
                type(err).__name__,
                err,
            )
            self.run = None
            _forget_service()


def _forget_service() -> None:
    """Drop the connection to W&B's dead service, so that its exit hook (a teardown that would
    fail with a traceback at exit) is not run."""
    import wandb

    with contextlib.suppress(Exception):  # its message to the dead service fails; the hook goes
        wandb.teardown()

"""step=all: the chosen algorithm's pipeline (``pipeline.steps``; algo=ppo: SFT -> reward -> PPO,
algo=dpo: SFT -> DPO), each step a sub-run in <run_dir>/<step> reading the previous step's
exports. Each step's config is composed anew from the same command-line overrides with
``step=<name>``, so step-specific defaults (conf/step/*.yaml, an experiment's per-step file)
apply exactly as in a single-step run; every step's config is composed (and, by the entry
point, validated) before the first one runs. Re-running in the same run dir
(``hydra.run.dir=...``) skips the steps whose outputs are complete.

With ``ppo.reward.function`` set no reward model is used, so none is trained: the pipeline is
SFT -> PPO and the critic starts from the SFT export.

``pipeline.share_dir=DIR``: the steps before the algorithm's own (SFT, the reward model) run in
DIR/<step>-<hash of every key they read>, linked as <run_dir>/<step>; a later run (a sweep's
next job) whose same step reads the same values finds it complete there and trains it no more,
so PPO, GRPO and DPO start from one SFT model; jobs running at once take turns (one trains,
the others wait on a lock in the step's dir). Keys only later steps read (ppo.*, dpo.*, actor.*,
critic.*, pipeline.*) and what resume=auto may change are left out of the hash. The code is not
in it: after changing a step's code, give a new share_dir."""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from hydra import compose
from omegaconf import DictConfig, OmegaConf

from rlhf import registry
from rlhf.config import NOT_READ_BY, Config
from rlhf.config.sharing import share_command_line
from rlhf.runtime.dist import from_main, is_main
from rlhf.runtime.locks import exclusive
from rlhf.runtime.resume import flat, resumable
from rlhf.steps import dpo, ppo, report, reward, sft
from rlhf.steps.loop import RunInfo, write_resolved
from rlhf.tracking import plain

log = logging.getLogger(__name__)

RECIPES = {"sft": sft.run, "reward": reward.run, "ppo": ppo.run, "dpo": dpo.run}
# the exports that mark a step complete and that later steps read (PPO writes critic/ too
# when it trains a critic)
EXPORTS = {"sft": ("model",), "reward": ("model",), "ppo": ("actor",), "dpo": ("model",)}


def pipeline(steps: list[str], uses_reward_model: bool) -> tuple[str, ...]:
    """The steps of step=all, in order: ``steps`` (pipeline.steps) less the reward model's when
    PPO uses none."""
    return tuple(step for step in steps if step != "reward" or uses_reward_model)


def step_overrides(
    step: str, run_dir: Path, reward_from_sft: bool, with_reward: bool, dirs=None
) -> list[str]:
    """How each step reads the previous exports (``dirs``: the steps that run in
    pipeline.share_dir, and where)."""
    where = {"sft": run_dir / "sft", "reward": run_dir / "reward", **(dirs or {})}
    sft_model = where["sft"] / "model"
    if step == "reward":
        return [path_override("model.path", sft_model)] if reward_from_sft else []
    if step == "ppo":
        critic = where["reward"] / "model" if with_reward else sft_model
        return [
            path_override("actor.model.path", sft_model),
            path_override("critic.model.path", critic),
        ]
    if step == "dpo":  # the policy and its reference
        return [path_override("model.path", sft_model)]
    return []


def path_override(key: str, path: Path) -> str:
    """``key=path`` as Hydra parses it: quoted, since a sweep's job dirs are named like
    ``zero=stage3,lora=r8`` and an unquoted = or , in a value is a syntax error."""
    quote = '"' if "'" in str(path) else "'"
    return f"{key}={quote}{path}{quote}"


def compose_steps(
    config: Config, user_overrides: list[str], config_name: str, run_dir: Path
) -> dict[str, DictConfig]:
    """Each step's composed config, in pipeline order (``user_overrides``: the command line's,
    without ``step=`` and ``hydra.`` ones)."""

    def composed(step: str, extra: list[str]) -> DictConfig:
        overrides = [*user_overrides, f"step={step}", *extra]
        cfg = compose(config_name=config_name, overrides=overrides)
        share_command_line(cfg, overrides)  # as in a run of that step alone
        return cfg

    steps = config.pipeline.steps
    with_reward = "ppo" in steps and registry.uses_reward_model(composed("ppo", []))
    order = pipeline(steps, with_reward)
    out: dict[str, DictConfig] = {}
    dirs: dict[str, Path] = {}
    for step in order:
        extra = step_overrides(step, run_dir, config.pipeline.reward_from_sft, with_reward, dirs)
        out[step] = composed(step, extra)
        if step != order[-1] and config.pipeline.share_dir is not None:
            dirs[step] = shared_dir(step, out[step], dirs)
    return out


def shared_dir(step: str, cfg: DictConfig, earlier: dict[str, Path]) -> Path:
    """pipeline.share_dir/<step>-<hash of the keys ``step`` reads, as ``cfg`` sets them>; a path
    into an ``earlier`` shared step counts by that step's name, so moving the share dir keeps
    the names."""
    keys = flat(OmegaConf.to_container(cfg, resolve=True))
    unread = NOT_READ_BY[step]
    read = {k: v for k, v in keys.items() if not resumable(k) and k.split(".")[0] not in unread}
    for key, value in read.items():
        for where in earlier.values():
            if isinstance(value, str) and value.startswith(str(where)):
                read[key] = "<share_dir>/" + value[len(str(where.parent)) + 1 :]
    digest = hashlib.sha256(json.dumps(read, sort_keys=True, default=str).encode()).hexdigest()
    return Path(cfg.pipeline.share_dir).expanduser().absolute() / f"{step}-{digest[:12]}"


def shared_dirs(composed: dict[str, DictConfig]) -> dict[str, Path]:
    """Where the shared steps of ``composed`` (compose_steps' answer) run; none without a
    pipeline.share_dir. The last step is the run's own."""
    *before, _last = composed
    dirs: dict[str, Path] = {}
    for step in before:
        if composed[step].pipeline.share_dir is not None:
            dirs[step] = shared_dir(step, composed[step], dirs)
    return dirs


def exports(run_dir: Path, steps=tuple(EXPORTS), dirs=None) -> tuple[Path, ...]:
    """The directories ``steps`` export (later steps read them; ``dirs``: shared steps')."""
    where = dirs or {}
    return tuple(where.get(step, run_dir / step) / name for step in steps for name in EXPORTS[step])


def is_complete(step_dir: Path, step: str) -> bool:
    """A step is done when its summary and every export exist (exports are renamed into place
    only when complete, and the summary is written after them)."""
    exports = [step_dir / name / "config.json" for name in EXPORTS[step]]
    return (step_dir / "summary.json").exists() and all(p.exists() for p in exports)


def run(
    steps: dict[str, tuple[Config, dict]], info: RunInfo, shared: dict[str, Path] | None = None
) -> dict[str, float]:
    """Run the pipeline: ``steps`` maps each step to its typed and resolved config; ``shared``
    the steps that run in pipeline.share_dir, and where (see shared_dirs)."""
    if "ppo" in steps and "reward" not in steps:
        ppo = steps["ppo"][0].ppo
        why = (
            f"ppo.reward.function={ppo.reward.function} scores the answers"
            if ppo.reward.function
            else f"ppo.advantage.estimator={ppo.advantage.estimator} reads no task reward"
        )
        log.info("step=all: %s, so no reward model is trained (sft -> ppo)", why)
    if is_main():  # the pipeline's own config; each step writes its own in its directory
        write_resolved(info)
    group = info.group or info.run_dir.name
    summary: dict[str, float] = {}
    step_dirs, summaries, skipped = {}, {}, set()
    for step, (config, resolved) in steps.items():
        step_dir = step_dirs[step] = (shared or {}).get(step, info.run_dir / step)
        if step_dir != info.run_dir / step:
            _link(info.run_dir / step, step_dir)
        wait_s = config.pipeline.share_wait_s
        with _one_job_at_a_time(step_dir, step, step in (shared or {}), wait_s):
            if from_main(is_complete(step_dir, step)):  # rank 0's view decides for every rank
                log.info("step=all: %s is complete in %s, skipping it", step, step_dir)
                result = from_main(_written_summary(step_dir))
                skipped.add(step)
            else:
                log.info("step=all: running %s in %s", step, step_dir)
                step_info = RunInfo(step_dir, f"{info.run_name}/{step}", group, resolved)
                result = run_one(step, config, step_info, in_pipeline=True)
        summaries[step] = _written_summary(step_dir) or result
        summary.update({f"{step}/{k}": v for k, v in result.items()})
    if is_main():
        info.run_dir.mkdir(parents=True, exist_ok=True)
        plain_summary = {key: plain(value) for key, value in summary.items()}
        text = json.dumps(plain_summary, indent=2, sort_keys=True)
        (info.run_dir / "summary.json").write_text(text)
        wall = report.since_start()  # start-up included: what the user waited
        links = {step: info.run_dir / step for step in step_dirs}  # shared steps: their links
        model = list(steps.values())[-1][0].model.name
        ended = report.pipeline_report(info.run_dir, links, summaries, wall, skipped, model)
        report.write(info.run_dir, ended)
    return summary


def run_one(step: str, config: Config, info: RunInfo, in_pipeline: bool = False) -> dict:
    """Run one step's recipe in info.run_dir, then print its report (rank 0)."""
    result = RECIPES[step](config, info)
    if is_main():
        summary = _written_summary(info.run_dir) or result
        text = report.step_report(step, info.run_dir, summary, in_pipeline, config.model.name)
        report.write(info.run_dir, text)
    return result


def _written_summary(step_dir: Path) -> dict | None:
    """The step's summary.json (with the initial/... values the recipe's return leaves out)."""
    path = step_dir / "summary.json"
    return json.loads(path.read_text()) if is_main() and path.exists() else None


def _one_job_at_a_time(
    step_dir: Path, step: str, shared: bool, wait_s: float
) -> AbstractContextManager:
    """A shared step is trained by one job while the others sharing it wait (the jobs of a
    SLURM sweep run at once), then found complete; a killed holder's lock is released."""
    if not shared:
        return nullcontext()
    step_dir.mkdir(parents=True, exist_ok=True)
    return exclusive(step_dir / ".lock", f"{step} in {step_dir}", wait_s)


def _link(link: Path, step_dir: Path) -> None:
    """<run_dir>/<step> -> the shared step, so the run dir reads like one that trained it."""
    if not is_main():
        return
    if link.is_symlink() and link.resolve() != step_dir.resolve():
        link.unlink()  # the run dir's step was another config's (a run again with new values)
    if not link.is_symlink() and not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(step_dir, target_is_directory=True)

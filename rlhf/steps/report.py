"""What a run says when it ends: each step's headline metrics before -> after, its alarms, its
wall time, where its exports are and the command to run next; ``step=all`` the same for the whole
pipeline. Built from the step's summary (``summary.json``: final values and ``initial/...``),
printed by rank 0 and kept as ``report.txt`` in the run directory."""

from __future__ import annotations

import math
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any

from rlhf.config import TINY_MODEL

# per step: (metric, label), shown where the summary has it
# an environment's episodes (rlhf.rl.episodes); tool_calls is toy_tools' own metric
MULTI_TURN = (
    ("eval/turns", "model turns an episode, greedy"),
    ("eval/tool_calls", "tool calls an answer, greedy"),
    ("eval/tool_calls_sampled", "tool calls an answer, sampled"),
    ("eval/env_errors", "environment errors an episode, greedy"),
)
HEADLINES = {
    "sft": (
        ("eval/ppl", "held-out perplexity"),
        ("eval/gold_accuracy", "gold accuracy, greedy"),
    ),
    "reward": (
        ("eval/accuracy", "held-out pairs ranked right"),
        ("eval/ece", "calibration error of sigmoid(margin)"),
        ("eval/accuracy_chosen_longer", "pairs ranked right, chosen answer longer"),
        ("eval/accuracy_chosen_shorter", "pairs ranked right, chosen answer shorter"),
    ),
    "ppo": (
        ("eval/gold_accuracy", "gold accuracy, greedy"),
        ("eval/gold_accuracy_sampled", "gold accuracy, sampled"),
        ("eval/gold_correct", "right value, greedy"),
        ("eval/gold_correct_sampled", "right value, sampled"),
        ("eval/gold_clean", "clean form, greedy"),
        ("eval/reward", "reward, held-out prompts"),
        ("eval/kl", "KL to the reference, nats an answer"),
        *MULTI_TURN,
    ),
    "dpo": (
        ("eval/accuracy", "implicit-reward accuracy, held out"),
        ("eval/gold_accuracy", "gold accuracy, greedy"),
        ("eval/gold_accuracy_sampled", "gold accuracy, sampled"),
        ("eval/gold_correct", "right value, greedy"),
        ("eval/kl", "KL to the reference, nats an answer"),
        *MULTI_TURN,
    ),
}
# the exports a step writes, in the order they are listed
EXPORTS = ("model", "actor", "critic", "actor_ema")
EVAL_SHARE_ALARM = 0.25  # evaluation's share of a step's wall time worth a word
EVAL_KEYS = {
    "sft": "data.max_eval_rows, sft.gold_eval_prompts, step.eval_interval",
    "reward": "data.max_eval_rows, reward.gold_eval_prompts, step.eval_interval",
    "ppo": "ppo.eval.prompts, ppo.eval.samples, step.eval_interval, step.eval_at_start=false",
    "dpo": "ppo.eval.prompts, ppo.eval.samples, data.max_eval_rows, step.eval_at_start=false",
}


def headline_rows(step: str, summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, 'before -> after (change)') for each headline metric ``summary`` holds."""
    rows = []
    for key, label in HEADLINES.get(step, ()):
        after = _number(summary.get(key))
        if after is None:
            continue
        before = _number(summary.get(f"initial/{key}"))
        if before is None:
            rows.append((label, _show(after)))
        else:
            change = _show(after - before)
            sign = "+" if not change.startswith("-") else ""
            rows.append((label, f"{_show(before)} -> {_show(after)} ({sign}{change})"))
    split = iteration_split(summary)
    return [*rows, split] if split is not None else rows


SPLIT = ("generate", "score", "update", "sync", "other")  # a PPO iteration's parts (perf/<part>_s)


def iteration_split(summary: dict[str, Any]) -> tuple[str, str] | None:
    """('time an iteration', 'S s: generate P%, ...') from an RL step's mean parts."""
    parts = [_number(summary.get(f"perf/{part}_s")) for part in SPLIT]
    if any(part is None for part in parts) or sum(parts) <= 0:
        return None
    total = sum(parts)
    shares = ", ".join(f"{name} {part / total:.0%}" for name, part in zip(SPLIT, parts))
    return ("time an iteration", f"{_show(total)} s: {shares}")


def alarms(step: str, summary: dict[str, Any]) -> list[str]:
    """What went wrong or looks suspicious, one line each (none: an empty list)."""
    checks = (_hacking, _skipped, _unterminated, _worse, _length_bias, _eval_share)
    return [found for check in checks if (found := check(step, summary))]


def _hacking(step: str, summary: dict[str, Any]) -> str | None:
    if hacking := _number(summary.get("eval/hacking_warnings")):
        return (
            f"possible reward hacking, {int(hacking)} time(s): the held-out reward rose while "
            "gold accuracy (or, without a checker, the answer length) moved the wrong way; see "
            "the log's warnings and eval_samples.jsonl"
        )
    return None


def _skipped(step: str, summary: dict[str, Any]) -> str | None:
    skipped = _number(summary.get("ppo/skipped_updates")) or _number(
        summary.get("train/skipped_steps")
    )
    return f"{int(skipped)} update(s) skipped for a non-finite loss" if skipped else None


def _unterminated(step: str, summary: dict[str, Any]) -> str | None:
    share = _number(summary.get("ppo/unterminated"))
    if share is None or share < 0.5:
        return None
    return (
        f"{share:.0%} of the last rollout's answers were cut at ppo.rollout.max_new_tokens (a "
        "reward scores them unfinished; a reward model at a token it never saw last)"
    )


def _worse(step: str, summary: dict[str, Any]) -> str | None:
    """The step's own measure moved the wrong way (or, for a reward model, stayed at chance)."""
    key, worse = {
        "sft": ("eval/ppl", lambda before, after: after > before),
        "ppo": ("eval/gold_correct", lambda before, after: after < before - 0.05),
        "dpo": ("eval/gold_correct", lambda before, after: after < before - 0.05),
    }.get(step, (None, None))
    if step == "reward":
        accuracy = _number(summary.get("eval/accuracy"))
        if accuracy is not None and accuracy < 0.6:
            return f"the reward model ranks held-out pairs near chance ({accuracy:.2f})"
        return None
    after, before = _number(summary.get(key)), _number(summary.get(f"initial/{key}"))
    if key is None or after is None or before is None or not worse(before, after):
        return None
    return f"{key} moved the wrong way: {_show(before)} -> {_show(after)}"


LENGTH_BIAS_ALARM = 0.2  # accuracy gap, chosen longer vs shorter, worth a word


def _length_bias(step: str, summary: dict[str, Any]) -> str | None:
    """A reward model right far more often when the chosen answer is the longer one scores
    length, which PPO then learns to produce."""
    longer = _number(summary.get("eval/accuracy_chosen_longer"))
    shorter = _number(summary.get("eval/accuracy_chosen_shorter"))
    if step != "reward" or longer is None or shorter is None:
        return None
    if longer - shorter <= LENGTH_BIAS_ALARM:
        return None
    return (
        f"the reward model prefers length: it ranks {longer:.2f} of the pairs right where the "
        f"chosen answer is the longer one, {shorter:.2f} where it is the shorter"
    )


def _eval_share(step: str, summary: dict[str, Any]) -> str | None:
    share = _number(summary.get("perf/eval_share"))
    if share is None or share <= EVAL_SHARE_ALARM or step not in EVAL_KEYS:
        return None
    return (
        f"evaluation took {share:.0%} of this step's wall time (a short run evaluates "
        f"relatively more): lower {EVAL_KEYS[step]}"
    )


def step_report(
    step: str, run_dir: Path, summary: dict[str, Any], in_pipeline: bool, model: str = TINY_MODEL
) -> str:
    """The report of one step that ran in ``run_dir`` (``in_pipeline``: a step of step=all,
    whose next step follows: no next commands; ``model``: the run's model option)."""
    wall = _duration(_number(summary.get("perf/wall_s")))
    if not in_pipeline:  # start-up (imports, the process group) is part of what a user waited
        wall = f"{_duration(since_start())} ({wall} in the step itself)"
    lines = [f"rlhf: step={step} finished in {wall}: {_path(run_dir)}"]
    rows = headline_rows(step, summary)
    width = max((len(label) for label, _ in rows), default=0)
    lines += [f"  {label.ljust(width)}  {value}" for label, value in rows]
    lines += _alarm_lines(alarms(step, summary))
    exports = [run_dir / name for name in EXPORTS if (run_dir / name / "config.json").exists()]
    if exports:
        lines.append("  exports: " + ", ".join(_path(p) for p in exports))
    if not in_pipeline:
        lines += _next_lines(next_commands(step, run_dir, exports, model))
    return "\n".join(lines)


def pipeline_report(
    run_dir: Path,
    step_dirs: dict[str, Path],
    summaries: dict[str, dict[str, Any]],
    wall_s: float,
    skipped: set[str],
    model: str = TINY_MODEL,
) -> str:
    """The report of ``step=all``: each step's headlines, alarms and exports, then the next
    commands for the last step's model. ``skipped``: steps found complete, not run now;
    ``model``: the run's model option."""
    order = " -> ".join(step_dirs)
    lines = [f"rlhf: step=all ({order}) finished in {_duration(wall_s)}: {_path(run_dir)}"]
    rows = {step: headline_rows(step, summaries[step]) for step in step_dirs}
    width = max((len(label) for r in rows.values() for label, _ in r), default=0)
    for step, step_rows in rows.items():
        wall = _number(summaries[step].get("perf/wall_s"))
        when = "done earlier" if step in skipped else _duration(wall)
        lines.append(f"  {step} ({when})")
        lines += [f"    {label.ljust(width)}  {value}" for label, value in step_rows]
    lines += _alarm_lines(
        [f"{step}: {alarm}" for step in step_dirs for alarm in alarms(step, summaries[step])]
    )
    exports = [
        step_dir / name
        for step_dir in step_dirs.values()
        for name in EXPORTS
        if (step_dir / name / "config.json").exists()
    ]
    if exports:
        lines.append("  exports: " + ", ".join(_path(p) for p in exports))
    last = list(step_dirs)[-1]
    final = [p for p in exports if p.parent == step_dirs[last]]
    commands = next_commands(last, step_dirs[last], final, model)
    commands = [c for c in commands if "rlhf.cli.compare" not in c[0]]
    commands.append(
        (f"python -m rlhf.cli.compare {_arg(run_dir)} OTHER_RUN", "compare with another run")
    )
    lines += _next_lines(commands)
    return "\n".join(lines)


def next_commands(
    step: str, run_dir: Path, exports: list[Path], model: str = TINY_MODEL
) -> list[tuple[str, str]]:
    """(command, what it does) to run after ``step``, quoted for the shell (and for Hydra's
    override grammar) so that they paste whatever the paths hold. A training command names
    ``model`` unless it is the default: its option chooses the step's tuning."""
    names = {p.name: p for p in exports}
    rlhf = "python -m rlhf" if model == TINY_MODEL else f"python -m rlhf model={model}"
    out = []
    if step in ("sft", "dpo") and "model" in names:
        out.append((f"python -m rlhf.cli.chat --path {_arg(names['model'])}", "talk to the model"))
    if step == "sft" and "model" in names:
        out.append(
            (
                f"{rlhf} step=reward {_override('model.path', names['model'])}",
                "train a reward model from it (or step=dpo model.path=...)",
            )
        )
    if step == "reward" and "model" in names:
        out.append(
            (
                f"{rlhf} step=ppo actor.model.path=SFT_RUN/model "
                f"{_override('critic.model.path', names['model'])}",
                "PPO against this reward model",
            )
        )
        out.append(
            (
                f"python -m rlhf.cli.evaluate reward --path {_arg(names['model'])} data=OTHER",
                "its eval table on other preference data",
            )
        )
    if step == "ppo" and "actor" in names:
        actor = _arg(names["actor"])
        out.append((f"python -m rlhf.cli.chat --path {actor}", "talk to the trained actor"))
    out.append(
        (f"python -m rlhf.cli.compare {_arg(run_dir)} OTHER_RUN", "compare with another run")
    )
    return out


def _arg(path: Path) -> str:
    return shlex.quote(_path(path))


# what Hydra reads in an override's value without quotes (others: a sweep's comma, brackets...)
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_./~+-]+")


def _override(key: str, path: Path) -> str:
    """``key=path`` as one shell word that Hydra parses back to ``path``."""
    value = _path(path)
    if not _PLAIN_VALUE.fullmatch(value):
        value = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return shlex.quote(f"{key}={value}")


def write(run_dir: Path, text: str) -> None:
    """Print ``text`` and keep it as run_dir/report.txt (call on rank 0)."""
    print(f"\n{text}\n", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "report.txt").write_text(text + "\n")


def since_start() -> float:
    """Seconds since this process started (the command, as the user waited for it)."""
    import psutil  # DeepSpeed's dependency

    return time.time() - psutil.Process().create_time()


def _alarm_lines(found: list[str]) -> list[str]:
    if not found:
        return ["  alarms: none"]
    return ["  alarms:", *(f"    ! {alarm}" for alarm in found)]


def _next_lines(commands: list[tuple[str, str]]) -> list[str]:
    width = max(len(c) for c, _ in commands)
    return ["  next:", *(f"    {c.ljust(width)}  # {what}" for c, what in commands)]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _show(value: float) -> str:
    """3 significant digits, never in exponent form (1291, 0.83, 0.0011)."""
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def _path(path: Path) -> str:
    """``path`` relative to the working directory when it is below it (a command to paste)."""
    try:
        return (
            os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd()) else str(path)
        )
    except ValueError:
        return str(path)

"""A TensorBoard run that TensorBoard's HParams tab compares: the job's sweep axes as its
hyperparameters (the session start), every metric as a scalar, the headline values at its end,
and the resolved config (resolved.yaml) as text.

No experiment summary is written: with none, TensorBoard builds the experiment from every
session start under its log dir (the union of the jobs' axes) and the metrics from every
scalar tag, so ``tensorboard --logdir SWEEP_DIR`` compares jobs that each only know their own
overrides. One job writing its own experiment summary would hide the others' axes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf.tracking.wandb_run import HEADLINE, changed_keys, is_untagged, job_overrides


def session_hparams(changed: dict[str, str], job_type: str) -> dict[str, str | float | bool]:
    """``step`` and each changed key but where the job writes or how it is tracked, typed as
    HParams types them: numbers (a learning-rate axis sorts and plots as one), true / false,
    else the text."""
    axes = {k: hparam_value(v) for k, v in changed.items() if k != "step" and not is_untagged(k)}
    return {"step": job_type, **axes}


def hparam_value(text: str) -> str | float | bool:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return float(text)
    except ValueError:
        return text


CONFIG_TAG = "config/resolved"  # the run's resolved.yaml, in TensorBoard's Text tab


def config_text(config_yaml: str) -> str:
    """resolved.yaml as a Markdown code block (TensorBoard renders text as Markdown)."""
    return "\n".join("    " + line for line in config_yaml.splitlines())


class TensorBoardRun:
    """A SummaryWriter on ``run_dir/tensorboard`` whose first event is the session start.
    ``purge_step``: TensorBoard drops the events an earlier writer in the run dir logged at or
    after it (a killed run's steps after the checkpoint a resume continues from)."""

    def __init__(
        self,
        run_dir: Path,
        job_type: str,
        overrides: list[str] | None = None,
        purge_step: int | None = None,
        config_yaml: str | None = None,
    ):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        log_dir = str(Path(run_dir) / "tensorboard")
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)
        changed = changed_keys(job_overrides() if overrides is None else overrides)
        self.hparams = session_hparams(changed, job_type)
        _, session_start, self._session_end = hparams(self.hparams, {})
        self.writer.file_writer.add_summary(session_start)
        if config_yaml is not None and not purge_step:  # a resumed run's is already there
            self.writer.add_text(CONFIG_TAG, config_text(config_yaml), 0)
        self.logged: set[str] = set()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if value is not None:
                self.writer.add_scalar(key, value, step)
                self.logged.add(key)

    def close(self, summary: dict[str, Any]) -> None:
        """The headline values only the summary holds (throughput, peak memory) as scalars at
        the last step, so the HParams table has them, then the session's end."""
        step = int(summary.get("step", 0) or 0)
        for key in HEADLINE:
            value = summary.get(key)
            if key not in self.logged and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.file_writer.add_summary(self._session_end)
        self.writer.close()

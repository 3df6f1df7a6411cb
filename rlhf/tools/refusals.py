"""A sweep whose every job would be refused alike (the hub offline, a missing file, a bad value
on the command line) is refused once, before any job starts, instead of once a job.

A job's refusal is what ``python -m rlhf`` would answer its config with before building anything:
the checks rlhf.__main__ runs on a run's config, in this process, on the job's composed config.
The run directory's own checks (resuming another config's checkpoints) are left to each job:
every job has its own directory. Hydra imports the launchers while scanning plugins: the checks
are imported when a sweep launches.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from omegaconf import DictConfig, open_dict


def common_refusal(configs: Sequence[DictConfig | None], on_this_machine: bool) -> str | None:
    """The message every job of ``configs`` (composed sweep configs; None: one that does not
    compose) would be refused with, if it is the same for all; else None. The first job is
    checked; the others only when it is refused, so a sweep that starts pays for one check.
    ``on_this_machine``: the jobs run here (rlhf's launcher), so the checks that depend on the
    machine (the hub, vLLM, W&B's login, DeepSpeed's build lock) count; SLURM's jobs run
    elsewhere."""
    if not configs or any(cfg is None for cfg in configs):
        return None  # a job that does not compose fails with Hydra's own message in its log
    first = job_refusal(configs[0], on_this_machine)
    if first is None or any(job_refusal(c, on_this_machine) != first for c in configs[1:]):
        return None
    if len(configs) == 1:
        return first
    return f"the sweep's {len(configs)} jobs would all be refused (none was started): {first}"


def job_refusal(sweep_config: DictConfig, on_this_machine: bool) -> str | None:
    """What ``python -m rlhf`` would refuse this job's config with (None: it would start), as
    rlhf.__main__'s task function checks it: the keys PPO's models cannot read, the schema,
    paths and data, then (a single step: step=all checks each step as it composes them) the
    models and what the machine must have."""
    from hydra.core.hydra_config import HydraConfig

    from rlhf.checks.lengths import fit_lengths, positions
    from rlhf.checks.validate import check_launch, raise_problems, validated
    from rlhf.config import ConfigError
    from rlhf.config.sharing import share_command_line, unread_problems

    overrides = list(sweep_config.hydra.overrides.task)
    cfg = copy.deepcopy(sweep_config)  # the job's config, as Hydra's run_job hands it over
    with open_dict(cfg):
        del cfg["hydra"]
    hydra_config = HydraConfig.instance()
    previous = hydra_config.cfg
    hydra_config.set_config(sweep_config)  # the job's ${hydra:...} values resolve
    try:
        share_command_line(cfg, overrides)
        raise_problems(unread_problems(cfg.step.name, overrides), "step=ppo")
        config = validated(cfg)
        fit_lengths(cfg, config, positions(config))
        if on_this_machine and config.step.name != "all":
            check_launch(config)
    except ConfigError as err:
        return str(err)
    finally:
        hydra_config.cfg = previous
    return None

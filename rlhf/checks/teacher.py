"""algo=opd's teacher, checked before any model is built: one there is, at a path that exists,
reading the student's tokens (a tokenizer whose vocabulary or special tokens differ would score
other text than the student wrote), and not the student's own start (a warning: the gap is zero
at the first iteration and grows only as the student moves)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rlhf import registry
from rlhf.config import Config

log = logging.getLogger(__name__)


def teacher_problems(config: Config) -> list[tuple[str, object, str]]:
    """(key, value, accepted) for step 3's teacher and opd.* keys (config only)."""
    if config.step.name not in ("ppo", "all") or not registry.uses_teacher(config.ppo):
        return []
    out: list[tuple[str, object, str]] = []
    if config.teacher.model.path is None:
        accepted = (
            "the teacher's weights with algo=opd: an export (RUN/ppo/actor of a trained run, "
            "RUN/sft/model) or a hub id"
        )
        out.append(("teacher.model.path", None, accepted))
    if config.opd.loss == "topk" and config.ppo.rollout.logprobs:
        accepted = (
            "null or false with opd.loss=topk (it needs the actor's distributions, which the "
            "sampler does not keep)"
        )
        out.append(("ppo.rollout.logprobs", True, accepted))
    samples = config.ppo.rollout.samples_per_prompt
    if config.opd.task_reward and samples < 2:
        accepted = "an integer >= 2 with opd.task_reward=true (its advantages are group-normalised)"
        out.append(("ppo.rollout.samples_per_prompt", samples, accepted))
    return out


def teacher_launch_problems(config: Config) -> list[str]:
    """A teacher whose tokenizer is not the student's, where both can be read now (a student
    that an earlier step of step=all writes is checked when PPO loads it); warns when the
    teacher is the student's own start."""
    teacher, actor = config.teacher.model, config.actor.model
    if config.step.name != "ppo" or not registry.uses_teacher(config.ppo) or teacher.path is None:
        return []
    if not _readable(teacher.path) or (actor.path is not None and not _readable(actor.path)):
        return []
    if actor.path is not None and _same_dir(actor.path, teacher.path):
        log.warning(
            "teacher.model.path=%s is the student's own start (actor.model.path): the teacher's "
            "signal is zero at the first iteration and grows only as the student moves away",
            teacher.path,
        )
    from rlhf.modeling.loading import load_tokenizer, tokenizer_fingerprint

    student = tokenizer_fingerprint(load_tokenizer(actor, actor.path))
    if tokenizer_fingerprint(load_tokenizer(teacher, teacher.path)) == student:
        return []
    return [
        f"teacher.model.path={teacher.path}: its tokenizer (vocabulary or special tokens) "
        f"differs from the student's ({actor.path or 'the embedded tokenizer'}); the teacher "
        "scores the student's tokens, so both must share one tokenizer"
    ]


def _readable(path: str) -> bool:
    return os.path.isdir(os.path.expanduser(path))


def _same_dir(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()

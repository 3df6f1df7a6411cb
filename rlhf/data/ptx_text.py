"""Where PPO's PTX loss reads its unsupervised text (ppo.ptx.source, or the task of the PPO
prompts) and the texts themselves: a file's lines or a task's corpus. The launch checks ask
:func:`ptx_source` before anything runs; rlhf.rl.ptx tokenizes :func:`ptx_texts`."""

from __future__ import annotations

import json
import os

from rlhf import tasks
from rlhf.config import Config
from rlhf.data.sources import source_task


def ptx_source(cfg: Config) -> str | None:
    """Where PTX reads its text: ppo.ptx.source, or (null) the task every PPO prompt source
    comes from (data=toy: the toy task's statements); None when there is no such task, since
    real data's text is not the toy's (a file must be named)."""
    if cfg.ppo.ptx.source is not None:
        return cfg.ppo.ptx.source
    names = cfg.ppo.rollout.prompt_sources or list(cfg.data.sources)
    found = {source_task(cfg.data.sources[name]) for name in names}
    return found.pop() if len(found) == 1 and None not in found else None


def ptx_texts(cfg: Config) -> list[str]:
    """Up to ppo.ptx.rows texts from :func:`ptx_source`: a .txt file's lines, a .jsonl file's
    ``text`` fields, or a task's corpus."""
    source = ptx_source(cfg)
    if os.path.isfile(source):
        return _read_texts(source, cfg.ppo.ptx.rows)
    return tasks.corpus(tasks.resolve(source), cfg.ppo.ptx.rows, cfg.data.seed)


def _read_texts(path: str, limit: int) -> list[str]:
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    if path.endswith(".jsonl"):
        lines = [json.loads(line)["text"] for line in lines]
    return lines[:limit]

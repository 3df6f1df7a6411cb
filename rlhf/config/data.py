"""``data``: the raw datasets and how they become each step's rows (conf/data/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from rlhf.config.seeds import seed_problems

OVERLONG_PROMPTS = ("truncate", "skip", "error")


@dataclass
class SourceConfig:
    """One raw dataset: a hub id or a local file, mapped to (prompt, chosen, rejected)."""

    adapter: str = (
        MISSING  # rm-static | full-hh-rlhf | ... | local | toy | task (rlhf.data.sources)
    )
    path: str | None = None  # hub id (adapter's default if null) or local file / save_to_disk dir
    subset: str | None = None  # the hub dataset's config name
    train_split: str = "train"
    # null: a local copy's one split besides train_split (data/test-*.parquet), else the eval
    # rows are carved out of train_split
    eval_split: str | None = "test"
    # a separate local file (or directory) whose rows are the eval rows; eval_split then null
    eval_path: str | None = None
    eval_fraction: float = 0.1  # share of train_split used for eval when eval_split is null
    columns: dict[str, str] = field(default_factory=dict)  # local: prompt/chosen/rejected -> column
    prompt_template: str = "{prompt}"  # local: how a raw prompt becomes the model's prompt
    num_rows: int = 0  # toy: rows generated for train (eval gets a tenth); others: cap, 0 = all
    seed: int = 1234  # toy: generator seed
    num_ranked: int = 0  # toy: add a `responses` column of K answers ranked best to worst
    # the task whose checker grades answers to these prompts (eval/gold_accuracy): toy or
    # package.module:attribute (rlhf.tasks); adapter task: the task that generates the rows
    task: str | None = None


def checker_task(source: Any) -> str | None:
    """The task whose checker grades answers to ``source``'s prompts (adapter toy: toy)."""
    return source.task or ("toy" if source.adapter == "toy" else None)


@dataclass
class DataConfig:
    """The data of every step. Several sources blend; each is split into disjoint phases."""

    # the raw datasets by name (a data=... option sets them; several blend)
    sources: dict[str, SourceConfig] = field(default_factory=dict)
    phase_split: list[int] = field(default_factory=lambda: [2, 4, 4])  # sft, reward, ppo shares
    max_seq_len: int = 512  # prompt + answer tokens (SFT and reward); data=toy: 64
    max_prompt_len: int = 256  # prompt tokens, left-truncated (PPO prompts; generation); toy: 32
    # a prompt longer than max_prompt_len: truncate (keep BOS + its end) | skip the row | error
    overlong_prompts: str = "truncate"
    max_eval_rows: int = 0  # cap on eval rows per phase; 0 = all (data=toy: 1000)
    seed: int = 1234  # which rows: the phase split and the eval rows kept (seed orders them)
    cache_dir: str = "~/.cache/rlhf/data"  # tokenised data, keyed on everything that changes it
    # sort each global batch by length: like rows share a micro batch, ranks get like tokens
    group_by_length: bool = True
    # pad every SFT/reward sequence to max_seq_len and PPO prompts to max_prompt_len (DeepSpeed-Chat)
    pad_to_max_len: bool = False

    def problems(self) -> list[tuple[str, Any, str]]:
        out = seed_problems("seed", self.seed)
        if not self.sources:
            out.append(
                ("sources", "{}", "at least one source (data=toy, data=[rm-static,shp], ...)")
            )
        if (
            len(self.phase_split) != 3
            or any(w < 0 for w in self.phase_split)
            or not any(self.phase_split)
        ):
            out.append(
                (
                    "phase_split",
                    list(self.phase_split),
                    "three non-negative weights, not all zero, e.g. [2,4,4]",
                )
            )
        if self.max_seq_len < 2:
            out.append(("max_seq_len", self.max_seq_len, "an integer >= 2"))
        if not 1 <= self.max_prompt_len < self.max_seq_len:
            out.append(("max_prompt_len", self.max_prompt_len, "1 <= max_prompt_len < max_seq_len"))
        if self.max_eval_rows < 0:
            out.append(("max_eval_rows", self.max_eval_rows, "an integer >= 0"))
        if self.overlong_prompts not in OVERLONG_PROMPTS:
            out.append(
                ("overlong_prompts", self.overlong_prompts, f"one of {', '.join(OVERLONG_PROMPTS)}")
            )
        return out

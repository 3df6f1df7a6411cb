"""Raw sources -> one phase's tokenised rows, blended over sources and cached on disk.

Every phase uses the same tokenised form, so the reward model sees exactly the token sequences
PPO will score: ``prompt_ids`` (BOS + prompt, left-truncated to max_prompt_len) and the answers
``chosen_ids`` / ``rejected_ids`` (answer tokens + end-of-text, cut so prompt + answer fit in
max_seq_len), and ``response_ids``, the demonstration SFT imitates, when a source has one that
differs from the chosen answer (a task's uneven demonstrations). An environment's rows add
``chosen_obs_mask`` (etc.), 1 on its observations' tokens (:mod:`rlhf.data.observed_tokens`).
Prompt and answer are tokenised separately, because PPO generates after the prompt's own
tokens and the reward model must see that same split.

The cache lives under ``data.cache_dir`` only, never beside a user's data. Rank 0 computes its
key (the local files' stamps and a hash of the rows a task generates included) and sends it to
the other ranks, so every rank reads the entry rank 0 built. Each entry keeps the lines its
build logged (rows read, skipped and kept per source and split, where the eval rows came from,
warnings about the data), and a run that finds the entry logs them again: every run's log says
what its data is.

Bad data fails here, before any model is built, with a :class:`SourceError` (exit status 2):
a source that gives a phase no usable rows, and (``data.overlong_prompts=error``) a prompt
longer than ``data.max_prompt_len``. ``truncate`` (the default) and ``skip`` log how many
prompts they cut or dropped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import datasets

from rlhf import tasks
from rlhf.config import ConfigError, DataConfig
from rlhf.data import local
from rlhf.data.observed_tokens import ANSWERS, answer_masks, mask_column, spans_column
from rlhf.data.sources import (
    SKIP_REASON,
    SourceError,
    describe,
    eval_origin,
    generated_rows_hash,
    load_source,
    source_task,
)
from rlhf.data.split import phase_indices
from rlhf.modeling.loading import tokenizer_fingerprint
from rlhf.runtime.dist import barrier, from_main, is_main, world_size
from rlhf.runtime.files import publish_dir

log = logging.getLogger(__name__)

PHASES = ("sft", "reward", "ppo")
FORMAT_VERSION = 4  # bump when the tokenised layout changes (4: observation masks)
_SOURCE = "_source"  # temporary column: which source a row came from, for messages
TASK = "task"  # the task whose checker grades answers to the row's prompt ("": none)
SOURCE = "source"  # the data.sources entry a row came from (a reward model's accuracy per source)
# columns a row keeps through tokenisation as they are: the task's kind of rejected answer
KEPT = (TASK, SOURCE, "rejected_kind")
_OVERLONG = "_overlong"  # temporary column: the prompt was longer than max_prompt_len
LOG_FILE = "rlhf_log.json"  # in a cache entry: the lines its build logged, as [level, text]


def phase_dataset(
    data: DataConfig, phase: str, split: str, tokenizer, end_of_text_id: int
) -> datasets.Dataset:
    """Tokenised rows of ``phase`` ('sft' | 'reward' | 'ppo') and ``split`` ('train' | 'eval').
    Built once by rank 0 into a directory named by a hash of everything that changes it; the
    other ranks (and later runs) load it."""
    key = from_main(cache_key(data, phase, split, tokenizer, end_of_text_id) if is_main() else None)
    path = Path(data.cache_dir).expanduser() / f"{phase}-{split}-{key[:20]}"
    failure = None
    if is_main() and not (path / "dataset_info.json").exists():
        try:
            built, lines = _build(data, phase, split, tokenizer, end_of_text_id)
        except ConfigError as err:
            failure = err
        else:
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            built.save_to_disk(str(tmp))
            (tmp / LOG_FILE).write_text(json.dumps(lines))
            publish_dir(tmp, path)
    _raise_on_every_rank(failure)
    barrier()
    rows = datasets.load_from_disk(str(path))
    if is_main():
        _log_lines(path / LOG_FILE)
        log.info("data %s/%s: %d tokenised rows in %s", phase, split, len(rows), path)
    return rows


def _log_lines(file: Path) -> None:
    """The lines an entry's build logged (an entry from an older version has none)."""
    lines = json.loads(file.read_text()) if file.exists() else []
    for level, text in lines:
        log.log(logging.WARNING if level == "warning" else logging.INFO, "%s", text)


def _raise_on_every_rank(failure: ConfigError | None) -> None:
    """Rank 0 builds alone: its data error is raised on every rank, so all of them exit with
    the message instead of the others failing in the barrier."""
    import torch.distributed

    if world_size() > 1 and torch.distributed.is_initialized():
        message = [str(failure) if failure is not None else None]
        torch.distributed.broadcast_object_list(message, src=0)
        if failure is None and message[0] is not None:
            failure = SourceError(message[0])
    if failure is not None:
        raise failure


def cache_key(data: DataConfig, phase: str, split: str, tokenizer, end_of_text_id: int) -> str:
    # what each source's rows come from: a local file (its size and mtime) or, for a task that
    # generates them, the version of its generator and a hash of the rows it generates (a
    # version left as it was after an edit of rows() would otherwise serve the old rows)
    sources = {
        name: {
            **dataclasses.asdict(src),
            "file": _file_stamp(src.path),
            "generator": generator_version(src),
            "rows": generated_rows_hash(src, split),
        }
        for name, src in data.sources.items()
    }
    payload = {
        "version": FORMAT_VERSION,
        "sources": sources,
        "phase": phase,
        "split": split,
        "phase_split": list(data.phase_split),
        "seed": data.seed,
        "max_seq_len": data.max_seq_len,
        "max_prompt_len": data.max_prompt_len,
        "overlong_prompts": data.overlong_prompts,
        "max_eval_rows": data.max_eval_rows if split == "eval" else 0,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "end_of_text_id": end_of_text_id,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def generator_version(source) -> int | None:
    """The version of the task that generates ``source``'s rows (None: rows from files)."""
    if source.adapter not in ("toy", "task"):
        return None
    return tasks.resolve(source_task(source)).version


def _file_stamp(path: str | None) -> list | None:
    """Size and mtime of a local source's files, so an edited file is tokenised again."""
    return local.stamp(path)


def _build(
    data: DataConfig, phase: str, split: str, tokenizer, end_of_text_id: int
) -> tuple[datasets.Dataset, list[tuple[str, str]]]:
    """The tokenised rows, and the lines to log about them ([level, text])."""
    parts, lines = [], []
    for name, source in data.sources.items():
        loaded = load_source(source, split, data.seed, name)
        indices = phase_indices(len(loaded.rows), data.phase_split, PHASES.index(phase), data.seed)
        pairs = loaded.rows.select(indices)
        lines += _source_lines(name, source, split, phase, loaded, len(pairs))
        if len(pairs) == 0:
            raise SourceError(no_rows_message(source, phase, split, loaded, data))
        pairs = pairs.add_column(_SOURCE, [describe(source)] * len(pairs))
        pairs = pairs.add_column(SOURCE, [name] * len(pairs))
        parts.append(pairs.add_column(TASK, [source_task(source) or ""] * len(pairs)))
    rows = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if split == "eval" and data.max_eval_rows and len(rows) > data.max_eval_rows:
        rows = rows.shuffle(seed=data.seed).select(range(data.max_eval_rows))
    out, overlong = _tokenize(data, phase, split, rows, tokenizer, end_of_text_id)
    if overlong:
        lines.append(("info", overlong))
    return out, lines


def _source_lines(name, source, split, phase, loaded, kept: int) -> list[tuple[str, str]]:
    """What the log says of one source's split: where its rows come from, how many were read,
    skipped and kept (all for the same split), notes and warnings."""
    origin = eval_origin(source) if split == "eval" else f"its {source.train_split} split"
    counts = (
        f"data {name}/{split} ({origin}): {loaded.read} rows read, {loaded.skipped} skipped "
        f"({SKIP_REASON}), {len(loaded.rows)} usable, {kept} of them for {phase}"
    )
    lines = [("info", counts)]
    lines += [("info", f"data {name}/{split}: {note}") for note in loaded.notes]
    return lines + [("warning", f"data {name}/{split}: {text}") for text in loaded.warnings]


def _tokenize(data: DataConfig, phase: str, split: str, rows, tokenizer, end_of_text_id: int):
    """Tokenised rows, and the over-long prompts' log line (None when there were none)."""
    tokenize = _Tokenize(
        tokenizer, end_of_text_id, data.max_prompt_len, data.max_seq_len, data.overlong_prompts
    )
    out = rows.map(tokenize, batched=True, remove_columns=rows.column_names)
    overlong = len(rows) - len(out) if data.overlong_prompts == "skip" else sum(out[_OVERLONG])
    if len(out) == 0:
        raise SourceError(
            f"data.overlong_prompts='skip': all {len(rows)} {phase}/{split} prompts are longer "
            f"than data.max_prompt_len={data.max_prompt_len} tokens"
        )
    line = None
    if overlong:
        done = "skipped" if data.overlong_prompts == "skip" else "left-truncated"
        line = (
            f"data {phase}/{split}: {overlong} of {len(rows)} prompts longer than "
            f"data.max_prompt_len={data.max_prompt_len} tokens {done} "
            f"(data.overlong_prompts={data.overlong_prompts})"
        )
    return out.remove_columns(_OVERLONG), line


def no_rows_message(source, phase: str, split: str, loaded, data: DataConfig) -> str:
    """Why ``source`` gives the ``phase`` phase's ``split`` split no rows."""
    usable, dropped = len(loaded.rows), loaded.skipped
    if usable + dropped == 0:
        why = "it has no rows (0 skipped)"
    elif usable == 0:
        why = f"all {dropped} rows were skipped ({SKIP_REASON})"
    else:
        why = (
            f"its {usable} usable rows ({dropped} skipped) leave none for {phase} with "
            f"data.phase_split={list(data.phase_split)}"
        )
    notes = "".join(f"; {note}" for note in loaded.notes)
    return (
        f"source {describe(source)}: no usable rows for the {phase} phase's {split} split: "
        f"{why}{notes}"
    )


class _Tokenize:
    """Batched map function (a class so ``datasets`` can fingerprint it). Reads ``prompt``,
    ``chosen``, ``rejected`` (and ``responses``), the source and the task columns; writes
    ``prompt``, the token ids, the task and the over-long flag."""

    def __init__(
        self,
        tokenizer,
        end_of_text_id: int,
        max_prompt_len: int,
        max_seq_len: int,
        overlong: str = "truncate",
    ):
        self.tokenizer = tokenizer
        self.eot = end_of_text_id
        self.max_prompt_len = max_prompt_len
        self.max_seq_len = max_seq_len
        self.overlong = overlong

    def truncate(self, ids: list[int]) -> list[int]:
        """Keep BOS and the end of the prompt, where the question is."""
        if len(ids) <= self.max_prompt_len:
            return ids
        bos = self.tokenizer.bos_token_id
        head = [bos] if ids[0] == bos else []
        return head + ids[len(ids) - self.max_prompt_len + len(head) :]

    def prompt(self, texts: list[str]) -> list[list[int]]:
        return [self.truncate(ids) for ids in self.tokenizer(texts)["input_ids"]]

    def answer(self, texts: list[str], prompt_lens: list[int]) -> list[list[int]]:
        if not texts:  # a batch whose rows were all skipped (the tokenizer refuses [])
            return []
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [[*ids, self.eot][: self.max_seq_len - n] for ids, n in zip(encoded, prompt_lens)]

    def observation_masks(self, batch: dict, keep: list[int], out: dict) -> dict:
        """``<answer>_obs_mask`` beside each ``<answer>_ids`` whose rows carry observation
        spans (an environment's); nothing for a single-turn source."""
        masks = {}
        for answer in ANSWERS:
            spans = batch.get(spans_column(answer))
            if spans is None or f"{answer}_ids" not in out:
                continue
            lengths = [len(ids) for ids in out[f"{answer}_ids"]]
            texts = [batch[answer][i] for i in keep]
            picked = [spans[i] for i in keep]
            masks[mask_column(f"{answer}_ids")] = answer_masks(
                self.tokenizer, texts, picked, lengths
            )
        return masks

    def __call__(self, batch: dict) -> dict:
        encoded = self.tokenizer(batch["prompt"])["input_ids"]
        keep = []
        for i, ids in enumerate(encoded):
            if len(ids) > self.max_prompt_len:
                if self.overlong == "error":
                    source = batch[_SOURCE][i] if _SOURCE in batch else "?"
                    raise SourceError(
                        f"source {source}: the prompt {batch['prompt'][i][:60]!r}... is "
                        f"{len(ids)} tokens, longer than data.max_prompt_len="
                        f"{self.max_prompt_len} (data.overlong_prompts='error'; 'truncate' "
                        "keeps its end, 'skip' drops the row)"
                    )
                if self.overlong == "skip":
                    continue
            keep.append(i)
        prompt_ids = [self.truncate(encoded[i]) for i in keep]
        lens = [len(ids) for ids in prompt_ids]
        out = {
            "prompt": [batch["prompt"][i] for i in keep],
            "prompt_ids": prompt_ids,
            "chosen_ids": self.answer([batch["chosen"][i] for i in keep], lens),
            "rejected_ids": self.answer([batch["rejected"][i] for i in keep], lens),
        }
        for column in KEPT:
            if column in batch:
                out[column] = [batch[column][i] for i in keep]
        if "response" in batch:  # the demonstration SFT imitates
            out["response_ids"] = self.answer([batch["response"][i] for i in keep], lens)
        out |= self.observation_masks(batch, keep, out)
        if "responses" in batch:
            out["responses_ids"] = [
                self.answer(list(batch["responses"][i]), [n] * len(batch["responses"][i]))
                for i, n in zip(keep, lens)
            ]
        out[_OVERLONG] = [len(encoded[i]) > self.max_prompt_len for i in keep]
        return out

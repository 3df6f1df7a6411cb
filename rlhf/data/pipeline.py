"""Raw sources -> one phase's tokenised rows, blended over sources and cached on disk.

Every phase uses the same tokenised form, so the reward model sees exactly the token sequences
PPO will score: ``prompt_ids`` (BOS + prompt, left-truncated to max_prompt_len) and the answers
``chosen_ids`` / ``rejected_ids`` (answer tokens + end-of-text, cut so prompt + answer fit in
max_seq_len). Prompt and answer are tokenised separately, because PPO generates after the
prompt's own tokens and the reward model must see that same split.
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

from rlhf.config import DataConfig
from rlhf.data.sources import load_pairs
from rlhf.data.split import phase_indices
from rlhf.engine import barrier, is_main
from rlhf.models import publish_dir

log = logging.getLogger(__name__)

PHASES = ("sft", "reward", "ppo")
FORMAT_VERSION = 1  # bump when the tokenised layout changes


def phase_dataset(
    data: DataConfig, phase: str, split: str, tokenizer, end_of_text_id: int
) -> datasets.Dataset:
    """Tokenised rows of ``phase`` ('sft' | 'reward' | 'ppo') and ``split`` ('train' | 'eval').
    Built once by rank 0 into a directory named by a hash of everything that changes it; the
    other ranks (and later runs) load it."""
    key = cache_key(data, phase, split, tokenizer, end_of_text_id)
    path = Path(data.cache_dir).expanduser() / f"{phase}-{split}-{key[:20]}"
    if is_main() and not (path / "dataset_info.json").exists():
        built = _build(data, phase, split, tokenizer, end_of_text_id)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        built.save_to_disk(str(tmp))
        publish_dir(tmp, path)
        log.info("tokenised %d %s/%s rows into %s", len(built), phase, split, path)
    barrier()
    return datasets.load_from_disk(str(path))


def cache_key(data: DataConfig, phase: str, split: str, tokenizer, end_of_text_id: int) -> str:
    sources = {
        name: {**dataclasses.asdict(src), "file": _file_stamp(src.path)}
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
        "max_eval_rows": data.max_eval_rows if split == "eval" else 0,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "end_of_text_id": end_of_text_id,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _file_stamp(path: str | None) -> list | None:
    """Size and mtime of a local source, so an edited file is tokenised again."""
    if path is None or not os.path.exists(path):
        return None
    files = [Path(path)] if os.path.isfile(path) else sorted(Path(path).rglob("*"))
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = (
        backend.to_str()
        if backend is not None
        else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    text += json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _build(data: DataConfig, phase: str, split: str, tokenizer, end_of_text_id: int):
    parts = []
    for name, source in data.sources.items():
        pairs, dropped = load_pairs(source, split, data.seed)
        indices = phase_indices(len(pairs), data.phase_split, PHASES.index(phase), data.seed)
        pairs = pairs.select(indices)
        log.info(
            "data %s/%s: %d rows for %s (%d rows skipped: missing or empty fields)",
            name,
            split,
            len(pairs),
            phase,
            dropped,
        )
        parts.append(pairs)
    rows = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if split == "eval" and data.max_eval_rows and len(rows) > data.max_eval_rows:
        rows = rows.shuffle(seed=data.seed).select(range(data.max_eval_rows))
    tokenize = _Tokenize(tokenizer, end_of_text_id, data.max_prompt_len, data.max_seq_len)
    return rows.map(
        tokenize, batched=True, remove_columns=[c for c in rows.column_names if c != "prompt"]
    )


class _Tokenize:
    """Batched map function (a class so ``datasets`` can fingerprint it)."""

    def __init__(self, tokenizer, end_of_text_id: int, max_prompt_len: int, max_seq_len: int):
        self.tokenizer = tokenizer
        self.eot = end_of_text_id
        self.max_prompt_len = max_prompt_len
        self.max_seq_len = max_seq_len

    def prompt(self, texts: list[str]) -> list[list[int]]:
        out = []
        bos = self.tokenizer.bos_token_id
        for ids in self.tokenizer(texts)["input_ids"]:
            if len(ids) > self.max_prompt_len:  # keep BOS and the end, where the question is
                head = [bos] if ids[0] == bos else []
                ids = head + ids[len(ids) - self.max_prompt_len + len(head) :]
            out.append(ids)
        return out

    def answer(self, texts: list[str], prompt_lens: list[int]) -> list[list[int]]:
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [[*ids, self.eot][: self.max_seq_len - n] for ids, n in zip(encoded, prompt_lens)]

    def __call__(self, batch: dict) -> dict:
        prompt_ids = self.prompt(batch["prompt"])
        lens = [len(ids) for ids in prompt_ids]
        out = {
            "prompt_ids": prompt_ids,
            "chosen_ids": self.answer(batch["chosen"], lens),
            "rejected_ids": self.answer(batch["rejected"], lens),
        }
        if "responses" in batch:
            out["responses_ids"] = [
                self.answer(list(r), [n] * len(r)) for r, n in zip(batch["responses"], lens)
            ]
        return out

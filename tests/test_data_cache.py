"""The tokenised-data cache: built once and reused, rebuilt for any change in what it depends on;
phases of one source are disjoint; prompts and answers are cut as documented."""

import json
import logging
import os
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlhf import tasks
from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.config import DataConfig, SourceConfig
from rlhf.data import prepare, sources
from rlhf.data.prepare import phase_dataset
from rlhf.tasks import Grade, toy

NUM_ROWS = 300


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)


def _write_pairs(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _unique_rows(n: int = NUM_ROWS) -> list[dict]:
    return [
        {
            "prompt": f"\n\nHuman: What is item {i}?\n\nAssistant:",
            "chosen": f" Item {i} is a thing.",
            "rejected": f" No idea about {i}.",
        }
        for i in range(n)
    ]


@pytest.fixture
def pairs_file(tmp_path) -> Path:
    return _write_pairs(tmp_path / "pairs.jsonl", _unique_rows())


def _data(path: Path, cache: Path, **overrides) -> DataConfig:
    source = SourceConfig(adapter="local", path=str(path), eval_split=None, eval_fraction=0.1)
    fields = dict(max_seq_len=64, max_prompt_len=32, seed=1234, cache_dir=str(cache))
    return DataConfig(sources={"local": source}, **{**fields, **overrides})


@pytest.fixture
def builds(monkeypatch) -> list[tuple]:
    """Records every call of the (expensive) builder."""
    calls = []
    original = prepare._build

    def counting(data, phase, split, tokenizer, eot):
        calls.append((phase, split))
        return original(data, phase, split, tokenizer, eot)

    monkeypatch.setattr(prepare, "_build", counting)
    return calls


def _dirs(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()} if cache.exists() else set()


def test_built_once_then_reused(tmp_path, pairs_file, tokenizer, builds):
    cache = tmp_path / "cache"
    data = _data(pairs_file, cache)
    eot = tokenizer.eos_token_id
    first = phase_dataset(data, "sft", "train", tokenizer, eot)
    assert len(builds) == 1
    (built,) = _dirs(cache)
    stamp = (cache / built / "dataset_info.json").stat().st_mtime_ns
    second = phase_dataset(data, "sft", "train", tokenizer, eot)
    assert len(builds) == 1  # not rebuilt
    assert _dirs(cache) == {built}
    assert (cache / built / "dataset_info.json").stat().st_mtime_ns == stamp
    assert first["prompt"] == second["prompt"]
    assert first["chosen_ids"] == second["chosen_ids"]


def _variants(tokenizer, pairs_file):
    """(label, data overrides, phase, split, tokenizer, eot) that must each get a new entry."""
    eot = tokenizer.eos_token_id
    other_tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    other_tokenizer.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    return [
        ("max_seq_len", {"max_seq_len": 48}, "sft", "train", tokenizer, eot),
        ("max_prompt_len", {"max_prompt_len": 16}, "sft", "train", tokenizer, eot),
        ("phase", {}, "reward", "train", tokenizer, eot),
        ("split", {}, "sft", "eval", tokenizer, eot),
        ("seed", {"seed": 99}, "sft", "train", tokenizer, eot),
        ("phase_split", {"phase_split": [1, 1, 1]}, "sft", "train", tokenizer, eot),
        ("tokenizer", {}, "sft", "train", other_tokenizer, eot),
        ("end_of_text", {}, "sft", "train", other_tokenizer, len(tokenizer)),
    ]


def test_every_key_part_gives_a_new_entry(tmp_path, pairs_file, tokenizer, builds):
    cache = tmp_path / "cache"
    eot = tokenizer.eos_token_id
    phase_dataset(_data(pairs_file, cache), "sft", "train", tokenizer, eot)
    seen = _dirs(cache)
    for label, overrides, phase, split, tok, end in _variants(tokenizer, pairs_file):
        before = len(builds)
        phase_dataset(_data(pairs_file, cache, **overrides), phase, split, tok, end)
        assert len(builds) == before + 1, f"{label}: the cached entry was reused"
        now = _dirs(cache)
        assert len(now - seen) == 1, f"{label}: no new cache directory"
        seen = now
    # and each of them is reused in turn
    before = len(builds)
    for _, overrides, phase, split, tok, end in _variants(tokenizer, pairs_file):
        phase_dataset(_data(pairs_file, cache, **overrides), phase, split, tok, end)
    assert len(builds) == before


def test_an_edited_local_file_is_tokenised_again(tmp_path, pairs_file, tokenizer, builds):
    cache = tmp_path / "cache"
    data = _data(pairs_file, cache)
    eot = tokenizer.eos_token_id
    old = phase_dataset(data, "sft", "train", tokenizer, eot)
    rows = _unique_rows()
    for row in rows:
        row["chosen"] = row["chosen"].replace("thing", "gadget")
    _write_pairs(pairs_file, rows)
    stat = pairs_file.stat()  # make sure the stamp moves even on a coarse-mtime filesystem
    os.utime(pairs_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    new = phase_dataset(data, "sft", "train", tokenizer, eot)
    assert len(builds) == 2
    assert len(_dirs(cache)) == 2
    assert old["prompt"] == new["prompt"]  # same rows (same split) ...
    decoded = tokenizer.decode(new[0]["chosen_ids"])
    assert "gadget" in decoded, decoded  # ... with the new text


def test_a_new_toy_generator_is_tokenised_again(tmp_path, tokenizer, builds, monkeypatch):
    # toy rows come from code, so no file stamp moves when the generator changes
    source = SourceConfig(adapter="toy", num_rows=200, train_split="train", eval_split="test")
    data = DataConfig(sources={"toy": source}, max_seq_len=64, max_prompt_len=32, seed=1234,
                      cache_dir=str(tmp_path / "cache"))  # fmt: skip
    eot = tokenizer.eos_token_id
    phase_dataset(data, "reward", "train", tokenizer, eot)
    phase_dataset(data, "reward", "train", tokenizer, eot)
    assert len(builds) == 1
    monkeypatch.setattr(toy.TASK, "version", toy.TASK.version + 1)
    phase_dataset(data, "reward", "train", tokenizer, eot)
    assert len(builds) == 2
    assert len(_dirs(tmp_path / "cache")) == 2


class Editable:
    """A user's task whose prompts a test rewords, its version left as it was."""

    name, version = "editable", 1
    wording = "What is"

    def rows(self, split: str, num_rows: int, seed: int, num_ranked: int = 0) -> list[dict]:
        return [
            {
                "prompt": f"\n\nHuman: {self.wording} item {i}?\n\nAssistant:",
                "chosen": f" Item {i}.",
                "rejected": " No idea.",
            }
            for i in range(num_rows)
        ]

    def grade(self, prompt: str, response: str) -> Grade:
        return Grade(True)


EDITABLE = Editable()


@pytest.fixture
def fresh_hashes():
    """Each run is a new process: no rows' hash remembered from another test's."""
    sources._rows_hash.cache_clear()
    yield
    sources._rows_hash.cache_clear()


def test_rows_edited_without_a_version_bump_are_tokenised_again(
    tmp_path, tokenizer, builds, monkeypatch, fresh_hashes
):
    name = "tests.test_data_cache:EDITABLE"
    source = SourceConfig(
        adapter="task", task=name, num_rows=200, train_split="train", eval_split="test"
    )
    data = DataConfig(sources={"editable": source}, max_seq_len=64, max_prompt_len=32,
                      seed=1234, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    eot = tokenizer.eos_token_id
    old = phase_dataset(data, "ppo", "train", tokenizer, eot)
    phase_dataset(data, "ppo", "train", tokenizer, eot)
    assert len(builds) == 1  # the same rows: the entry is reused

    monkeypatch.setattr(tasks.resolve(name), "wording", "Tell me about")  # version still 1
    sources._rows_hash.cache_clear()  # the next run: a new process
    new = phase_dataset(data, "ppo", "train", tokenizer, eot)
    assert len(builds) == 2
    assert all("What is" in p for p in old["prompt"])
    assert all("Tell me about" in p for p in new["prompt"])


def test_rows_from_files_are_not_hashed(tmp_path, pairs_file, monkeypatch):
    """A file's rows are keyed on its stamp: nothing generates or hashes them."""
    monkeypatch.setattr(sources, "_rows_hash", None)  # calling it would fail
    data = _data(pairs_file, tmp_path / "cache")
    assert sources.generated_rows_hash(data.sources["local"], "train") is None


def test_phases_and_splits_are_disjoint(tmp_path, pairs_file, tokenizer):
    data = _data(pairs_file, tmp_path / "cache")
    eot = tokenizer.eos_token_id
    prompts = {
        (phase, split): phase_dataset(data, phase, split, tokenizer, eot)["prompt"]
        for phase in prepare.PHASES
        for split in ("train", "eval")
    }
    for split in ("train", "eval"):
        sets = [set(prompts[phase, split]) for phase in prepare.PHASES]
        assert sum(map(len, sets)) == sum(len(prompts[p, split]) for p in prepare.PHASES)
        for a in range(3):
            for b in range(a + 1, 3):
                assert not sets[a] & sets[b], (split, a, b)
    train = set().union(*(prompts[p, "train"] for p in prepare.PHASES))
    evals = set().union(*(prompts[p, "eval"] for p in prepare.PHASES))
    assert not train & evals
    assert len(train) + len(evals) == NUM_ROWS  # together every row, once
    # shares follow phase_split 2:4:4
    sizes = [len(prompts[p, "train"]) for p in prepare.PHASES]
    assert sizes == [54, 108, 108]


def test_long_prompts_are_left_truncated_keeping_bos(tmp_path, tokenizer):
    long_prompt = (
        "\n\nHuman: " + " ".join(f"word{i}" for i in range(60)) + " What now?\n\nAssistant:"
    )
    rows = [{"prompt": long_prompt, "chosen": " Fine.", "rejected": " No."}, *_unique_rows(20)]
    path = _write_pairs(tmp_path / "long.jsonl", rows)
    data = _data(path, tmp_path / "cache", max_prompt_len=12, max_seq_len=64, phase_split=[1, 0, 0])
    eot = tokenizer.eos_token_id
    out = [r for s in ("train", "eval") for r in phase_dataset(data, "sft", s, tokenizer, eot)]
    assert len(out) == len(rows)
    (row,) = [r for r in out if r["prompt"] == long_prompt]
    full = tokenizer(long_prompt)["input_ids"]
    assert full[0] == tokenizer.bos_token_id and len(full) > 12
    assert len(row["prompt_ids"]) == 12
    assert row["prompt_ids"][0] == tokenizer.bos_token_id
    assert row["prompt_ids"][1:] == full[-11:]  # the end of the prompt, where the question is
    for other in out:
        assert len(other["prompt_ids"]) <= 12
        assert other["prompt_ids"][0] == tokenizer.bos_token_id


def test_answers_end_with_end_of_text_unless_cut(tmp_path, tokenizer):
    rows = _unique_rows(40)
    for i in range(0, 40, 2):  # every other answer is too long for max_seq_len
        rows[i]["chosen"] = " " + " ".join(f"long{j}" for j in range(40))
    path = _write_pairs(tmp_path / "answers.jsonl", rows)
    max_seq_len = 24
    data = _data(path, tmp_path / "cache", max_seq_len=max_seq_len, max_prompt_len=16)
    eot = tokenizer.eos_token_id
    by_prompt = {r["prompt"]: r for r in rows}
    out = [
        row
        for split in ("train", "eval")
        for phase in prepare.PHASES
        for row in phase_dataset(data, phase, split, tokenizer, eot)
    ]
    assert len(out) == 40
    cut = whole = 0
    for row in out:
        raw = by_prompt[row["prompt"]]
        for column in ("chosen", "rejected"):
            answer = tokenizer(raw[column], add_special_tokens=False)["input_ids"]
            ids = row[f"{column}_ids"]
            room = max_seq_len - len(row["prompt_ids"])
            assert len(row["prompt_ids"]) + len(ids) <= max_seq_len
            if len(answer) + 1 <= room:
                assert ids == [*answer, eot]
                whole += 1
            else:
                assert ids == answer[:room]  # cut: no end-of-text
                assert len(row["prompt_ids"]) + len(ids) == max_seq_len
                cut += 1
    assert cut >= 20 and whole >= 20  # both cases were exercised


def _data_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("data local/")]


def test_counts_are_logged_on_every_run_for_one_scope(tmp_path, tokenizer, caplog, builds):
    rows = _unique_rows(100)
    for row in rows[:10]:
        row["rejected"] = row["chosen"]  # skipped: nothing to compare
    data = _data(_write_pairs(tmp_path / "p.jsonl", rows), tmp_path / "cache")
    eot = tokenizer.eos_token_id
    runs = []
    for _ in range(2):  # the second run finds the entry in the cache
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="rlhf.data.prepare"):
            phase_dataset(data, "sft", "eval", tokenizer, eot)
        runs.append(_data_lines(caplog))
    assert len(builds) == 1
    assert runs[0] == runs[1] and len(runs[0]) == 1
    [line] = runs[0]
    # eval rows carved out of the train split, and every count of that same split
    assert line.startswith("data local/eval (carved out of its train split: it has no eval split")
    read, skipped, usable, kept = (
        int(n) for n in re.findall(r"(\d+) (?:rows read|skipped|usable|of them)", line)
    )
    assert read == 10 and read - skipped == usable and kept <= usable
    assert f"{kept} of them for sft" in line


def test_a_saved_dataset_source_is_cached_outside_its_folder(tmp_path, tokenizer):
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list(_unique_rows(60)).save_to_disk(str(folder))
    before = sorted(p.name for p in folder.rglob("*"))
    cache = tmp_path / "cache"
    data = _data(folder, cache)
    eot = tokenizer.eos_token_id
    out = [phase_dataset(data, p, "train", tokenizer, eot) for p in prepare.PHASES]
    assert sum(map(len, out)) == 54  # 60 rows less the 6 carved out for eval
    assert sorted(p.name for p in folder.rglob("*")) == before  # nothing written beside the data
    assert len(_dirs(cache)) == 3
    # the key covers the folder's files: an added file is a new entry
    (folder / "README.md").write_text("notes")
    key = prepare.cache_key(data, "sft", "train", tokenizer, eot)
    assert not any(d.endswith(key[:20]) for d in _dirs(cache))


def test_the_other_ranks_take_rank_0s_key_and_never_build(tmp_path, tokenizer, monkeypatch):
    """A rank other than 0 neither computes the key (its view of the user's folder may differ
    from rank 0's) nor builds: it reads the entry named by the key rank 0 sends."""
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list(_unique_rows(60)).save_to_disk(str(folder))
    data = _data(folder, tmp_path / "cache")
    eot = tokenizer.eos_token_id
    key = prepare.cache_key(data, "sft", "train", tokenizer, eot)
    built = phase_dataset(data, "sft", "train", tokenizer, eot)  # rank 0's entry
    (folder / "notes.txt").write_text("added after rank 0 looked")  # this rank's key would differ
    assert prepare.cache_key(data, "sft", "train", tokenizer, eot) != key
    sent = []

    def from_rank_0(value):
        sent.append(value)
        return key

    def no_key(*args):
        raise AssertionError("only rank 0 computes the key")

    def no_build(*args):
        raise AssertionError("only rank 0 builds")

    monkeypatch.setattr(prepare, "is_main", lambda: False)
    monkeypatch.setattr(prepare, "from_main", from_rank_0)
    monkeypatch.setattr(prepare, "cache_key", no_key)
    monkeypatch.setattr(prepare, "_build", no_build)
    rows = phase_dataset(data, "sft", "train", tokenizer, eot)
    assert sent == [None] and rows["prompt_ids"] == built["prompt_ids"]


@pytest.mark.slow
def test_two_ranks_read_one_entry_of_a_saved_dataset(tmp_path):
    """Two ranks on a save_to_disk source: rank 0 builds the entry under the cache dir, rank 1
    reads that entry (the key comes from rank 0), and the user's folder is left as it was."""
    import datasets

    from tests.conftest import FAST, cache_overrides, read_summary, run_rlhf

    folder = tmp_path / "saved"
    datasets.Dataset.from_list(_unique_rows(200)).save_to_disk(str(folder))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in folder.rglob("*"))
    cache = tmp_path / "cache"
    run_rlhf(
        [
            "step=sft",
            "data=local",
            f"data.sources.local.path={folder}",
            *(o for o in FAST if not o.startswith("data.sources.toy")),
            "data.max_seq_len=48",
            "data.max_prompt_len=24",
            "optim.micro_batch_size=4",
            "step.max_steps=2",
            "step.eval_at_start=false",
            "step.save_model=false",
            *cache_overrides(cache),
        ],
        run_dir=tmp_path / "run",
        nproc=2,
        timeout=600,
    )
    assert read_summary(tmp_path / "run")["train/steps"] == 2
    assert sorted((p.name, p.stat().st_mtime_ns) for p in folder.rglob("*")) == before
    entries = sorted(
        p.name.split("-")[0] + "-" + p.name.split("-")[1] for p in (cache / "data").iterdir()
    )
    assert entries == ["sft-eval", "sft-train"]  # one entry each, no .tmp left behind

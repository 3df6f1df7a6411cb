"""data=local on copies as users have them: a hub-layout directory or a saved DatasetDict gives
its test split as the eval rows (eval_split null, data=local's default), one rule decides which
formats a lone file and a directory's files may have, and a preference-label column the mapping
leaves unused is warned about (SHP's human_ref_A / human_ref_B mapped as chosen / rejected)."""

from __future__ import annotations

import datasets
import pytest

from rlhf.config import SourceConfig
from rlhf.data import sources
from rlhf.data.sources import load_source, source_problems

ROWS = [{"prompt": f"Q{i}:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(12)]


def _local(path, **fields) -> SourceConfig:
    return SourceConfig(**{"adapter": "local", "path": str(path), "eval_split": None, **fields})


def _rows(source, split):
    return list(load_source(source, split, 1234).rows)


def _hub_dir(root, splits):
    (root / "data").mkdir(parents=True)
    for name, rows in splits.items():
        datasets.Dataset.from_list(rows).to_parquet(str(root / "data" / f"{name}-00000.parquet"))
    return root


def _saved_dict(root, splits):
    tables = {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
    datasets.DatasetDict(tables).save_to_disk(str(root))
    return root


@pytest.mark.parametrize("layout", [_hub_dir, _saved_dict])
def test_a_copy_with_a_test_split_gives_it_as_the_eval_rows(tmp_path, layout):
    path = layout(tmp_path / "copy", {"train": ROWS[:9], "test": ROWS[9:]})
    source = _local(path)
    assert source_problems(source) == []
    assert not sources.carves(source)
    assert _rows(source, "train") == ROWS[:9]
    assert _rows(source, "eval") == ROWS[9:]  # not carved out of train, not ignored
    assert sources.eval_origin(source).startswith("its test split")


def test_a_copy_with_only_train_is_carved(tmp_path):
    source = _local(_hub_dir(tmp_path / "copy", {"train": ROWS}))
    assert sources.carves(source)
    train, eval_ = _rows(source, "train"), _rows(source, "eval")
    assert len(eval_) == 1 and len(train) == 11 and not set(map(str, eval_)) & set(map(str, train))
    assert "carved out of its train split" in sources.eval_origin(source)


def test_several_other_splits_must_be_named(tmp_path):
    splits = {"train": ROWS[:8], "validation": ROWS[8:10], "test": ROWS[10:]}
    path = _saved_dict(tmp_path / "copy", splits)
    [(key, value, accepted)] = source_problems(_local(path))
    assert (key, value) == ("eval_split", None)
    assert accepted.startswith("one of validation, test (") and "name the eval one" in accepted
    assert _rows(_local(path, eval_split="validation"), "eval") == ROWS[8:10]


def _csv(path, rows):
    datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    return path


def test_one_rule_for_a_lone_file_and_a_directorys_files(tmp_path):
    lone = _csv(tmp_path / "pairs.csv", ROWS)
    (tmp_path / "dir").mkdir()
    _csv(tmp_path / "dir" / "train.csv", ROWS[:9])
    _csv(tmp_path / "dir" / "test.csv", ROWS[9:])
    assert source_problems(_local(lone)) == []
    assert sorted(map(str, _rows(_local(lone), "train") + _rows(_local(lone), "eval"))) == sorted(
        map(str, ROWS)
    )
    assert _rows(_local(tmp_path / "dir"), "eval") == ROWS[9:]
    # a format neither reads: refused alike, the directory naming its file
    (tmp_path / "notes.txt").write_text("prompt\nQ?\n")
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "train.txt").write_text("prompt\nQ?\n")
    for path in (tmp_path / "notes.txt", tmp_path / "txt"):
        [(key, _, accepted)] = source_problems(_local(path))
        assert key == "path" and accepted.startswith("an existing .jsonl/.json/.parquet/.csv")
    assert (
        "(train.txt is not one of these formats)" in source_problems(_local(tmp_path / "txt"))[0][2]
    )


SHP_ROWS = [
    {
        "history": "Which is bigger?",
        "human_ref_A": " The sun.",
        "human_ref_B": " A pea.",
        "labels": 1,
    },
    {"history": "Which is wet?", "human_ref_A": " Sand.", "human_ref_B": " Water.", "labels": 0},
]


def test_an_unused_preference_label_is_warned_about(tmp_path):
    path = tmp_path / "shp.jsonl"
    datasets.Dataset.from_list(SHP_ROWS * 5).to_json(str(path))
    as_pairs = {"prompt": "history", "chosen": "human_ref_A", "rejected": "human_ref_B"}
    loaded = load_source(_local(path, columns=as_pairs), "train", 0)
    [warning] = loaded.warnings
    assert "column(s) 'labels' look like a preference label" in warning
    assert "every row's 'human_ref_A' is taken as preferred over 'human_ref_B'" in warning
    assert "answer_a: human_ref_A, answer_b: human_ref_B, label: labels" in warning
    labelled = {"prompt": "history", "answer_a": "human_ref_A", "answer_b": "human_ref_B"}
    read = load_source(_local(path, columns={**labelled, "label": "labels"}), "train", 0)
    assert read.warnings == []
    assert {r["chosen"] for r in read.rows} == {" The sun.", " Water."}  # the label decides
    plain = tmp_path / "pairs.jsonl"
    datasets.Dataset.from_list(ROWS).to_json(str(plain))
    assert load_source(_local(plain), "train", 0).warnings == []


def test_a_source_is_checked_once_until_its_files_change(tmp_path, monkeypatch):
    """The config checks, then every split and phase's loading, check a directory and read its
    layout once: later asks trust the kept verdicts, and an edited copy is checked again."""
    from rlhf.data import local

    path = _hub_dir(tmp_path / "copy", {"train": ROWS[:9], "test": ROWS[9:]})
    calls = {"is_usable": 0, "_read_splits": 0}
    for name in calls:
        monkeypatch.setattr(local, name, _counted(calls, name, getattr(local, name)))
    source = _local(path)
    assert source_problems(source) == []
    for split in ("train", "eval", "train", "eval"):
        load_source(source, split, 1234)
    assert calls == {"is_usable": 1, "_read_splits": 1}
    datasets.Dataset.from_list(ROWS[:3]).to_parquet(str(path / "data" / "test-00000.parquet"))
    assert _rows(source, "eval") == ROWS[:3]
    assert calls == {"is_usable": 2, "_read_splits": 2}


def _counted(calls: dict, name: str, fn):
    def counted(*args):
        calls[name] += 1
        return fn(*args)

    return counted

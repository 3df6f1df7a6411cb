"""Source adapters: each hub schema on a small local copy (tests/assets/raw), local files with a column
mapping and a template, the fast config checks, the eval carve-out and the toy task."""

import gzip
import json
from pathlib import Path

import datasets
import pytest

from rlhf.config import SourceConfig
from rlhf.data import sources
from rlhf.data.sources import ADAPTERS, SourceError, load_pairs, source_problems, strip_citations

RAW = Path(__file__).parent / "assets" / "raw"
HUB_ADAPTERS = [name for name, adapter in ADAPTERS.items() if adapter.hub_id]


def _raw_rows(name):
    return [json.loads(line) for line in (RAW / f"{name}.jsonl").read_text().splitlines()]


def _both_splits(source, seed=1234):
    train, dropped_train = load_pairs(source, "train", seed)
    eval_, dropped_eval = load_pairs(source, "eval", seed)
    return train, eval_, dropped_train + dropped_eval


# (raw rows, rows skipped, index of a raw row, what it maps to)
EXPECTED = {
    "rm-static": (
        6,
        2,
        0,
        {
            "prompt": "\n\nHuman: What is the capital of France?\n\nAssistant:",
            "chosen": " The capital of France is Paris.",
            "rejected": " I don't know, sorry.",
        },
    ),
    "full-hh-rlhf": (
        6,
        2,
        0,
        {
            "prompt": "\n\nHuman: How many legs does a spider have?\n\nAssistant:",
            "chosen": " A spider has eight legs.",
            "rejected": " A spider has six legs.",
        },
    ),
    "synthetic-instruct-gptj-pairwise": (
        8,
        2,
        0,
        {
            "prompt": " Human: Give me tip number 1 for staying healthy. Assistant:",
            "chosen": " Tip 1: drink water and sleep eight hours.",
            "rejected": " Tip 1: skip every meal.",
        },
    ),
    "rlhf-reward-datasets": (
        6,
        2,
        1,
        {
            "prompt": "\n\nHuman: I want to learn to juggle.\n\nAssistant: Great! Do you have any balls?"
            "\n\nHuman: Yes, three of them.\n\nAssistant:",
            "chosen": " Start by tossing one ball from hand to hand.",
            "rejected": " Juggling is impossible.",
        },
    ),
    "webgpt-comparisons": (
        7,
        3,  # a tie, an empty answer, a None score
        0,
        {
            "prompt": " Human: Why is the sky blue? Assistant:",
            "chosen": " Sunlight is scattered by the air, and blue light scatters the most.",
            "rejected": " Because the ocean reflects onto it.",
        },
    ),
    "hh-rlhf": (
        6,
        2,  # dialogues that differ before the last answer; no assistant turn
        1,  # a two-turn dialogue: the prompt is everything up to the last "\n\nAssistant:"
        {
            "prompt": "\n\nHuman: I want to bake bread.\n\nAssistant: Great! Do you have yeast?"
            "\n\nHuman: Yes, a packet.\n\nAssistant:",
            "chosen": " Mix it with warm water and flour, then let the dough rise.",
            "rejected": " Buy bread instead.",
        },
    ),
    "shp": (
        7,
        2,
        1,  # labels == 0: human_ref_B is preferred
        {
            "prompt": " Human: How far away is the Moon? Assistant:",
            "chosen": " About 384,000 km on average.",
            "rejected": " Far.",
        },
    ),
}


def test_every_hub_adapter_has_an_asset():
    assert sorted(EXPECTED) == sorted(HUB_ADAPTERS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_to_pair_maps_the_hub_schema(name):
    num_raw, num_skipped, index, expected = EXPECTED[name]
    rows = _raw_rows(name)
    assert len(rows) == num_raw
    assert set(ADAPTERS[name].required_columns) <= set(rows[0])
    pairs = [ADAPTERS[name].to_pair(row) for row in rows]
    assert sum(p is None for p in pairs) == num_skipped
    assert pairs[index] == expected
    for pair in filter(None, pairs):
        assert set(pair) == {"prompt", "chosen", "rejected"}
        assert pair["chosen"].startswith(" ") and pair["rejected"].startswith(" ")
        assert pair["prompt"].endswith("Assistant:")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_load_pairs_on_a_local_copy(name):
    num_raw, num_skipped, _, expected = EXPECTED[name]
    # a file is one table: its eval rows are carved out of it (eval_split null)
    source = SourceConfig(adapter=name, path=str(RAW / f"{name}.jsonl"), eval_split=None)
    assert source_problems(source) == []
    train, eval_, dropped = _both_splits(source)
    assert dropped == num_skipped
    assert len(train) + len(eval_) == num_raw - num_skipped
    # one carved eval row (a bad one for synthetic-instruct and hh-rlhf, with this seed)
    assert len(eval_) == (0 if name in ("synthetic-instruct-gptj-pairwise", "hh-rlhf") else 1)
    for ds in (train, eval_):
        assert ds.column_names == ["prompt", "chosen", "rejected"]
    assert expected in [*train, *eval_]
    kept = [p for p in map(ADAPTERS[name].to_pair, _raw_rows(name)) if p]
    assert sorted(r["prompt"] for r in [*train, *eval_]) == sorted(p["prompt"] for p in kept)


def test_webgpt_chosen_is_the_higher_score_and_ties_are_skipped():
    rows = _raw_rows("webgpt-comparisons")
    assert rows[1]["score_1"] > rows[1]["score_0"]
    pair = ADAPTERS["webgpt-comparisons"].to_pair(rows[1])
    assert (
        pair["chosen"]
        == " Moving electric charges create magnetic fields. In magnets the spins of electrons line up."
    )
    assert pair["rejected"] == " Magnets attract iron."
    tie = dict(rows[0], score_0=0.0, score_1=0.0)
    assert ADAPTERS["webgpt-comparisons"].to_pair(tie) is None
    assert ADAPTERS["webgpt-comparisons"].to_pair(dict(rows[0], score_0=True)) is None


def test_strip_citations_like_deepspeed_chat():
    assert (
        strip_citations("Water boils at 100 C [1][2]. It freezes(3).")
        == "Water boils at 100 C. It freezes."
    )
    assert strip_citations("No citations here.") == "No citations here."


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("rm-static", {"chosen": 3}),  # not a string
        ("rm-static", {"rejected": "   "}),  # blank
        ("rm-static", {"rejected": " The capital of France is Paris."}),  # same as chosen
        ("synthetic-instruct-gptj-pairwise", {"prompt": ["a list"]}),
        ("rlhf-reward-datasets", {"rejected": "Assistant:  "}),
        ("shp", {"labels": 2}),
        ("shp", {"labels": None}),
        ("shp", {"human_ref_A": None}),
        ("webgpt-comparisons", {"question": {"full_text": ""}}),
        ("webgpt-comparisons", {"score_1": float("nan")}),
    ],
)
def test_to_pair_skips_bad_rows(name, change):
    row = _raw_rows(name)[0]
    assert ADAPTERS[name].to_pair(row) is not None
    assert ADAPTERS[name].to_pair({**row, **change}) is None


# --- local files --------------------------------------------------------------------------------

LOCAL_ROWS = [
    {"question": f"Q{i}?", "good": f"A{i}.", "bad": f"B{i}.", "extra": i} for i in range(9)
]
LOCAL_ROWS.append({"question": "Q9?", "good": "", "bad": "B9.", "extra": 9})  # skipped
LOCAL_MAPPING = {"prompt": "question", "chosen": "good", "rejected": "bad"}
TEMPLATE = "\n\nHuman: {prompt}\n\nAssistant:"


def _write(rows, path: Path) -> str:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("filename", ["data.jsonl", "data.json", "data.parquet", "saved_dataset"])
def test_local_formats_with_mapping_and_template(tmp_path, filename):
    path = _write(LOCAL_ROWS, tmp_path / filename)
    source = SourceConfig(
        adapter="local", path=path, columns=LOCAL_MAPPING, prompt_template=TEMPLATE, eval_split=None
    )
    assert source_problems(source) == []
    train, eval_, dropped = _both_splits(source)
    assert dropped == 1
    assert (len(train), len(eval_)) == (8, 1) or (len(train), len(eval_)) == (9, 0)
    rows = sorted([*train, *eval_], key=lambda r: r["prompt"])
    assert len(rows) == 9
    # the answer would run into "Assistant:", so it gets a leading space
    assert rows[0] == {
        "prompt": "\n\nHuman: Q0?\n\nAssistant:",
        "chosen": " A0.",
        "rejected": " B0.",
    }
    assert train.column_names == ["prompt", "chosen", "rejected"]


def test_local_dataset_dict_uses_its_splits(tmp_path):
    schema_rows = [
        {"prompt": f"P{i}:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(6)
    ]
    path = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(schema_rows[:4]),
            "test": datasets.Dataset.from_list(schema_rows[4:]),
        }
    ).save_to_disk(str(path))
    source = SourceConfig(adapter="local", path=str(path))
    train, eval_, dropped = _both_splits(source)
    assert dropped == 0
    assert list(train) == schema_rows[:4]  # identity mapping and template: rows unchanged
    assert list(eval_) == schema_rows[4:]
    missing = SourceConfig(adapter="local", path=str(path), eval_split="validation")
    with pytest.raises(
        SourceError, match=r"eval_split='validation': expected one of its splits.* has train, test"
    ):
        load_pairs(missing, "eval", 0)


def test_local_ranked_responses(tmp_path):
    rows = [
        {"q": "Pick a colour.", "ranked": [" Blue.", " Red.", " Mud."]},
        {"q": "Pick a number.", "ranked": ["Seven.", "Eight."]},
        {"q": "Pick a letter.", "ranked": [" A."]},  # one answer: nothing to compare, skipped
    ]
    path = _write(rows, tmp_path / "ranked.jsonl")
    source = SourceConfig(
        adapter="local", path=path, columns={"prompt": "q", "responses": "ranked"}, eval_split=None
    )
    train, eval_, dropped = _both_splits(source)
    assert dropped == 1
    assert train.column_names == ["prompt", "chosen", "rejected", "responses"]
    by_prompt = {r["prompt"]: r for r in [*train, *eval_]}
    assert by_prompt["Pick a colour."] == {
        "prompt": "Pick a colour.",
        "chosen": " Blue.",
        "rejected": " Mud.",
        "responses": [" Blue.", " Red.", " Mud."],
    }
    assert by_prompt["Pick a number."]["responses"] == [" Seven.", " Eight."]


def test_template_replaces_only_the_prompt_field(tmp_path):
    path = _write([{"prompt": "hi", "chosen": "a", "rejected": "b"}] * 2, tmp_path / "t.jsonl")
    source = SourceConfig(
        adapter="local", path=path, prompt_template='{"user": "{prompt}"}\n', eval_split=None
    )
    train, _, _ = _both_splits(source)
    assert train[0] == {"prompt": '{"user": "hi"}\n', "chosen": "a", "rejected": "b"}


def test_missing_columns_name_the_source_and_what_it_has():
    source = SourceConfig(adapter="shp", path=str(RAW / "rm-static.jsonl"), eval_split=None)
    with pytest.raises(SourceError) as err:
        load_pairs(source, "train", 0)
    message = str(err.value)
    assert "shp" in message and "rm-static.jsonl" in message
    assert "missing column(s) ['history', 'human_ref_A', 'human_ref_B', 'labels']" in message
    assert "it has ['prompt', 'response', 'chosen', 'rejected']" in message
    assert isinstance(err.value, ValueError)


def test_missing_mapped_column(tmp_path):
    path = _write(LOCAL_ROWS, tmp_path / "data.jsonl")
    source = SourceConfig(adapter="local", path=path, columns={"prompt": "query"}, eval_split=None)
    with pytest.raises(
        SourceError,
        match=r"missing column\(s\) \['query', 'chosen', 'rejected'\]; it has \['question'",
    ):
        load_pairs(source, "train", 0)


# --- carve-out and cap --------------------------------------------------------------------------


def _numbered(tmp_path, n=40):
    rows = [{"prompt": f"P{i:02d}:", "chosen": " yes", "rejected": " no"} for i in range(n)]
    return _write(rows, tmp_path / "numbered.jsonl")


def test_eval_carve_out_is_disjoint_and_deterministic(tmp_path):
    source = SourceConfig(
        adapter="local", path=_numbered(tmp_path), eval_split=None, eval_fraction=0.1
    )
    train, eval_, _ = _both_splits(source, seed=1)
    train_prompts, eval_prompts = set(train["prompt"]), set(eval_["prompt"])
    assert len(eval_prompts) == 4 and len(train_prompts) == 36
    assert not train_prompts & eval_prompts
    assert load_pairs(source, "eval", 1)[0]["prompt"] == eval_["prompt"]
    assert set(load_pairs(source, "eval", 2)[0]["prompt"]) != eval_prompts
    assert eval_["prompt"] == sorted(eval_["prompt"])  # file order is kept


def test_num_rows_caps_after_the_carve_out(tmp_path):
    path = _numbered(tmp_path)
    full_eval = load_pairs(SourceConfig(adapter="local", path=path, eval_split=None), "eval", 1)[0]
    capped = SourceConfig(adapter="local", path=path, num_rows=10, eval_split=None)
    train, dropped = load_pairs(capped, "train", 1)
    assert (len(train), dropped) == (10, 0)
    # the 4 eval rows are under the cap, and the same as without it
    assert load_pairs(capped, "eval", 1)[0]["prompt"] == full_eval["prompt"]
    assert not set(train["prompt"]) & set(full_eval["prompt"])


def test_every_row_skipped_gives_an_empty_dataset_with_the_schema(tmp_path):
    path = _write([{"prompt": "p", "chosen": "", "rejected": "x"}] * 3, tmp_path / "bad.jsonl")
    train, dropped = load_pairs(
        SourceConfig(adapter="local", path=path, eval_split=None), "train", 0
    )
    assert (len(train), dropped) == (0, 2)
    assert train.column_names == ["prompt", "chosen", "rejected"]


def test_load_pairs_rejects_a_bad_split_or_source():
    with pytest.raises(ValueError, match="'train' or 'eval'"):
        load_pairs(SourceConfig(adapter="rm-static", path=str(RAW / "rm-static.jsonl")), "test", 0)
    with pytest.raises(SourceError, match=r"eval_fraction=1\.5"):
        load_pairs(SourceConfig(adapter="rm-static", eval_fraction=1.5), "train", 0)


# --- hub ids: the real load_dataset call (faked here: no network) --------------------------------


@pytest.mark.parametrize(
    ("adapter", "overrides", "split", "expected_call"),
    [
        ("rm-static", {}, "eval", ("Dahoas/rm-static", None, "test")),
        ("shp", {"eval_split": "validation"}, "eval", ("stanfordnlp/SHP", None, "validation")),
        (
            "webgpt-comparisons",
            {"eval_split": None},
            "eval",
            ("openai/webgpt_comparisons", None, "train"),
        ),
        (
            "full-hh-rlhf",
            {"path": "me/my-hh-copy", "subset": "v2"},
            "train",
            ("me/my-hh-copy", "v2", "train"),
        ),
    ],
)
def test_hub_ids_go_through_load_dataset(monkeypatch, adapter, overrides, split, expected_call):
    calls = []
    name = "rm-static" if adapter == "full-hh-rlhf" else adapter
    table = datasets.Dataset.from_list(_raw_rows(name))

    def fake_load_dataset(path, subset=None, *, split):
        calls.append((path, subset, split))
        return table

    monkeypatch.setattr(sources.datasets, "load_dataset", fake_load_dataset)
    pairs, dropped = load_pairs(SourceConfig(adapter=adapter, **overrides), split, 1234)
    assert calls == [expected_call]
    assert len(pairs) + dropped <= len(table)
    if expected_call[2] == "train" and split == "eval":  # carved: a tenth of the train split
        assert len(pairs) + dropped == 1


# --- fast checks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"adapter": "nope"}, "adapter"),
        ({"adapter": "local"}, "path"),
        ({"adapter": "local", "path": "/no/such/file.jsonl"}, "path"),
        ({"adapter": "shp", "path": "tests/assets/raw/no-such.jsonl"}, "path"),
        ({"adapter": "local", "path": "TXT"}, "path"),
        ({"adapter": "local", "path": "PLAIN_DIR"}, "path"),
        ({"adapter": "local", "path": "RAW", "subset": "x", "eval_split": None}, "subset"),
        (
            {"adapter": "local", "path": "RAW", "columns": {"question": "q"}, "eval_split": None},
            "columns.question",
        ),
        (
            {
                "adapter": "local",
                "path": "RAW",
                "prompt_template": "Human: Assistant:",
                "eval_split": None,
            },
            "prompt_template",
        ),
        ({"adapter": "local", "path": "RAW"}, "eval_split"),  # a file has no test split to use
        ({"adapter": "rm-static", "columns": {"prompt": "q"}}, "columns"),
        ({"adapter": "rm-static", "prompt_template": "Q: {prompt}"}, "prompt_template"),
        ({"adapter": "rm-static", "eval_fraction": 0.0}, "eval_fraction"),
        ({"adapter": "rm-static", "eval_fraction": 1.0}, "eval_fraction"),
        ({"adapter": "rm-static", "num_rows": -1}, "num_rows"),
        ({"adapter": "rm-static", "eval_split": "train"}, "eval_split"),
        ({"adapter": "webgpt-comparisons"}, "eval_split"),  # the hub dataset has only train
        ({"adapter": "shp", "train_split": "dev"}, "train_split"),
        ({"adapter": "toy", "num_rows": 9}, "num_rows"),
        ({"adapter": "toy", "num_rows": 100, "path": "x.jsonl"}, "path"),
        ({"adapter": "toy", "num_rows": 100, "eval_split": "validation"}, "eval_split"),
    ],
)
def test_source_problems_name_each_bad_value(tmp_path, fields, key):
    (tmp_path / "data.txt").write_text("prompt,chosen,rejected\n")
    (tmp_path / "plain").mkdir()
    stand_ins = {
        "TXT": str(tmp_path / "data.txt"),
        "PLAIN_DIR": str(tmp_path / "plain"),
        "RAW": str(RAW / "rm-static.jsonl"),
    }
    if "path" in fields:
        fields = {**fields, "path": stand_ins.get(fields["path"], fields["path"])}
    problems = source_problems(SourceConfig(**fields))
    assert [p[0] for p in problems] == [key]
    _, value, accepted = problems[0]
    expected_value = (
        "q" if key == "columns.question" else getattr(SourceConfig(**fields), key, fields.get(key))
    )
    assert value == expected_value
    assert accepted


def test_source_problems_messages():
    [(_, _, accepted)] = source_problems(SourceConfig(adapter="nope"))
    assert all(name in accepted for name in ADAPTERS)
    [(_, _, accepted)] = source_problems(SourceConfig(adapter="webgpt-comparisons"))
    assert accepted.startswith("null") and "has only train" in accepted
    [(_, _, accepted)] = source_problems(SourceConfig(adapter="local", path="/no/such.jsonl"))
    assert accepted == sources.PATH_ACCEPTED
    for kind in (".jsonl", ".parquet", ".jsonl.gz", "data/train-*.parquet", "save_to_disk"):
        assert kind in accepted


def test_source_problems_accept_the_recommended_configs(monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("source_problems must not load data")

    monkeypatch.setattr(sources.datasets, "load_dataset", no_loading)
    monkeypatch.setattr(sources.datasets, "load_from_disk", no_loading)
    for name, adapter in ADAPTERS.items():
        if adapter.hub_id:
            # the adapter's own splits are DeepSpeed-Chat's: what conf/data/<name>.yaml should set
            source = SourceConfig(
                adapter=name, train_split=adapter.train_split, eval_split=adapter.eval_split
            )
            assert source_problems(source) == [], name
    assert source_problems(SourceConfig(adapter="toy", num_rows=10)) == []
    assert source_problems(SourceConfig(adapter="toy", num_rows=10, eval_split=None)) == []
    shp_copy = SourceConfig(adapter="local", path=str(RAW / "shp.jsonl"), eval_split=None)
    assert source_problems(shp_copy) == []


# --- toy ----------------------------------------------------------------------------------------


def test_toy_source():
    pytest.importorskip("rlhf.tasks.toy")
    source = SourceConfig(adapter="toy", num_rows=50, seed=3)
    train, eval_, dropped = _both_splits(source, seed=1234)
    assert dropped == 0
    assert (len(train), len(eval_)) == (50, 5)
    # the toy task also gives the demonstration SFT imitates (response), uneven unlike chosen, and
    # the kind of each rejected answer (the reward eval's accuracy per kind)
    columns = ["prompt", "chosen", "rejected", "response", "rejected_kind"]
    assert train.column_names == eval_.column_names == columns
    assert not set(train["prompt"]) & set(eval_["prompt"])  # the toy test split is held out
    for row in [*train, *eval_]:
        assert row["prompt"].startswith("\n\nHuman: ") and row["prompt"].endswith("\n\nAssistant:")
        assert row["chosen"].startswith(" ") and row["chosen"] != row["rejected"]
    assert load_pairs(source, "train", 99)[0]["prompt"] == train["prompt"]  # the toy seed decides
    other = load_pairs(SourceConfig(adapter="toy", num_rows=50, seed=4), "train", 1234)[0]
    assert other["prompt"] != train["prompt"]
    assert len(load_pairs(SourceConfig(adapter="toy", num_rows=10), "eval", 0)[0]) == 1


def test_toy_eval_can_be_carved_from_train():
    pytest.importorskip("rlhf.tasks.toy")
    source = SourceConfig(adapter="toy", num_rows=20, eval_split=None)
    train, eval_, _ = _both_splits(source)
    assert (len(train), len(eval_)) == (18, 2)


# --- files as downloaded: the hub's layout, compressed JSON, a separate eval file ----------------

SCHEMA_ROWS = [
    {"prompt": f"P{i}:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(12)
]


def _hub_layout(root: Path, kind: str) -> Path:
    """A dataset directory as downloaded from the hub: parquet shards under data/, or one
    JSON lines file per split (test compressed)."""
    train, test = SCHEMA_ROWS[:9], SCHEMA_ROWS[9:]
    if kind == "parquet":
        (root / "data").mkdir(parents=True)
        _write(train, root / "data" / "train-00000-of-00001.parquet")
        _write(test, root / "data" / "test-00000-of-00001.parquet")
    else:
        root.mkdir(parents=True)
        _write(train, root / "train.jsonl")
        with gzip.open(root / "test.jsonl.gz", "wt", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in test))
    return root


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_downloaded_directory_is_read_with_its_splits(tmp_path, kind):
    path = _hub_layout(tmp_path / "rm-static", kind)
    source = SourceConfig(adapter="rm-static", path=str(path))  # eval_split: test
    assert source_problems(source) == []
    train, eval_, dropped = _both_splits(source)
    assert (list(train), list(eval_), dropped) == (SCHEMA_ROWS[:9], SCHEMA_ROWS[9:], 0)
    assert not list(path.rglob("cache-*"))  # nothing written beside the user's files
    wrong = SourceConfig(adapter="rm-static", path=str(path), eval_split="validation")
    [(key, value, accepted)] = source_problems(wrong)
    assert (key, value) == ("eval_split", "validation")
    assert "train, test" in accepted and "null carves" in accepted


@pytest.mark.parametrize("name", ["pairs.jsonl.gz", "pairs.json.gz"])
def test_compressed_json_files(tmp_path, name):
    path = tmp_path / name
    text = "".join(json.dumps(r) + "\n" for r in SCHEMA_ROWS)
    if name == "pairs.json.gz":
        text = json.dumps(SCHEMA_ROWS)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(text)
    source = SourceConfig(adapter="local", path=str(path), eval_split=None)
    assert source_problems(source) == []
    train, eval_, _ = _both_splits(source)
    assert sorted([*train, *eval_], key=lambda r: r["prompt"]) == sorted(
        SCHEMA_ROWS, key=lambda r: r["prompt"]
    )


def test_a_compressed_file_reports_its_bad_line(tmp_path):
    path = tmp_path / "pairs.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps(SCHEMA_ROWS[0]) + "\n{oops\n")
    with pytest.raises(SourceError, match=r"line 2 is not JSON"):
        load_pairs(SourceConfig(adapter="local", path=str(path), eval_split=None), "train", 0)


def test_a_separate_eval_file(tmp_path):
    train_file = _write(SCHEMA_ROWS[:9], tmp_path / "train.jsonl")
    eval_file = _write(SCHEMA_ROWS[9:], tmp_path / "held_out.jsonl")
    source = SourceConfig(adapter="local", path=train_file, eval_path=eval_file, eval_split=None)
    assert source_problems(source) == []
    train, eval_, _ = _both_splits(source)
    assert (list(train), list(eval_)) == (SCHEMA_ROWS[:9], SCHEMA_ROWS[9:])  # nothing carved
    assert sources.eval_origin(source) == f"eval_path {eval_file}"
    beside = SourceConfig(adapter="local", path=train_file, eval_path=eval_file)
    assert [p[0] for p in source_problems(beside)] == ["eval_split"]  # would be ignored
    missing = SourceConfig(adapter="local", path=train_file, eval_path="/no/eval.jsonl")
    assert [p[0] for p in source_problems(missing)] == ["eval_path"]


def test_carved_eval_rows_are_said_so():
    source = SourceConfig(adapter="webgpt-comparisons", eval_split=None)
    assert sources.carves(source)
    assert "carved out of its train split" in sources.eval_origin(source)
    assert not sources.carves(SourceConfig(adapter="rm-static"))


def test_a_saved_dataset_folder_is_never_written(tmp_path):
    path = Path(_write(SCHEMA_ROWS, tmp_path / "saved"))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in path.rglob("*"))
    source = SourceConfig(adapter="local", path=str(path), eval_split=None)
    train, eval_, _ = _both_splits(source)
    assert len(train) + len(eval_) == len(SCHEMA_ROWS)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in path.rglob("*")) == before


# --- preference labels and scores in a local mapping ----------------------------------------------


def _ab_rows():
    return [
        {"q": "Sky?", "x": "Blue.", "y": "Green.", "pick": 1, "sx": 3.0, "sy": 1.0},
        {"q": "Grass?", "x": "Red.", "y": "Green.", "pick": 0, "sx": 0.0, "sy": 2.5},
        {"q": "Snow?", "x": "White.", "y": "Black.", "pick": 1, "sx": 1.0, "sy": 1.0},  # score tie
    ]


@pytest.mark.parametrize(
    ("extra", "skipped"),
    [({"label": "pick"}, 0), ({"score_a": "sx", "score_b": "sy"}, 1)],
    ids=["label", "scores"],
)
def test_a_label_or_two_scores_say_which_answer_is_chosen(tmp_path, extra, skipped):
    path = _write(_ab_rows(), tmp_path / "ab.jsonl")
    columns = {"prompt": "q", "answer_a": "x", "answer_b": "y", **extra}
    source = SourceConfig(adapter="local", path=path, columns=columns, eval_split=None)
    assert source_problems(source) == []
    train, eval_, dropped = _both_splits(source)
    by_prompt = {r["prompt"]: (r["chosen"], r["rejected"]) for r in [*train, *eval_]}
    assert dropped == skipped
    assert by_prompt["Sky?"] == (" Blue.", " Green.")  # a preferred
    assert by_prompt["Grass?"] == (" Green.", " Red.")  # b preferred: never reversed


def test_label_values():
    assert [sources.by_label(v) for v in (1, True, "A", " a ", "1")] == ["a"] * 5
    assert [sources.by_label(v) for v in (0, False, "B", "b", "0")] == ["b"] * 5
    assert [sources.by_label(v) for v in (2, None, "maybe", 0.5, [1])] == [None] * 5


@pytest.mark.parametrize(
    "columns",
    [
        {"prompt": "q", "chosen": "x", "rejected": "x"},  # one column mapped twice
        {"prompt": "q", "answer_a": "x", "answer_b": "y"},  # no label and no scores
        {"prompt": "q", "answer_a": "x", "answer_b": "y", "label": "pick", "score_a": "sx"},
        {"prompt": "q", "answer_a": "x", "label": "pick"},  # answer_b missing
        {"prompt": "q", "answer_a": "x", "answer_b": "y", "label": "pick", "chosen": "x"},
    ],
    ids=["twice", "no-preference", "label-and-score", "one-answer", "with-chosen"],
)
def test_a_mapping_that_cannot_be_read_one_way_is_refused(tmp_path, columns):
    path = _write(_ab_rows(), tmp_path / "ab.jsonl")
    source = SourceConfig(adapter="local", path=path, columns=columns, eval_split=None)
    problems = source_problems(source)
    assert problems and {p[0] for p in problems} == {"columns"}
    with pytest.raises(SourceError, match="columns"):
        load_pairs(source, "train", 0)


def test_a_default_column_read_twice_is_refused(tmp_path):
    """chosen mapped to the file's 'prompt' column, which prompt reads by default."""
    path = _write(SCHEMA_ROWS, tmp_path / "p.jsonl")
    source = SourceConfig(adapter="local", path=path, columns={"chosen": "prompt"}, eval_split=None)
    with pytest.raises(SourceError, match=r"column 'prompt' is read as prompt and chosen"):
        load_pairs(source, "train", 0)


# --- non-text columns, escaped newlines ------------------------------------------------------------


def test_a_column_of_numbers_is_named_with_its_type(tmp_path):
    rows = [{"prompt": f"P{i}", "chosen": i, "rejected": "no"} for i in range(5)]
    path = _write(rows, tmp_path / "ints.jsonl")
    source = SourceConfig(adapter="local", path=path, eval_split=None)
    with pytest.raises(
        SourceError, match=r"column 'chosen' \(chosen\) holds int64 values, not text"
    ):
        load_pairs(source, "train", 0)


def test_a_column_of_mixed_types_keeps_its_text_rows_with_a_note(tmp_path):
    rows = [
        {"prompt": f"P{i}", "chosen": 5 if i % 2 else f" yes {i}", "rejected": " no"}
        for i in range(8)
    ]
    path = _write(rows, tmp_path / "mixed.jsonl")
    loaded = sources.load_source(
        SourceConfig(adapter="local", path=path, eval_split=None), "train", 0
    )
    # 7 train rows (one carved out for eval); those with a number are skipped
    assert loaded.read == 7 and loaded.skipped == 7 - len(loaded.rows) >= 3
    assert set(loaded.rows["chosen"]) <= {f" yes {i}" for i in range(0, 8, 2)}
    assert loaded.notes == [
        "column 'chosen' (chosen) holds mixed types: its non-text rows are skipped"
    ]


def test_template_escapes_become_newlines_and_escaped_text_is_warned(tmp_path):
    rows = [{"prompt": f"Q{i}?", "chosen": "Yes.", "rejected": "No."} for i in range(10)]
    rows[3]["chosen"] = "Yes.\\nReally."  # a literal backslash-n: the file was escaped twice
    path = _write(rows, tmp_path / "q.jsonl")
    template = "\\n\\nHuman: {prompt}\\n\\nAssistant:"  # as Hydra passes it from a command line
    source = SourceConfig(adapter="local", path=path, prompt_template=template, eval_split=None)
    loaded = sources.load_source(source, "train", 0)
    assert all(
        p.startswith("\n\nHuman: Q") and p.endswith("?\n\nAssistant:")
        for p in loaded.rows["prompt"]
    )
    [warning] = loaded.warnings
    assert warning.startswith("1 of 9 rows hold a literal backslash-n")
    assert sources.unescape("a\\\\nb\\tc") == "a\\nb\tc"  # \\ is a backslash: no newline


def test_an_unreachable_hub_dataset_is_one_line(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Dahoas/rm-static' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(sources.datasets, "load_dataset", offline)
    with pytest.raises(SourceError) as err:
        sources.load_source(SourceConfig(adapter="rm-static"), "train", 0, name="rm-static")
    assert str(err.value) == (
        "data.sources.rm-static.path='Dahoas/rm-static': not a local directory, and the hub is "
        "not reachable (offline)"
    )

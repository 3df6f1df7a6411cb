"""Bad input, as docs/bad_input.md tables it: each bad config, data file or model directory gives
one ``error: ...`` message naming the key, file (and line), exit status 2, no traceback, and
nothing trained or exported. The config cases Hydra and validation already refuse are in
tests/test_cli.py; these are the rest. Also the safety rules: trust_remote_code is off unless
configured, exports are safetensors, and API keys never reach the run directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM, OPTForSequenceClassification

from rlhf import models
from rlhf import validate as preflight
from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.config import ConfigError, DataConfig, ModelConfig, SourceConfig
from rlhf.data import pipeline
from rlhf.data.sources import SourceError
from tests.conftest import FAST, cache_overrides, run_rlhf

NO_TRACE = {"HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
LOCAL_FAST = [o for o in FAST if not o.startswith("data.sources.toy")]
OUTPUTS = ("model", "actor", "critic", "checkpoints", "metrics.jsonl", "summary.json", "sft")


def _refused(overrides: list[str], tmp_path: Path, cache: Path, named: list[str]) -> str:
    """Run ``python -m rlhf``; it must exit 2 with one ``error:`` message naming ``named``, no
    traceback, and no output but Hydra's config and the log. Returns the message."""
    run_dir = tmp_path / "run"
    proc = run_rlhf(
        [*overrides, *cache_overrides(cache)],
        run_dir=run_dir,
        check=False,
        timeout=300,
        extra_env=NO_TRACE,
    )
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-4000:]
    message = proc.stderr[proc.stderr.index("error: ") :].strip()
    assert len(message.splitlines()) <= 3, message
    for name in named:
        assert name in message, (name, message)
    for name in OUTPUTS:
        assert not (run_dir / name).exists(), f"{name} written before the error"
    return message


# --- bad data: local files, end to end ------------------------------------------------------------


def _rows(n: int) -> list[dict]:
    return [
        {
            "prompt": f"\n\nHuman: What is {i} plus {i}?\n\nAssistant:",
            "chosen": f" {2 * i}.",
            "rejected": f" {2 * i + 1}.",
        }
        for i in range(n)
    ]


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _latin1_row(rows: list[dict]) -> bytes:
    lines = _jsonl(rows).split(b"\n")
    lines[6] = lines[6].replace(b"What", b"Wh\xe9t")  # a latin-1 byte in the 7th line
    return b"\n".join(lines)


def _long_prompt(rows: list[dict]) -> bytes:
    rows[3]["prompt"] = "\n\nHuman: " + " ".join(f"word{j}" for j in range(60)) + "?\n\nAssistant:"
    return _jsonl(rows)


DATA = [
    # id, file content, extra overrides, what the message must name ({path}: the file)
    (
        "empty-file",
        lambda: b"",
        [],
        ["{path}", "no usable rows", "sft phase's train split", "0 skipped"],
    ),
    (
        "all-rows-skipped",  # wrong types and empty fields: every row is skipped
        lambda: _jsonl([{**r, "chosen": 5 if i % 2 else ""} for i, r in enumerate(_rows(20))]),
        [],
        ["{path}", "no usable rows", "sft phase's train split", "all 18 rows were skipped"],
    ),
    (
        "missing-columns",
        lambda: _jsonl([{"question": r["prompt"], "good": r["chosen"]} for r in _rows(20)]),
        [],
        ["{path}", "missing column(s) ['prompt', 'chosen', 'rejected']", "'question', 'good'"],
    ),
    (
        "non-utf8-row",
        lambda: _latin1_row(_rows(20)),
        [],
        ["{path}", "line 7 is not valid UTF-8", "0xe9", "Wh\ufffdt is"],
    ),
    (
        "not-json-line",
        lambda: _jsonl(_rows(5)) + b"{oops\n",
        [],
        ["{path}", "line 6 is not JSON", "'{{oops'"],
    ),
    (
        "overlong-prompt",
        lambda: _long_prompt(_rows(200)),
        [
            "data.max_seq_len=64",
            "data.max_prompt_len=32",
            "data.overlong_prompts=error",
            "data.phase_split=[1,0,0]",  # every row is an SFT row
        ],
        ["{path}", "word0 word1", "tokens, longer than data.max_prompt_len=32"],
    ),
    (
        "smaller-than-a-batch",
        lambda: _jsonl(_rows(200)),
        ["optim.micro_batch_size=64"],
        # the recipe's check: it counts the rows after the phase split, blended over sources
        ["the SFT phase has 36 training rows, fewer than one global batch (64", "micro_batch_size"],
    ),
]


@pytest.mark.parametrize(
    ("content", "extra", "named"), [d[1:] for d in DATA], ids=[d[0] for d in DATA]
)
def test_bad_data_file_is_refused_before_the_model(content, extra, named, tmp_path, cache_dir):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(content())
    overrides = ["step=sft", "data=local", f"data.sources.local.path={path}", *LOCAL_FAST, *extra]
    _refused(overrides, tmp_path, cache_dir, [n.format(path=path) for n in named])


def test_data_error_under_step_all_stops_in_the_first_step(tmp_path, cache_dir):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b"")
    overrides = ["data=local", f"data.sources.local.path={path}", *LOCAL_FAST]
    _refused(overrides, tmp_path, cache_dir, [str(path), "sft phase's train split"])


# --- over-long prompts: truncate (default) and skip log their count --------------------------------


def _data(path: Path, cache: Path, **fields) -> DataConfig:
    source = SourceConfig(adapter="local", path=str(path), eval_split=None)
    base = dict(max_seq_len=64, max_prompt_len=32, cache_dir=str(cache), phase_split=[1, 0, 0])
    return DataConfig(sources={"local": source}, **{**base, **fields})


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)


@pytest.mark.parametrize("policy", ["truncate", "skip"])
def test_overlong_prompts_are_counted(policy, tmp_path, tokenizer, caplog):
    path = tmp_path / "pairs.jsonl"
    rows = _rows(40)
    for i in (0, 10, 20, 30):
        rows[i]["prompt"] = "\n\nHuman: " + " ".join(f"w{j}" for j in range(40)) + "?\n\nAssistant:"
    path.write_bytes(_jsonl(rows))
    data = _data(path, tmp_path / "cache", overlong_prompts=policy)
    eot = tokenizer.eos_token_id
    with caplog.at_level(logging.INFO, logger="rlhf.data.pipeline"):
        out = [
            r
            for s in ("train", "eval")
            for r in pipeline.phase_dataset(data, "sft", s, tokenizer, eot)
        ]
    counted = [
        r.getMessage()
        for r in caplog.records
        if "longer than data.max_prompt_len=32" in r.getMessage()
    ]
    assert counted, caplog.text
    cut = sum(int(m.split(" of ")[0].rsplit(" ", 1)[1]) for m in counted)
    assert cut == 4
    assert all(len(r["prompt_ids"]) <= 32 for r in out)
    assert len(out) == (40 if policy == "truncate" else 36)
    assert all(f"data.overlong_prompts={policy}" in m for m in counted)
    assert ("skipped" if policy == "skip" else "left-truncated") in counted[0]
    assert list(out[0]) == ["prompt", "task", "prompt_ids", "chosen_ids", "rejected_ids"]


def test_overlong_policy_is_part_of_the_cache_key(tmp_path, tokenizer):
    keys = {
        pipeline.cache_key(
            _data(tmp_path / "x.jsonl", tmp_path, overlong_prompts=p), "sft", "train", tokenizer, 2
        )
        for p in ("truncate", "skip", "error")
    }
    assert len(keys) == 3


def test_overlong_policy_is_validated():
    for ok in ("truncate", "skip", "error"):
        assert "overlong_prompts" not in [p[0] for p in DataConfig(overlong_prompts=ok).problems()]
    problems = DataConfig(overlong_prompts="cut").problems()
    assert ("overlong_prompts", "cut", "one of truncate, skip, error") in problems


def test_source_errors_are_config_errors():
    """So __main__ prints them as 'error: ...' and exits 2, like any config error."""
    assert issubclass(SourceError, ConfigError)


# --- bad models: reward model as actor, no config.json, mismatched or missing tokenizer -----------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny save_pretrained directories: a causal LM and a reward model with the shipped
    tokenizer (1280 tokens), a causal LM with 256 embeddings and no tokenizer, an empty dir."""
    root = tmp_path_factory.mktemp("models")
    tok = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    arch = dict(
        hidden_size=16,
        word_embed_proj_dim=16,
        num_hidden_layers=1,
        ffn_dim=32,
        num_attention_heads=2,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    dirs = {name: root / name for name in ("sft", "reward", "small", "empty")}
    OPTForCausalLM(OPTConfig(vocab_size=1280, **arch)).save_pretrained(dirs["sft"])
    tok.save_pretrained(dirs["sft"])
    OPTForSequenceClassification(OPTConfig(vocab_size=1280, num_labels=1, **arch)).save_pretrained(
        dirs["reward"]
    )
    tok.save_pretrained(dirs["reward"])
    OPTForCausalLM(OPTConfig(vocab_size=256, **arch)).save_pretrained(dirs["small"])
    dirs["empty"].mkdir()
    return dirs


MODELS = [
    # id, overrides (with {name} for a model dir), what the message must name
    (
        "reward-model-as-actor",
        ["step=ppo", "actor.model.path={reward}", "critic.model.path={reward}"],
        ["actor.model.path={reward}", "OPTForSequenceClassification", "critic.model.path"],
    ),
    (
        "reward-model-as-sft-base",
        ["step=sft", "model.path={reward}"],
        ["model.path={reward}", "OPTForSequenceClassification", "causal LM"],
    ),
    (
        "reward-model-as-gold-policy",
        ["step=reward", "model.path={sft}", "reward.gold_policy={reward}"],
        ["reward.gold_policy={reward}", "OPTForSequenceClassification"],
    ),
    (
        "no-config-json",
        ["step=ppo", "actor.model.path={sft}", "critic.model.path={empty}"],
        ["critic.model.path={empty}", "no config.json"],
    ),
    (
        "tokenizer-of-another-model",
        ["step=sft", "model.path={small}", f"model.tokenizer={TINY_TOKENIZER_DIR}"],
        [f"model.tokenizer={TINY_TOKENIZER_DIR}", "model.path={small}", "1280 tokens", "256"],
    ),
    (
        "model-without-tokenizer",
        ["step=sft", "model.path={small}"],
        ["model.path={small}", "no tokenizer files", "model.tokenizer"],
    ),
    (
        "impossible-ppo-batch",
        [
            "step=ppo",
            "actor.model.path={sft}",
            "critic.model.path={sft}",
            "ppo.per_device_training_batch_size=3",
        ],
        ["ppo.per_device_training_batch_size=3", "(32)"],
    ),
    (
        "bad-overlong-policy",
        ["step=sft", "data.overlong_prompts=cut"],
        ["data.overlong_prompts='cut'"],
    ),
]


@pytest.mark.parametrize(
    ("overrides", "named"), [m[1:] for m in MODELS], ids=[m[0] for m in MODELS]
)
def test_bad_model_or_setting_is_refused_before_loading(
    overrides, named, model_dirs, tmp_path, cache_dir
):
    dirs = {k: str(v) for k, v in model_dirs.items()}
    _refused(
        [o.format(**dirs) for o in overrides] + FAST,
        tmp_path,
        cache_dir,
        [n.format(**dirs) for n in named],
    )


def test_preflight_accepts_matching_models(model_dirs):
    from rlhf.config import Config

    cfg = Config()
    cfg.step.name = "ppo"
    cfg.actor.model.path = str(model_dirs["sft"])
    cfg.critic.model.path = str(model_dirs["sft"])  # a causal LM as critic: it gets a new head
    assert preflight.model_problems(cfg) == []
    cfg.critic.model.path = str(model_dirs["reward"])
    assert preflight.model_problems(cfg) == []
    cfg.actor.model.path = "facebook/opt-125m"  # hub ids are not checked offline
    assert preflight.model_problems(cfg) == []


def test_vocab_problem_is_pure_and_names_both_paths():
    assert preflight.vocab_problem("model.path", "/m", "/t", 1000, 1000) is None
    message = preflight.vocab_problem("actor.model.path", "/m", "/t", 32000, 50272)
    assert message is None  # a smaller tokenizer indexes only existing rows
    message = preflight.vocab_problem("actor.model.path", "/m", "/t", 50265, 32000)
    assert "actor.model.tokenizer=/t" in message and "actor.model.path=/m" in message
    assert "50265" in message and "32000" in message


# --- safety ---------------------------------------------------------------------------------------


def test_trust_remote_code_is_off_unless_configured(monkeypatch, tmp_path):
    """Every loader in rlhf.models passes model.trust_remote_code (default false)."""
    assert ModelConfig().trust_remote_code is False
    calls = []

    def record(name):
        def from_pretrained(*args, **kwargs):
            calls.append((name, kwargs.get("trust_remote_code")))
            raise RuntimeError("recorded")

        return from_pretrained

    for cls in ("AutoTokenizer", "AutoConfig", "AutoModelForCausalLM"):
        monkeypatch.setattr(getattr(models, cls), "from_pretrained", record(cls))
    monkeypatch.setattr(
        models.AutoModelForSequenceClassification, "from_pretrained", record("AutoModelForSeqCls")
    )
    path = str(tmp_path)
    for flag in (False, True):
        model = ModelConfig(path=path, trust_remote_code=flag)
        with pytest.raises(RuntimeError):
            models.load_tokenizer(model, path)
        with pytest.raises(RuntimeError):
            models.model_config(model, path)
        with monkeypatch.context() as m:  # past the config, to the weights
            m.setattr(models, "model_config", lambda *_: OPTConfig())
            with pytest.raises(RuntimeError):
                models.load_causal_lm(model, path, None, "fp32")
            with pytest.raises(RuntimeError):
                models.load_value_model(model, path, SimpleNamespace(pad_token_id=1), "fp32")
    names = ["AutoTokenizer", "AutoConfig", "AutoModelForCausalLM", "AutoModelForSeqCls"]
    assert calls == [(n, False) for n in names] + [(n, True) for n in names]


def test_api_keys_never_reach_the_run_dir(tmp_path, cache_dir):
    """A W&B key and other secrets in the environment: not in .hydra/, metrics, summary, logs,
    W&B's offline files or checkpoints. The export is safetensors (no pickle)."""
    secrets = {
        "WANDB_API_KEY": "0123456789abcdef0123456789abcdefSECRETWB",
        "HF_TOKEN": "hf_SECRETHFTOKENabcdefghijklmnopqrstuv",
        "MY_SERVICE_SECRET": "SECRETSERVICEVALUE42",
        "WANDB_MODE": "offline",
    }
    run_dir = tmp_path / "run"
    proc = run_rlhf(
        [
            "step=sft",
            "logger=wandb",
            "logger.mode=offline",
            "step.max_steps=2",
            *FAST,
            *cache_overrides(cache_dir),
        ],
        run_dir=run_dir,
        extra_env={**secrets, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert (run_dir / ".hydra" / "config.yaml").exists() and (run_dir / "metrics.jsonl").exists()
    assert (run_dir / "summary.json").exists() and any("wandb" in p.parts for p in files)
    for name, value in secrets.items():
        if name == "WANDB_MODE":
            continue
        assert value not in proc.stdout + proc.stderr, f"{name} printed"
        leaked = [str(p) for p in files if value.encode() in p.read_bytes()]
        assert not leaked, f"{name} written to {leaked}"
    exported = {p.name for p in (run_dir / "model").iterdir()}
    assert "model.safetensors" in exported
    assert not {n for n in exported if n.endswith((".bin", ".pt", ".pkl"))}

"""Bad input, as docs/bad_input.md tables it: each bad config, data file or model directory gives
one ``error: ...`` message naming the key, file (and line), exit status 2, no traceback, and
nothing trained or exported. The config cases Hydra and validation already refuse are in
tests/test_cli.py; these are the rest. Also the safety rules: trust_remote_code is off unless
configured, exports are safetensors, and API keys never reach the run directory."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM, OPTForSequenceClassification

from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.checks import lengths, validate
from rlhf.checks import model_dirs as model_checks
from rlhf.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    SourceConfig,
    register_configs,
    unknown_keys,
)
from rlhf.data import prepare
from rlhf.data.sources import SourceError
from rlhf.modeling import loading
from tests.conftest import FAST, cache_overrides, run_rlhf

register_configs()  # the schema, for the tests that compose in-process
NO_TRACE = {"HYDRA_FULL_ERROR": "0"}
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
    with caplog.at_level(logging.INFO, logger="rlhf.data.prepare"):
        out = [
            r
            for s in ("train", "eval")
            for r in prepare.phase_dataset(data, "sft", s, tokenizer, eot)
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
    assert list(out[0]) == ["prompt", "source", "task", "prompt_ids", "chosen_ids", "rejected_ids"]
    assert out[0]["source"] == "local"  # the data.sources key (the reward eval's per-source split)


def test_overlong_policy_is_part_of_the_cache_key(tmp_path, tokenizer):
    keys = {
        prepare.cache_key(
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
        "sft-export-as-reward-model",
        ["step=ppo", "actor.model.path={sft}", "critic.model.path={sft}"],
        ["critic.model.path={sft}", "a causal LM (OPTForCausalLM", "not a reward model"],
    ),
    (
        "sft-export-as-reward-model-path",
        [
            "step=ppo",
            "actor.model.path={sft}",
            "critic.model.path={sft}",
            "critic.reward_model_path={sft}",
        ],
        ["critic.reward_model_path={sft}", "a causal LM (OPTForCausalLM", "ppo.reward.function"],
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
            "critic.model.path={reward}",
            "ppo.update.per_device_batch_size=3",
        ],
        ["ppo.update.per_device_batch_size=3", "(32)"],
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
    cfg.critic.model.path = str(model_dirs["reward"])
    assert model_checks.model_problems(cfg) == []
    cfg.critic.model.path = str(model_dirs["sft"])  # a causal LM as critic: it gets a new head
    cfg.critic.reward_model_path = str(model_dirs["reward"])  # ...and the reward model scores
    assert model_checks.model_problems(cfg) == []
    cfg.critic.reward_model_path = None
    cfg.ppo.reward.function = "toy_gold"  # ...or a rule scores
    assert model_checks.model_problems(cfg) == []
    cfg.ppo.reward.function, cfg.critic.model.path = None, str(model_dirs["reward"])
    cfg.actor.model.path = "facebook/opt-125m"  # hub ids are not checked offline
    assert model_checks.model_problems(cfg) == []


def test_vocab_problem_is_pure_and_names_both_paths():
    assert model_checks.vocab_problem("model.path", "/m", "/t", 1000, 1000) is None
    message = model_checks.vocab_problem("actor.model.path", "/m", "/t", 32000, 50272)
    assert message is None  # a smaller tokenizer indexes only existing rows
    message = model_checks.vocab_problem("actor.model.path", "/m", "/t", 50265, 32000)
    assert "actor.model.tokenizer=/t" in message and "actor.model.path=/m" in message
    assert "50265" in message and "32000" in message


# --- safety ---------------------------------------------------------------------------------------


def test_trust_remote_code_is_off_unless_configured(monkeypatch, tmp_path):
    """Every loader in rlhf.modeling.loading passes model.trust_remote_code (default false)."""
    assert ModelConfig().trust_remote_code is False
    calls = []

    def record(name):
        def from_pretrained(*args, **kwargs):
            calls.append((name, kwargs.get("trust_remote_code")))
            raise RuntimeError("recorded")

        return from_pretrained

    for cls in ("AutoTokenizer", "AutoConfig", "AutoModelForCausalLM"):
        monkeypatch.setattr(getattr(loading, cls), "from_pretrained", record(cls))
    monkeypatch.setattr(
        loading.AutoModelForSequenceClassification, "from_pretrained", record("AutoModelForSeqCls")
    )
    path = str(tmp_path)
    for flag in (False, True):
        model = ModelConfig(path=path, trust_remote_code=flag)
        with pytest.raises(RuntimeError):
            loading.load_tokenizer(model, path)
        with pytest.raises(RuntimeError):
            loading.model_config(model, path)
        with monkeypatch.context() as m:  # past the config, to the weights
            m.setattr(loading, "model_config", lambda *_: OPTConfig())
            with pytest.raises(RuntimeError):
                loading.load_causal_lm(model, path, None, "fp32")
            with pytest.raises(RuntimeError):
                loading.load_value_model(model, path, SimpleNamespace(pad_token_id=1), "fp32")
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
        extra_env=secrets,
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


# --- issue 18: a user's own data and a user's mistakes ---------------------------------------------


def _run_dir_files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_lengths_past_the_models_positions_are_cut_to_fit(tmp_path, cache_dir):
    """data=local keeps DeepSpeed-Chat's 512-token rows, more than the embedded model's 256
    positions: the run cuts the lengths (with a line saying so) instead of an IndexError."""
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")  # the data step then stops the run: nothing trains
    proc = run_rlhf(
        [
            "step=sft",
            "data=local",
            f"data.sources.local.path={path}",
            *LOCAL_FAST,
            *cache_overrides(cache_dir),
        ],
        run_dir=tmp_path / "run",
        check=False,
        timeout=300,
        extra_env=NO_TRACE,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "the model has 256 positions (model.init.max_position_embeddings=256" in output
    assert "data.max_seq_len 512 -> 256, data.max_prompt_len 256 -> 128" in output
    saved = (tmp_path / "run" / ".hydra" / "config.yaml").read_text()
    assert "max_seq_len: 256" in saved and "max_prompt_len: 128" in saved  # what ran


def test_fitted_lengths_keep_answers_within_the_positions(model_dirs):
    from rlhf.config import Config

    config = Config()
    config.data.max_seq_len, config.data.max_prompt_len = 512, 256
    assert lengths.positions(config) == (
        256,
        "model.init.max_position_embeddings=256, the embedded model",
    )
    assert lengths.fitted_lengths(config, 256) == {
        "data.max_seq_len": 256,
        "data.max_prompt_len": 128,
    }
    # the gold evaluation of a task's prompts generates after the prompt: its answer is cut too
    config.data.sources = {"toy": SourceConfig(adapter="toy", num_rows=100)}
    config.sft.gen_max_new_tokens = 200
    assert lengths.fitted_lengths(config, 256)["sft.gen_max_new_tokens"] == 128
    config.step.name = "ppo"
    config.actor.model.path = config.critic.model.path = str(model_dirs["sft"])
    config.ppo.rollout.max_new_tokens = 4000
    known = lengths.positions(config)
    assert known[0] == 2048 and "config.json of actor.model.path=" in known[1]
    assert lengths.fitted_lengths(config, known[0]) == {"ppo.rollout.max_new_tokens": 2048 - 256}


def test_the_readmes_prompt_template_gives_real_newlines(tmp_path):
    """The README's command passes the template as Hydra does: backslash-n, two characters."""
    from rlhf.data.sources import load_source
    from tests.conftest import compose

    path = tmp_path / "pairs.jsonl"
    path.write_bytes(
        _jsonl([{"question": f"Q{i}?", "good": "Yes.", "bad": "No."} for i in range(10)])
    )
    cfg = compose(
        [
            "data=local",
            f"data.sources.local.path={path}",
            "data.sources.local.columns={prompt: question, chosen: good, rejected: bad}",
            'data.sources.local.prompt_template="\\n\\nHuman: {prompt}\\n\\nAssistant:"',
        ]
    )
    assert cfg.data.sources.local.prompt_template.startswith("\\n\\nHuman:")  # as typed
    source = validate.validated(cfg).data.sources["local"]
    prompts = load_source(source, "train", 0).rows["prompt"]
    assert all(p.startswith("\n\nHuman: Q") and p.endswith("?\n\nAssistant:") for p in prompts)


def test_an_added_key_the_schema_does_not_know_is_refused(tmp_path, cache_dir):
    """+step.max_step=5 used to run the whole training; Hydra's own hint says to add the +."""
    message = _refused(["step=sft", "+step.max_step=5", *FAST], tmp_path, cache_dir, [])
    assert message == (
        "error: +step.max_step=5: no such key; the closest known key is step.max_steps"
    )


def test_unknown_keys_in_a_composed_config_name_the_closest(tmp_path):
    from tests.conftest import compose

    with pytest.raises(ConfigError) as err:
        validate.validated(compose(["+ppo.kl_coeff=0.2", "++data.max_seq_length=64"]))
    lines = str(err.value).splitlines()
    assert "  ppo.kl_coeff: no such key; the closest known key is ppo.kl.coef" in lines
    assert "  data.max_seq_length: no such key; the closest known key is data.max_seq_len" in lines
    # a free name under a dict of the schema (OPTConfig arguments) is a known key
    assert unknown_keys(compose(["+model.init.layerdrop=0.0"])) == []


def _checkpoint_of(run_dir: Path, overrides: list[str]) -> Path:
    """A run dir holding a checkpoint made under ``overrides`` (only its config.json: the
    refusal must come before anything is loaded) and a .hydra/ record."""
    import dataclasses

    from tests.conftest import compose

    made_under = dataclasses.asdict(validate.validated(compose(overrides)))
    step = run_dir / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    from rlhf.runtime.manifest import Part

    part = Part(step)
    part.write_text(step / "config.json", json.dumps(made_under))
    part.write(0, 1)  # as a checkpoint's last file
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text("the other run's config\n")
    return step


def test_resuming_a_run_made_under_another_config_is_refused(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    step = _checkpoint_of(run_dir, ["step=sft", "optim.lr=0.005", *FAST])
    before = _run_dir_files(run_dir)
    proc = run_rlhf(
        ["step=sft", *FAST, *cache_overrides(cache_dir)],
        run_dir=run_dir,
        check=False,
        timeout=300,
        extra_env=NO_TRACE,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    [message] = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert message.startswith(f"error: resume=auto: {step} was made under another config ")
    # 0.002: SFT's own lr (conf/step/sft.yaml)
    assert "optim.lr: 0.005 there, 0.002 here" in message and "resume=force" in message
    after = _run_dir_files(run_dir)
    # the refusal is made under the run dir's lock, so only the (empty) lock file is new
    kept = {k: v for k, v in after.items() if not k.endswith(".log") and k != ".run.lock"}
    assert kept == before  # .hydra/ too


def test_what_a_resumed_run_may_change():
    from rlhf.runtime import resume

    # saved before PPO's keys were nested (ppo.eval.samples): read as ppo.eval.samples
    saved = {"optim": {"lr": 0.001}, "step": {"log_interval": 10}, "ppo": {"eval_samples": 4}}
    same = {"optim": {"lr": 0.001}, "step": {"log_interval": 1}, "ppo": {"eval": {"samples": 8}}}
    assert resume.config_differences(saved, same) == []
    other = {**same, "optim": {"lr": 0.01}, "seed": 7}
    assert resume.config_differences(saved, other) == [
        "optim.lr: 0.001 there, 0.01 here",
        "seed: '(absent)' there, 7 here",
    ]
    # a key added since the checkpoint (absent there) matches at its default, not otherwise;
    # sweep.* may change on a resume
    added = {**same, "deterministic": False, "sweep": {"objective": ["eval/loss"]}}
    assert resume.config_differences(saved, added) == []
    assert resume.config_differences(saved, {**same, "deterministic": True}) == [
        "deterministic: '(absent)' there, True here"
    ]
    # a checkpoint written before actor.twin_path became actor.reference_path still resumes
    renamed = {"actor": {"twin_path": "/ref"}}
    assert resume.config_differences(renamed, {"actor": {"reference_path": "/ref"}}) == []


def test_resume_force_continues_whatever_the_config(tmp_path):
    from rlhf.runtime import resume

    _checkpoint_of(tmp_path, ["step=sft", "optim.lr=0.002"])
    current = {"optim": {"lr": 0.001}}
    assert resume.resume_problem(tmp_path, "auto", current)
    assert resume.resume_problem(tmp_path, "force", current) is None
    assert resume.resume_point(tmp_path, "force") == tmp_path / "checkpoints" / "step-00000002"


def test_offload_at_zero_stage_0_is_refused(tmp_path, cache_dir):
    message = _refused(["step=sft", "zero.offload=true", *FAST], tmp_path, cache_dir, [])
    assert "zero.offload=True: expected false at zero.stage=0" in message
    assert "stages 1-3" in message


def test_a_stale_build_lock_is_found_and_a_live_one_left_alone(tmp_path):
    import os
    import subprocess
    import time

    from rlhf.runtime import engine

    build = tmp_path / "cpu_adam"
    build.mkdir()
    assert engine.cpu_adam_lock_problem("zero.offload", build) is None  # no lock
    lock = build / "lock"
    lock.write_text("")
    assert engine.cpu_adam_lock_problem("zero.offload", build) is None  # fresh: someone builds
    two_hours_ago = time.time() - 7200
    os.utime(lock, (two_hours_ago, two_hours_ago))
    problem = engine.cpu_adam_lock_problem("actor.zero.offload", build)
    assert problem.startswith("actor.zero.offload=true: DeepSpeed's CPU Adam would wait forever")
    assert f"rm {lock}" in problem and "120 min ago" in problem
    builder = subprocess.Popen(["sleep", "30"], cwd=build)  # a compiler at work in the directory
    try:
        assert engine.cpu_adam_lock_problem("zero.offload", build) is None
    finally:
        builder.kill()
        builder.wait()


def test_an_offload_run_stops_at_a_stale_build_lock_instead_of_hanging(tmp_path, cache_dir):
    """An interrupted first build left its lock: torch would wait on it without end when
    DeepSpeed loads its CPU Adam. The run says where the lock is before building anything."""
    import os
    import time

    lock = tmp_path / "extensions" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    two_hours_ago = time.time() - 7200
    os.utime(lock, (two_hours_ago, two_hours_ago))
    proc = run_rlhf(
        ["step=sft", "zero=stage1", "zero.offload=true", *FAST, *cache_overrides(cache_dir)],
        run_dir=tmp_path / "run",
        check=False,
        timeout=240,  # a hang fails here
        extra_env={**NO_TRACE, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    expected = (
        f"error: zero.offload=true: DeepSpeed's CPU Adam would wait forever on the build lock "
        f"{lock}, left MINUTES min ago by a build that did not finish (no process is building it "
        f"now); remove it (rm {lock}) and run again"
    )
    pattern = re.escape(expected).replace("MINUTES", "12[01]")  # the run's own seconds
    assert re.fullmatch(pattern, proc.stderr.strip()), proc.stderr
    assert lock.exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_the_cpu_collectives_build_is_announced_and_a_stale_lock_refused(tmp_path, monkeypatch):
    """On CPU, DeepSpeed compiles its shared-memory collectives when the process group starts:
    a line first, and a lock an interrupted build left is an error instead of a hang."""
    import os
    import time

    from rlhf.runtime import engine

    real = engine.shm_comm_build_dir()  # DS_ACCELERATOR=cpu: torch's build directory for them
    assert real is None or (real.name, real.parent) == (
        "deepspeed_shm_comm",
        engine.cpu_adam_build_dir().parent,
    )
    monkeypatch.setattr(engine, "shm_comm_build_dir", lambda: tmp_path)
    note = engine.shm_comm_build_note("cpu")
    assert note == (
        "building DeepSpeed's shared-memory collectives (CPU), first time only (about a minute) "
        f"in {tmp_path}"
    )
    assert engine.shm_comm_build_note("cuda") is None
    (tmp_path / "deepspeed_shm_comm.so").write_bytes(b"")
    assert engine.shm_comm_build_note("cpu") is None  # built before: nothing to say
    lock = tmp_path / "lock"
    lock.write_text("")
    assert engine.shm_comm_build_note("cpu") is None  # fresh: another run is building
    two_hours_ago = time.time() - 7200
    os.utime(lock, (two_hours_ago, two_hours_ago))
    with pytest.raises(ConfigError) as err:
        engine.shm_comm_build_note("cpu")
    assert str(err.value).startswith(
        f"device=cpu: DeepSpeed's shared-memory collectives (CPU) would wait forever on the "
        f"build lock {lock}, left 120 min ago"
    )
    assert str(err.value).endswith(f"remove it (rm {lock}) and run again")


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_run_stops_at_a_stale_collectives_lock_instead_of_hanging(nproc, tmp_path, cache_dir):
    import os
    import time

    lock = tmp_path / "extensions" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    two_hours_ago = time.time() - 7200
    os.utime(lock, (two_hours_ago, two_hours_ago))
    proc = run_rlhf(
        ["step=sft", *FAST, *cache_overrides(cache_dir)],
        run_dir=tmp_path / "run",
        nproc=nproc,
        check=False,
        timeout=240,  # a hang fails here
        extra_env={**NO_TRACE, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")},
    )
    assert proc.returncode != 0, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors and set(errors) == {errors[0]}, proc.stderr[-3000:]  # every rank says it
    assert errors[0].startswith(
        f"error: device=cpu: DeepSpeed's shared-memory collectives (CPU) would wait forever on "
        f"the build lock {lock}, left 12"
    )
    if nproc == 1:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert lock.exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_the_first_cpu_adam_build_is_announced(tmp_path, monkeypatch, caplog):
    from rlhf.runtime import engine

    monkeypatch.setattr(engine, "cpu_adam_build_dir", lambda: tmp_path)
    with caplog.at_level(logging.INFO, logger="rlhf.runtime.engine"):
        engine.announce_cpu_adam_build()
    assert "building DeepSpeed's CPU Adam, first time only" in caplog.text
    caplog.clear()
    (tmp_path / "cpu_adam.so").write_bytes(b"")  # built before: nothing to say
    with caplog.at_level(logging.INFO, logger="rlhf.runtime.engine"):
        engine.announce_cpu_adam_build()
    assert "building" not in caplog.text


OFFLINE = {**NO_TRACE, "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["step=ppo", "actor.model.path=mysft/model", "critic.model.path={reward}"],
            "error: actor.model.path='mysft/model': not a local directory, and the hub is not "
            "reachable (offline)",
        ),
        (
            ["step=sft", "data=rm-static", "data.sources.rm-static.path=nobody/no-such-dataset"],
            "error: data.sources.rm-static.path='nobody/no-such-dataset': not a local directory, "
            "and the hub is not reachable (offline)",
        ),
    ],
    ids=["model", "dataset"],
)
def test_a_hub_id_offline_is_one_line(overrides, message, model_dirs, tmp_path, cache_dir):
    dirs = {k: str(v) for k, v in model_dirs.items()}
    proc = run_rlhf(
        [*(o.format(**dirs) for o in overrides), *LOCAL_FAST, *cache_overrides(cache_dir)],
        run_dir=tmp_path / "run",
        check=False,
        timeout=300,
        extra_env=OFFLINE,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip() == message


def test_top_level_model_values_in_ppo(model_dirs, tmp_path, cache_dir):
    """step=ppo reads actor.model / critic.model: model.dtype (and the other ways to run a
    model) reach both; model.path names one model and is refused with the keys to use."""
    from tests.conftest import compose

    sft, reward = str(model_dirs["sft"]), str(model_dirs["reward"])
    roles = [f"actor.model.path={sft}", f"critic.model.path={reward}"]
    config = validate.validated(compose(["step=ppo", "model.dtype=bf16", *roles]))
    assert (config.actor.model.dtype, config.critic.model.dtype) == ("bf16", "bf16")
    own = validate.validated(
        compose(["step=ppo", "model.dtype=bf16", "critic.model.dtype=fp32", *roles])
    )
    assert (own.actor.model.dtype, own.critic.model.dtype) == ("bf16", "fp32")
    message = _refused(["step=ppo", f"model.path={sft}", *roles, *FAST], tmp_path, cache_dir, [])
    assert message == (
        f"error: model.path={sft}: step=ppo does not read model.path: the actor and the critic "
        "each have one (actor.model.path, critic.model.path); set those"
    )


def test_online_wandb_without_a_key_is_one_line(tmp_path, cache_dir, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    env = {**NO_TRACE, "HOME": str(tmp_path)}  # no ~/.netrc login either
    proc = run_rlhf(
        ["step=sft", "logger=wandb", "logger.mode=online", *FAST, *cache_overrides(cache_dir)],
        run_dir=tmp_path / "run",
        check=False,
        timeout=300,
        extra_env=env,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().startswith(
        "error: logger.mode=online: no W&B API key (WANDB_API_KEY, or `wandb login`)"
    )


def test_online_wandb_with_a_server_that_does_not_answer_is_one_line(tmp_path, cache_dir):
    closed = f"http://127.0.0.1:{_closed_port()}"
    env = {**NO_TRACE, "HOME": str(tmp_path), "WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": closed}
    proc = run_rlhf(
        ["step=sft", "logger=wandb", "logger.mode=online", *FAST, *cache_overrides(cache_dir)],
        run_dir=tmp_path / "run",
        check=False,
        timeout=300,
        extra_env=env,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: logger.mode=online: the W&B server {closed} does not answer (")
    assert "logger.mode=offline" in line and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_server_that_answers_any_status_is_reachable():
    import http.server
    import threading

    from rlhf.tracking.wandb_run import unreachable

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.handle_request, daemon=True).start()
    try:  # BaseHTTPRequestHandler answers 501 to a GET: an answer all the same
        assert unreachable(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=5) is None
    finally:
        server.server_close()
    assert unreachable("http://127.0.0.1:" + str(_closed_port()), timeout_s=5) is not None


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_zero_phase_split_says_not_all_zero():
    problems = DataConfig(phase_split=[0, 0, 0]).problems()
    [(key, value, accepted)] = [p for p in problems if p[0] == "phase_split"]
    assert (key, value) == ("phase_split", [0, 0, 0]) and "not all zero" in accepted


# --- a full disk: one line with the space needed; nothing half-written is left --------------------


def _enospc() -> OSError:
    import errno

    return OSError(errno.ENOSPC, "No space left on device")


def _safetensors_enospc() -> Exception:
    """What save_pretrained raises on a real full disk: safetensors' own type, not an OSError."""
    from safetensors import SafetensorError

    return SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )


@pytest.mark.parametrize(
    "full_disk", [_enospc, _safetensors_enospc], ids=["oserror", "safetensors"]
)
def test_a_full_disk_at_the_export_leaves_the_old_export_intact(tmp_path, full_disk):
    from rlhf.modeling.export import ExportError, export_pretrained

    tok = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    config = OPTConfig(
        vocab_size=1280, hidden_size=16, word_embed_proj_dim=16, num_hidden_layers=1,
        ffn_dim=32, num_attention_heads=2,
    )  # fmt: skip
    out = tmp_path / "model"
    export_pretrained(OPTForCausalLM(config), 0, lambda: OPTForCausalLM(config), tok, out)
    before = _run_dir_files(out)
    (tmp_path / "model.tmp999").mkdir()  # a killed run's leftover

    def full_disk_copy():
        copy = OPTForCausalLM(config)

        def save_pretrained(path, **kwargs):
            Path(path).mkdir()
            (Path(path) / "model.safetensors").write_bytes(b"partial")
            raise full_disk()

        copy.save_pretrained = save_pretrained
        return copy

    with pytest.raises(ExportError) as err:
        export_pretrained(OPTForCausalLM(config), 0, full_disk_copy, tok, out)
    message = str(err.value)
    assert message.startswith(f"export to {out} failed: no space left on device at {tmp_path} (")
    assert "needed" in message and f"{out} is unchanged" in message
    assert _run_dir_files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no model.tmp* left


def test_a_full_disk_at_a_checkpoint_says_so(tmp_path, monkeypatch):
    from rlhf.runtime import checkpoint, files
    from rlhf.runtime.manifest import Part

    previous = tmp_path / "checkpoints" / "step-00000001"
    previous.mkdir(parents=True)
    (previous / "trainer.pt").write_bytes(b"x" * 5000)
    part = Part(previous)
    part.add(previous / "trainer.pt")
    part.write(0, 1)

    def short_write(*args, **kwargs):  # what torch's zip writer raises on a full disk
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(checkpoint.torch, "save", short_write)
    monkeypatch.setattr(files, "free_space", lambda path: 12_000)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save(tmp_path, 2, {}, {}, keep=2)
    message = str(err.value)
    assert "no space left on device at " in message and "unexpected pos" not in message
    needed = files.human_size(files.dir_size(previous))  # its trainer.pt and manifest
    assert f"(12.0 KB free; about {needed} needed)" in message
    assert f"the previous checkpoint {previous} is intact" in message
    assert not (tmp_path / "checkpoints" / ".tmp-step-00000002").exists()


def test_a_full_disk_at_the_first_checkpoint_counts_the_space_freed(tmp_path, monkeypatch):
    """No previous checkpoint: what was written before the disk filled is the least needed, and
    the free space is what the user has once the temporary directory is gone."""
    from rlhf.runtime import checkpoint, files

    tmp = tmp_path / "checkpoints" / ".tmp-step-00000001"

    def write_then_fail(obj, stream, *args, **kwargs):  # the checkpoint's hashing stream
        stream.write(b"x" * 4000)
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(checkpoint.torch, "save", write_then_fail)
    monkeypatch.setattr(files, "free_space", lambda path: 10_000 - files.dir_size(tmp))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save(tmp_path, 1, {}, {}, keep=2)
    assert "(10.0 KB free; at least 4.0 KB needed)); there is no earlier checkpoint" in str(
        err.value
    )
    assert not tmp.exists()


def test_a_resumed_run_logs_its_final_evaluation_once(tmp_path):
    """The final evaluation runs after the last checkpoint; when the export then fails, the
    rerun evaluates again: the first one's row is dropped, not kept beside the second."""
    from rlhf.config import LoggerConfig
    from rlhf.tracking import Tracker

    def tracker(resume=None):
        return Tracker(tmp_path, LoggerConfig(), "sft", "run", {}, resume=resume)

    first = tracker()
    first.log({"train/loss": 1.0}, step=4)
    state = first.state(4)  # the checkpoint at step 4
    first.log({"eval/loss": 0.5}, step=4)  # the final evaluation, then the export fails
    first.close()
    second = tracker(resume=state)
    second.log({"eval/loss": 0.5}, step=4)
    second.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 4, "train/loss": 1.0}, {"step": 4, "eval/loss": 0.5}]
    # the other ranks' trackers write nothing, and their checkpoint state still says so
    idle = Tracker(tmp_path, LoggerConfig(), "sft", "run", {}, enabled=False)
    assert idle.state(4)["rows"] == {}

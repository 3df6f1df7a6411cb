"""rlhf.config.resolve: every null / auto value decided in one pass before any model is built,
one pure function per group; ``--cfg job`` prints the decided values, marking those read from
the model files; resolved.yaml lands in the run dir's checkpoints, in their manifest."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import yaml

from rlhf.config import Config, register_configs, to_config
from rlhf.config.resolve import (
    AUTO_KEYS,
    FROM_MODEL,
    Facts,
    ModelFacts,
    ResolvedValues,
    model_facts,
    resolve,
    resolve_dpo,
    resolve_lora,
    resolve_model,
    resolve_ppo,
    resolve_reward,
    resolve_sft,
    resolved_yaml,
)
from tests.conftest import compose, run_rlhf

register_configs()


def undecided(values: dict) -> list[str]:
    """The auto keys still null or auto (or an answer budget of 0: fill max_seq_len)."""
    out = [k for k in AUTO_KEYS if at(values, k) in (None, "auto")]
    return out + (
        ["ppo.rollout.max_new_tokens"] if at(values, "ppo.rollout.max_new_tokens") == 0 else []
    )


def at(values: dict, key: str):
    for part in key.split("."):
        values = values[part]
    return values


def config(*overrides: str) -> Config:
    return to_config(compose(list(overrides)))


# --- one pure function per group -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "bf16", "dtype", "expected"),
    [
        ("cpu", False, "auto", "fp32"),
        ("cuda", True, "auto", "bf16"),
        ("cuda", False, "auto", "fp16"),
        ("cpu", False, "bf16", "bf16"),  # set: kept
    ],
)
def test_model_dtype_auto_is_the_devices(device, bf16, dtype, expected):
    model = config(f"model.dtype={dtype}").model
    resolve_model(model, Facts(device=device, bf16=bf16))
    assert model.dtype == expected


def test_lora_learning_rate_null_is_the_groups_lr_and_dpo_reduction_the_losss():
    cfg = config("optim.lr=0.004", "lora.learning_rate=null")
    resolve_lora(cfg.lora, cfg.optim)
    assert cfg.lora.learning_rate == 0.004
    cfg = config("lora.learning_rate=0.5")
    resolve_lora(cfg.lora, cfg.optim)
    assert cfg.lora.learning_rate == 0.5
    for loss, reduction in (("ipo", "mean"), ("simpo", "mean"), ("sigmoid", "sum")):
        dpo = dataclasses.replace(config().dpo, loss=loss, reduction=None)
        resolve_dpo(dpo)
        assert dpo.reduction == reduction


def test_ppo_lengths_clips_and_reward_follow_their_sources():
    cfg = config(
        "data.max_seq_len=60",
        "data.max_prompt_len=20",
        "ppo.rollout.max_new_tokens=0",
        "ppo.reward.overlong_buffer=null",
        "ppo.loss.clip_range=0.3",
        "ppo.loss.clip_high=0.28",
        "ppo.reward.function=toy_gold",
    )
    resolve_ppo(cfg, Facts(aggregation="seq-mean-token-mean"))
    ppo = cfg.ppo
    assert (ppo.rollout.max_new_tokens, ppo.reward.overlong_buffer) == (40, 8)
    assert (ppo.loss.clip_low, ppo.loss.clip_high) == (0.3, 0.28)
    assert ppo.loss.aggregation == "seq-mean-token-mean"  # the registry's answer
    assert ppo.reward.normalize is False  # a rule's reward is used as is
    assert ppo.rollout.correction == "none"  # hf: the sampler is the trainer


def test_ppo_vllm_takes_tis_and_no_hf_decoding_shortcuts():
    cfg = config("ppo.rollout.engine=vllm")
    resolve_ppo(cfg, Facts())
    assert cfg.ppo.rollout.correction == "tis"
    assert cfg.ppo.rollout.drop_finished_rows is False
    assert cfg.ppo.rollout.logprobs is False  # vLLM's kernels are not the trainer's


def test_ppo_old_logprobs_from_the_sampler_in_fp32_else_the_on_policy_shortcut():
    fp32 = config("actor.model.dtype=fp32")
    resolve_ppo(fp32, Facts())
    assert (fp32.ppo.rollout.logprobs, fp32.ppo.update.on_policy_shortcut) == (True, False)
    on_policy = [
        "actor.model.dtype=bf16",
        "ppo.kl.in_loss=true",
        "ppo.rollout.per_device_batch_size=2",
        "ppo.update.per_device_batch_size=2",
    ]
    bf16 = config(*on_policy)
    resolve_ppo(bf16, Facts())
    assert (bf16.ppo.rollout.logprobs, bf16.ppo.update.on_policy_shortcut) == (False, True)
    full = config(*on_policy)
    resolve_ppo(full, Facts(kl_reads_logits=True))  # reads the actor's logits first
    assert full.ppo.update.on_policy_shortcut is False


def test_ppo_packing_comes_from_the_model_files_and_is_recorded():
    takes, refuses = ModelFacts(model_type="opt"), ModelFacts(block_mask_problem="a gpt2 model")
    cfg = config()
    assert resolve_ppo(cfg, Facts(models={"actor": takes, "reward": takes})) == {
        "ppo.update.packing"
    }
    assert cfg.ppo.update.packing is True
    cfg = config()
    resolve_ppo(cfg, Facts(models={"actor": takes, "reward": refuses}))
    assert cfg.ppo.update.packing is False
    cfg = config("ppo.update.packing=false")  # set: kept, not from the model files
    assert resolve_ppo(cfg, Facts(models={"actor": takes})) == set()
    assert cfg.ppo.update.packing is False


def test_resolve_is_pure_and_leaves_nothing_undecided():
    cfg = config()
    before = copy.deepcopy(cfg)
    tiny = model_facts(cfg.actor.model, None)
    resolved = resolve(cfg, Facts(models={"actor": tiny}, step_model=tiny))
    assert cfg == before  # the input is not changed
    values = dataclasses.asdict(resolved.config)
    assert undecided(values) == []
    assert resolved.from_model == {"ppo.update.packing", "sft.packing", "reward.share_prompt"}


def flat(values: dict, prefix: str = "") -> dict:
    if not isinstance(values, dict):
        return {prefix[:-1]: values}
    return {
        k: v for key, below in values.items() for k, v in flat(below, f"{prefix}{key}.").items()
    }


@pytest.mark.parametrize(
    "overrides",
    [[], ["data=toy_tools"], ["algo=grpo"], ["algo=dapo"], ["algo=dpo"], ["lora=r8"]],
    ids=["default", "toy_tools", "grpo", "dapo", "dpo", "lora"],
)
def test_the_resolver_decides_only_the_auto_keys(overrides):
    """AUTO_KEYS is every key resolve may change (a resumed run compares an older checkpoint's
    auto values through it: rlhf.runtime.resume), and each holds its auto value beforehand."""
    cfg = config(*overrides)
    facts = Facts(device="cuda", bf16=True)
    before, after = flat(dataclasses.asdict(cfg)), flat(dataclasses.asdict(resolve(cfg, facts)[0]))
    changed = {k for k in before if before[k] != after[k]}
    assert changed <= set(AUTO_KEYS), changed - set(AUTO_KEYS)
    assert all(before[k] == AUTO_KEYS[k] for k in changed if k not in ("ppo.rollout.logprobs",))


def test_sft_packing_and_the_shared_reward_prompt_follow_the_models_attention():
    takes = ModelFacts(model_type="opt")
    refuses = ModelFacts(model_type="gpt2", block_mask_problem="a gpt2 model ...")
    for step_model, expected in ((takes, True), (refuses, False)):
        cfg = config()
        assert resolve_sft(cfg, Facts(step_model=step_model)) == {"sft.packing"}
        assert resolve_reward(cfg, Facts(step_model=step_model)) == {"reward.share_prompt"}
        assert (cfg.sft.packing, cfg.reward.share_prompt) == (expected, expected)
    padded = config("data.pad_to_max_len=true")
    resolve_sft(padded, Facts(step_model=takes))
    resolve_reward(padded, Facts(step_model=takes))
    assert (padded.sft.packing, padded.reward.share_prompt) == (False, False)
    listwise = config("reward.loss=listwise")  # reads K answers' scores, not a pair's two
    resolve_reward(listwise, Facts(step_model=takes))
    assert listwise.reward.share_prompt is False
    unknown = config()  # a hub id not cached here: the step decides on the built model
    assert resolve_sft(unknown, Facts()) == resolve_reward(unknown, Facts()) == set()
    assert (unknown.sft.packing, unknown.reward.share_prompt) == (None, None)


def test_the_embedded_models_facts_come_from_its_config():
    facts = model_facts(config().model, None)
    assert (facts.model_type, facts.max_positions) == ("opt", 256)


def test_resolved_yaml_marks_the_keys_from_model_files():
    resolved = resolve(config(), Facts())
    text = ResolvedValues.of(resolved).yaml()
    [line] = [ln for ln in text.splitlines() if ln.strip().startswith("packing: true")]
    assert line.endswith(FROM_MODEL)
    assert yaml.safe_load(text)["ppo"]["update"]["packing"] is True  # still plain YAML
    assert FROM_MODEL not in resolved_yaml({"sft": {"packing": None}}, {"ppo.update.packing"})


# --- the command line and the checkpoint ---------------------------------------------------------


@pytest.mark.parametrize("data", [[], ["data=toy_tools"]], ids=["default", "toy_tools"])
def test_cfg_job_prints_every_auto_value_decided(data):
    proc = run_rlhf([*data, "--cfg", "job"], check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    values = yaml.safe_load(proc.stdout)
    assert undecided(values) == []
    marked = [ln.split(":")[0].strip() for ln in proc.stdout.splitlines() if FROM_MODEL in ln]
    assert marked == ["packing", "share_prompt", "packing"]  # sft., reward., ppo.update.


def test_a_checkpoint_holds_resolved_yaml_in_its_manifest(tmp_path):
    from rlhf.runtime import checkpoint, manifest

    text = ResolvedValues.of(resolve(config(), Facts())).yaml()
    final = checkpoint.save(tmp_path, 1, {}, {"state": {}}, keep=2, resolved=text)
    assert (final / checkpoint.RESOLVED_FILE).read_text() == text
    files = manifest.listed(final)
    assert manifest.mismatch(final, [checkpoint.RESOLVED_FILE], files) is None
    (final / checkpoint.RESOLVED_FILE).write_text(text.replace("true", "fals"))
    assert "differs" in manifest.mismatch(final, [checkpoint.RESOLVED_FILE], files)


def test_what_only_the_built_models_tell_is_resolved_once_more():
    """ppo.update.packing chosen from config.json is turned off where a loaded attention takes
    no 4D mask, and recorded in the run's values; asked for, it is refused."""
    from rlhf.config import ConfigError
    from rlhf.rl.ppo_models import Models
    from rlhf.steps.loop import RunInfo
    from rlhf.steps.ppo_parts import resolve_after_build
    from tests.test_fast_paths import tiny_lm, tiny_scorer

    flash = tiny_lm()
    flash.config._attn_implementation = "flash_attention_2"  # takes no 4D mask
    models = Models(tiny_lm(), flash, None, tiny_scorer(), None, None)
    resolved = resolve(config(), Facts())
    chosen = RunInfo("run", "run", None, ResolvedValues.of(resolved))
    after = resolve_after_build(resolved.config, models, chosen)
    assert resolved.config.ppo.update.packing and not after.ppo.update.packing
    assert chosen.config["ppo"]["update"]["packing"] is False
    asked = RunInfo(
        "run", "run", None, ResolvedValues.of(resolved._replace(from_model=frozenset()))
    )
    with pytest.raises(ConfigError, match=r"ppo\.update\.packing=true: flash_attention_2"):
        resolve_after_build(resolved.config, models, asked)
    takes = Models(tiny_lm(), tiny_lm(), None, tiny_scorer(), None, None)
    assert resolve_after_build(resolved.config, takes, chosen) is resolved.config

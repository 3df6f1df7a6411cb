"""Every config group option, experiment and sweep composes and validates; bad values are refused
with a message naming the key, the value and what is accepted. In-process, nothing is built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf.checks.validate import validated
from rlhf.config import Config, ConfigError, register_configs
from tests.conftest import (
    CONF_DIR,
    REPO,
    SWEEPS_DIR,
    assert_contains,
    compose,
    compose_sweep,
    sweep_axes,
    sweep_jobs,
)

register_configs()

# Groups whose options are chosen by name (experiment_step is selected through ${experiment}).
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
GROUPS.remove("experiment_step")
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]
SEARCHES = {"search_ppo"}  # search spaces (Optuna's), not grids: tests/test_search.py
SWEEPS = sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml") if p.stem not in SEARCHES)


@pytest.fixture
def local_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."}\n')
    return path


# --- every option composes and validates ----------------------------------------------------


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_validates(group, option, local_file):
    overrides = [f"{group}={option}"]
    if (group, option) == ("data", "local"):
        overrides.append(f"data.sources.local.path={local_file}")
    if (group, option) == ("step", "ppo"):  # PPO starts from the SFT and reward exports
        model_dir = local_file.parent
        overrides += [f"actor.model.path={model_dir}", f"critic.model.path={model_dir}"]
    if (group, option) == ("step", "dpo"):  # DPO starts from the SFT export
        overrides.append(f"model.path={local_file.parent}")
    if (group, option) == ("algo", "opd"):  # OPD needs a teacher (a hub id is checked at launch)
        overrides.append("teacher.model.path=facebook/opt-125m")
    if group in ("step", "algo"):  # their own values: the embedded model's tuning beats them
        overrides.append("model=opt-125m")
    cfg = compose(overrides)
    validated(cfg)  # raises ConfigError on any problem
    path = CONF_DIR / group / f"{option}.yaml"
    is_global = "@package _global_" in path.read_text().splitlines()[0]
    assert_contains(OmegaConf.load(path), cfg if is_global else cfg[group], group)


def test_design_groups_have_their_options():
    """The options docs/configuration.md's group table promises."""
    promised = {
        "step": "sft reward ppo dpo all",
        "algo": "ppo grpo rloo reinforce_pp remax dr_grpo dapo dpo opd",
        "model": "tiny opt-125m opt-350m opt-1.3b opt-6.7b opt-13b opt-66b llama-2-7b",
        "data": "toy rm-static full-hh-rlhf synthetic-instruct-gptj-pairwise rlhf-reward-datasets "
        "webgpt-comparisons shp local",
        "zero": "stage0 stage1 stage2 stage3",
        "lora": "none r8 r128",
        "optim": "default",
        "logger": "wandb tensorboard none",
        "experiment": "opt-1.3b-350m",
    }
    for group, options in promised.items():
        assert set(options.split()) <= {o for g, o in OPTIONS if g == group}, group


def test_default_is_the_embedded_tiny_model_on_toy_data():
    config = validated(compose())
    assert (config.model.name, config.model.path) == ("tiny", None)
    assert list(config.data.sources) == ["toy"]


def test_data_list_blends_sources_in_order():
    config = validated(compose(["data=[rm-static,full-hh-rlhf]"]))
    assert list(config.data.sources) == ["rm-static", "full-hh-rlhf"]
    assert [s.adapter for s in config.data.sources.values()] == ["rm-static", "full-hh-rlhf"]
    reverse = validated(compose(["data=[full-hh-rlhf,rm-static]"]))
    assert list(reverse.data.sources) == ["full-hh-rlhf", "rm-static"]


# --- experiment=opt-1.3b-350m ---------------------------------------------------------------


def test_experiment_sft_has_the_published_step1_values():
    c = validated(compose(["experiment=opt-1.3b-350m", "step=sft"]))
    assert (c.step.name, c.model.name, c.model.path) == ("sft", "opt-1.3b", "facebook/opt-1.3b")
    assert c.model.dropout is None  # OPT's own dropout
    assert list(c.data.sources) == [
        "rm-static",
        "full-hh-rlhf",
        "synthetic-instruct-gptj-pairwise",
        "rlhf-reward-datasets",
    ]
    assert list(c.data.phase_split) == [2, 4, 4]
    assert (c.data.max_seq_len, c.data.seed, c.seed) == (512, 1234, 1234)
    o = c.optim
    assert (o.lr, o.weight_decay, o.epochs, o.scheduler) == (9.65e-6, 0.0, 16, "cosine")
    assert (o.warmup_steps, o.warmup_ratio, o.grad_accum) == (0, 0.0, 1)
    assert (o.micro_batch_size, o.eval_micro_batch_size) == (8, 8)
    assert c.zero.stage == 2
    assert c.lora.rank == 0
    assert c.sft.loss_on_prompt is True


def test_experiment_without_a_step_file_still_composes():
    """experiment_step is optional: a step without a file (step=all: each of its steps composes
    its own) gets the shared values only."""
    assert not (CONF_DIR / "experiment_step" / "opt-1.3b-350m" / "all.yaml").exists()
    c = validated(compose(["experiment=opt-1.3b-350m", "step=all"]))
    assert (c.step.name, c.model.name, c.zero.stage) == ("all", "opt-1.3b", 2)
    assert c.optim.lr != 9.65e-6  # sft.yaml's values are not applied
    assert not c.sft.loss_on_prompt


def test_command_line_groups_win_over_the_experiment():
    c = validated(
        compose(["experiment=opt-1.3b-350m", "step=sft", "zero=stage3", "model=opt-350m"])
    )
    assert (c.zero.stage, c.model.name) == (3, "opt-350m")
    assert c.optim.lr == 9.65e-6  # the step's values stay


# --- sweeps ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_composes_and_every_swept_value_exists(name, tmp_path):
    cfg = compose_sweep(name, hydra_config=True)
    assert cfg.hydra.mode.name == "MULTIRUN"
    params = sweep_axes(name)
    assert params and all(len(values) >= 1 for values in params.values())
    # a step=ppo sweep starts from the SFT and reward exports: any existing dirs will do here
    exports = (
        [f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"]
        if compose_sweep(name).step.name == "ppo"
        else []
    )
    validated(compose_sweep(name, exports))
    # every job, which holds each swept value (zero.offload=true alone, at stage 0, is refused)
    for job in sweep_jobs(params):
        validated(compose_sweep(name, [*exports, *job]))


def test_step1_sweep_is_deepspeed_chats_grid():
    params = sweep_axes("step1")
    assert len(sweep_jobs(params)) == 8  # 8 distinct jobs, so 8 job dirs
    assert params["zero"] == ["stage2", "stage3"]
    assert [v.lower() for v in params["zero.offload"]] == ["false", "true"]
    base = validated(compose_sweep("step1"))
    assert (base.step.name, base.model.name, base.optim.epochs) == ("sft", "opt-1.3b", 16)
    [lora_axis] = set(params) - {"zero", "zero.offload"}
    by_rank = {}
    for value in params[lora_axis]:
        c = validated(compose_sweep("step1", [f"{lora_axis}={value}"]))
        by_rank[c.lora.rank] = c
    assert set(by_rank) == {0, 128}
    full, lora = by_rank[0], by_rank[128]
    assert (full.optim.lr, full.optim.weight_decay) == (9.65e-6, 0.0)
    assert (lora.optim.weight_decay, lora.lora.learning_rate) == (0.1, 1e-3)
    assert lora.lora.only_optimize_lora
    assert lora.lora.module_filter == "decoder.layers."


# --- refused values --------------------------------------------------------------------------

BAD_VALUES = [
    # overrides, key, value as reported, a piece of what is accepted
    (["ppo.rollout.engine=sglang"], "ppo.rollout.engine", "'sglang'", "one of hf, vllm"),
    # accepted and meaningless: without frozen base weights the reference is a full copy anyway
    (["lora=none", "lora.reference_copy=true"], "lora.reference_copy", "True", "lora.rank > 0"),
    (
        ["lora=r8", "lora.only_optimize_lora=false", "lora.reference_copy=true"],
        "lora.reference_copy",
        "True",
        "only_optimize_lora=true",
    ),
    (
        ["ppo.rollout.engine=vllm", "actor.hybrid_engine=true"],
        "actor.hybrid_engine",
        "True",
        "vLLM decodes the rollouts",
    ),
    (["ppo.rollout.correction=tis"], "ppo.rollout.correction", "'tis'", "engine=hf"),
    (
        ["ppo.rollout.engine=vllm", "ppo.rollout.correction=icepop"],
        "ppo.rollout.correction",
        "'icepop'",
        "one of none, tis, mask_token, mask_sequence",
    ),
    (["ppo.rollout.engine=vllm", "ppo.rollout.tis_cap=0.5"], "ppo.rollout.tis_cap", "0.5", ">= 1"),
    (
        ["ppo.rollout.engine=vllm", "ppo.rollout.correction_band=[1,2]"],
        "ppo.rollout.correction_band",
        "[1.0, 2.0]",
        "0 <= low < 1 < high",
    ),
    (
        ["ppo.rollout.engine=vllm", "ppo.rollout.cache=static"],
        "ppo.rollout.cache",
        "'static'",
        "hf path's decoding",
    ),
    (
        ["ppo.rollout.engine=vllm", "ppo.rollout.drop_finished_rows=false"],
        "ppo.rollout.drop_finished_rows",
        "False",
        "hf path's decoding",
    ),
    (
        ["ppo.rollout.engine=vllm", "ppo.rollout.logprobs=true"],
        "ppo.rollout.logprobs",
        "True",
        "the old log-probs are the trainer's",
    ),
    (["ppo.rollout.vllm.sync_bucket_mb=0"], "ppo.rollout.vllm.sync_bucket_mb", "0", ">= 1"),
    (
        ["ppo.rollout.vllm.kv_cache_gb=0"],
        "ppo.rollout.vllm.kv_cache_gb",
        "0.0",
        "null or a float > 0",
    ),
    (["ppo.rollout.vllm.sleep_level=3"], "ppo.rollout.vllm.sleep_level", "3", "1 or 2"),
    (
        ["ppo.rollout.vllm.gpu_memory_utilization=1.5"],
        "ppo.rollout.vllm.gpu_memory_utilization",
        "1.5",
        "null or in (0, 1]",
    ),
    (["ppo.reward.function=nope"], "ppo.reward.function", "'nope'", "module:function"),
    (
        ["ppo.reward.function=json:no_such_function"],
        "ppo.reward.function",
        "'json:no_such_function'",
        "json has no callable no_such_function",
    ),
    (
        ["ppo.reward.function=toy_gold", "ppo.reward.normalize=true"],
        "ppo.reward.normalize",
        "True",
        "false with ppo.reward.function set",
    ),
    (
        ["ppo.reward.function=toy_gold", "data=rm-static"],
        "ppo.reward.function",
        "'toy_gold'",
        "rm-static are not toy",
    ),
    (["zero.stage=5"], "zero.stage", "5", "0, 1, 2, 3"),
    (["lora.rank=-1"], "lora.rank", "-1", ">= 0"),
    (["optim.micro_batch_size=0"], "optim.micro_batch_size", "0", ">= 1"),
    (["optim.scheduler=bogus"], "optim.scheduler", "'bogus'", "cosine"),
    (["model.dtype=fp64"], "model.dtype", "'fp64'", "bf16"),
    (["data.phase_split=[1,2]"], "data.phase_split", "[1, 2]", "three non-negative weights"),
    (["data.max_prompt_len=64"], "data.max_prompt_len", "64", "< max_seq_len"),  # toy: 64
    (["data.max_prompt_len=100"], "data.max_prompt_len", "100", "< max_seq_len"),
    (
        ["data=local", "data.sources.local.path=/nonexistent/pairs.jsonl"],
        "data.sources.local.path",
        "'/nonexistent/pairs.jsonl'",
        "an existing",
    ),
    (["data.sources.toy.adapter=bogus"], "data.sources.toy.adapter", "'bogus'", "rm-static"),
    (["logger.backend=foo"], "logger.backend", "'foo'", "wandb"),
    (
        ["step=ppo", "ppo.rollout.drop_finished_rows=true", "ppo.rollout.cache=static"],
        "ppo.rollout.drop_finished_rows",
        "True",
        "cache=dynamic",
    ),
    (
        ["reward.share_prompt=true", "reward.loss=divergence_span"],
        "reward.share_prompt",
        "True",
        "pairwise, mse only",
    ),
    (
        ["step=ppo", "ppo.rollout.cache=paged"],
        "ppo.rollout.cache",
        "'paged'",
        "dynamic, static",
    ),
    (["step=ppo", "ppo.kl.estimator=k4"], "ppo.kl.estimator", "'k4'", "k1, k2, k3, full"),
    (
        ["step=ppo", "ppo.update.target_kl=0"],
        "ppo.update.target_kl",
        "0.0",
        "null (no early stop) or a float > 0",
    ),
    (
        ["step=ppo", "ppo.kl.estimator=full", "ppo.rollout.logprobs=true"],
        "ppo.rollout.logprobs",
        "True",
        "null or false with ppo.kl.estimator=full",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "key", "value", "accepted"), BAD_VALUES, ids=[b[0][-1] for b in BAD_VALUES]
)
def test_bad_value_is_refused_naming_key_value_and_accepted(overrides, key, value, accepted):
    cfg = compose(overrides)  # composes: the type is right, the value is not
    with pytest.raises(ConfigError) as err:
        validated(cfg)
    [line] = [ln for ln in str(err.value).splitlines() if ln.strip().startswith(f"{key}=")]
    assert line.strip().startswith(f"{key}={value}: expected ")
    assert accepted in line


def test_the_names_the_checks_accept_are_the_registrys():
    """One list of names per key: the registry's tables, read by the checks (no copy in the
    schema to keep in step)."""
    from rlhf import config as schema
    from rlhf import registry

    assert not hasattr(schema, "ROLLOUT_CORRECTIONS") and not hasattr(schema, "KL_ESTIMATORS")
    for key, table, bad in [
        ("ppo.rollout.correction", registry.CORRECTIONS, "icepop"),
        ("ppo.kl.estimator", registry.KL_ESTIMATORS, "k4"),
    ]:
        with pytest.raises(ConfigError) as err:
            validated(compose(["ppo.rollout.engine=vllm", f"{key}={bad}"]))
        assert f"{key}='{bad}': expected " in str(err.value)
        assert ", ".join(table) in str(err.value)


def test_vllm_rollouts_where_vllm_is_missing_are_refused_before_any_model(monkeypatch):
    from rlhf.checks import validate

    monkeypatch.setattr(validate, "vllm_problem", lambda: "vLLM is not installed here")
    config = validated(compose(["step=all", "ppo.rollout.engine=vllm"]))
    assert "ppo.rollout.engine=vllm: vLLM is not installed here" in validate.launch_problems(config)
    config = validated(compose(["step=sft", "ppo.rollout.engine=vllm"]))
    assert not any("vLLM" in p for p in validate.launch_problems(config))


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        validated(compose(["zero.stage=5", "logger.backend=foo", "optim.lr=-1"]))
    for key in ("zero.stage", "logger.backend", "optim.lr"):
        assert f"{key}=" in str(err.value)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("optim.lrr=1", "optim.lrr"),  # unknown key
        ("optim.lr=abc", "optim.lr"),  # wrong type
        ("zero.offload=maybe", "zero.offload"),
        ("data=nonexistent", "data/nonexistent"),  # unknown option
    ],
)
def test_compose_time_errors(override, named):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as err:
        compose([override])
    assert named in str(err.value) + str(err.value.__cause__)


# --- one source of defaults, every key documented ---------------------------------------------


def test_every_key_has_a_meaning_and_the_reference_is_current():
    from rlhf.cli import help as key_help

    defaults = OmegaConf.to_container(OmegaConf.structured(Config))
    undocumented = [key for key, _, meaning in key_help.reference(defaults) if not meaning]
    assert undocumented == []
    reference = REPO / "docs" / "config.md"
    assert reference.read_text() == key_help.markdown(), (
        "docs/config.md is stale: python -m rlhf.cli.help > docs/config.md"
    )


@pytest.mark.parametrize("group", ["optim", "ppo", "step", "algo"])
def test_step_and_default_options_restate_no_schema_default(group):
    """A YAML value equal to the dataclass default would be a second source of it."""
    defaults = OmegaConf.structured(Config)
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        values = OmegaConf.load(path)
        global_package = group in ("step", "algo")  # their files set keys of several nodes
        node = values if global_package else OmegaConf.create({group: values})
        for key in _leaf_keys(node):
            if key in ("step.name",):
                continue
            parent, _, leaf = key.rpartition(".")
            if OmegaConf.is_interpolation(OmegaConf.select(node, parent), leaf):
                continue  # ${optim.lr}: another key's value
            restated = OmegaConf.select(defaults, key) == OmegaConf.select(node, key)
            assert not restated, f"{path.relative_to(REPO)}: {key} restates the schema default"


def test_a_plain_run_uses_the_schema_defaults():
    """Composed with nothing on the command line, each step differs from the dataclass defaults
    only in what its options choose: the data (data=toy), the model's seed (model=tiny), the
    step's own values (and PPO's
    models, which take the top-level values: tests/test_config_flow.py)."""
    schema = OmegaConf.to_container(OmegaConf.structured(Config))
    own = {
        "sft": {"step.name", "optim.lr", "optim.micro_batch_size", "optim.epochs"},
        "reward": {"step.name", "optim.lr"},
        "ppo": {"step.name", "step.eval_interval", "optim.lr", "optim.warmup_steps"},
        "dpo": {"step.name", "optim.lr", "optim.epochs", "model.dropout"},
        "all": set(),
    }
    chosen = {"data.sources", "data.max_seq_len", "data.max_prompt_len", "data.max_eval_rows"}
    chosen.add("model.init_seed")  # model=tiny: the run's seed, and its PPO sizes
    chosen |= {
        f"ppo.{k}"
        for k in ("kl.coef", "rollout.per_device_batch_size", "update.per_device_batch_size")
    }
    for step, expected in own.items():
        composed = OmegaConf.to_container(compose([f"step={step}"]), resolve=True)
        differ = {
            k for k in _leaf_keys(OmegaConf.create(schema)) if _get(schema, k) != _get(composed, k)
        }
        shared = {k for k in differ if k.startswith(("actor.", "critic."))}
        assert all(_get(composed, k) == _get(composed, k.split(".", 1)[1]) for k in shared), step
        assert differ - chosen - shared == expected, step


def test_help_prints_each_key_with_its_composed_value_and_meaning():
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf", "ppo.kl.coef=0.3", "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "120"},  # meanings beside their keys (80: below them)
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith("ppo.kl.coef="))
    assert "ppo.kl.coef=0.3" in line and "KL penalty" in line
    assert "step: all, dpo, ppo, reward, sft" in proc.stdout


def _leaf_keys(node, prefix: str = "") -> list[str]:
    out = []
    for key in node:
        full = f"{prefix}{key}"
        if OmegaConf.is_config(node) and OmegaConf.is_interpolation(node, key):
            out.append(full)
            continue
        value = node[key]
        if OmegaConf.is_dict(value) and full not in ("data.sources", "model.init", "zero.extra"):
            out += _leaf_keys(value, f"{full}.")
        elif isinstance(value, dict) and full not in ("data.sources", "model.init", "zero.extra"):
            out += _leaf_keys(OmegaConf.create(value), f"{full}.")
        else:
            out.append(full)
    return out


def _get(container: dict, key: str):
    for part in key.split("."):
        container = container.get(part) if isinstance(container, dict) else None
    return container

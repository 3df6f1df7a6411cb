"""ppo.asynchronous (partial rollouts with bounded staleness, apart rollouts on ranks that only
generate): the section's defaults leave today's config as it was; each value and combination it
refuses is one line naming the key, its value and what is accepted, before any model is built;
ppo.rollout.logprobs, ppo.update.on_policy_shortcut and ppo.asynchronous.chunk_tokens resolve as
partial and apart rollouts need. Nothing here builds a model."""

from __future__ import annotations

import dataclasses

import pytest

from rlhf.checks.preflight import check_yaml_file
from rlhf.checks.validate import validated
from rlhf.config import (
    Config,
    ConfigError,
    PPOAsyncConfig,
    PPOConfig,
    register_configs,
    to_config,
    unknown_key,
    unknown_keys,
)
from rlhf.config.resolve import Facts, off_policy_reasons, resolve
from rlhf.config.sharing import unread_problems
from tests.conftest import compose

register_configs()

PARTIAL = "ppo.asynchronous.min_finished=0.5"
STEPS = "ppo.asynchronous.* apply to step=ppo (and step=all's PPO phase)"


def refusal(overrides: list[str]) -> str:
    """The one problem line validate gives ``overrides`` (the test fails on none or several)."""
    with pytest.raises(ConfigError) as err:
        validated(compose(overrides))
    lines = str(err.value).splitlines()
    problems = lines[1:] if lines[0] == "invalid configuration:" else lines
    assert len(problems) == 1, str(err.value)
    return problems[0].strip()


def resolved(*overrides: str, facts: Facts | None = None) -> Config:
    config = validated(compose(list(overrides)))
    return resolve(config, facts or Facts()).config


# --- the defaults ----------------------------------------------------------------------------


def test_the_section_is_ppo_asynchronous_and_off_by_default():
    section = PPOConfig().asynchronous
    assert isinstance(section, PPOAsyncConfig)
    assert dataclasses.asdict(section) == {
        "min_finished": None,
        "chunk_tokens": None,
        "phase_tokens": None,
        "max_staleness": 0,
        "on_stale": "regenerate",
        "rollout_ranks": 0,
    }
    assert not section.enabled and not section.apart and not section.off_policy
    assert section.problems() == []
    assert list(dataclasses.asdict(PPOConfig()))[:2] == ["rollout", "asynchronous"]


@pytest.mark.parametrize("step", ["sft", "reward", "ppo", "dpo", "all"])
def test_the_defaults_validate_at_every_step(step):
    overrides = [f"step={step}"] + (["model.path=/tmp"] if step == "dpo" else [])
    config = to_config(compose(overrides))
    assert config.ppo.asynchronous == PPOAsyncConfig()
    assert unread_problems(step, overrides) == []


@pytest.mark.parametrize(
    "overrides",
    [[], ["algo=grpo"], ["ppo.rollout.engine=vllm"], ["actor.hybrid_engine=true"]],
    ids=["default", "grpo", "vllm", "hybrid"],
)
@pytest.mark.parametrize("facts", [Facts(), Facts(device="cuda", bf16=True)], ids=["fp32", "bf16"])
def test_the_default_section_resolves_nothing_new(overrides, facts):
    """Off, the section changes no resolution: the same as with the section spelt out at its
    defaults, chunk_tokens left null (nothing reads it), no new off-policy reason."""
    plain = resolve(to_config(compose(overrides)), facts).config
    spelt = [
        *overrides,
        "ppo.asynchronous.min_finished=null",
        "ppo.asynchronous.chunk_tokens=null",
        "ppo.asynchronous.phase_tokens=null",
        "ppo.asynchronous.max_staleness=0",
        "ppo.asynchronous.on_stale=regenerate",
        "ppo.asynchronous.rollout_ranks=0",
    ]
    assert resolve(to_config(compose(spelt)), facts).config == plain
    assert plain.ppo.asynchronous.chunk_tokens is None
    assert not any("asynchronous" in r for r in off_policy_reasons(to_config(compose(overrides))))


# --- the section's own values ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key", "accepted"),
    [
        ("ppo.asynchronous.min_finished=0", "ppo.asynchronous.min_finished=0.0", "(0, 1]"),
        ("ppo.asynchronous.min_finished=1.5", "ppo.asynchronous.min_finished=1.5", "(0, 1]"),
        ("ppo.asynchronous.chunk_tokens=0", "ppo.asynchronous.chunk_tokens=0", "integer >= 1"),
        ("ppo.asynchronous.phase_tokens=0", "ppo.asynchronous.phase_tokens=0", "integer >= 1"),
        ("ppo.asynchronous.max_staleness=-1", "ppo.asynchronous.max_staleness=-1", ">= 0"),
        ("ppo.asynchronous.on_stale=keep", "ppo.asynchronous.on_stale='keep'", "regenerate, drop"),
        ("ppo.asynchronous.rollout_ranks=-1", "ppo.asynchronous.rollout_ranks=-1", "integer >= 0"),
    ],
)
def test_a_bad_value_of_the_section_is_one_line(override, key, accepted):
    alone = "min_finished" in override or "rollout_ranks" in override
    line = refusal([override] if alone else [PARTIAL, override])
    assert line.startswith(key) and accepted in line


@pytest.mark.parametrize(
    "override",
    [
        "ppo.asynchronous.on_stale=drop",
        "ppo.asynchronous.chunk_tokens=8",
        "ppo.asynchronous.phase_tokens=64",
    ],
)
def test_the_partial_keys_without_min_finished_are_refused(override):
    key = override.split("=")[0]
    line = refusal([override])
    assert line.startswith(key)
    assert f"{key} applies to partial rollouts: set ppo.asynchronous.min_finished" in line


def test_max_staleness_without_partial_or_apart_rollouts_is_refused():
    line = refusal(["ppo.asynchronous.max_staleness=2"])
    assert line.startswith("ppo.asynchronous.max_staleness=2: expected 0 while")
    assert (
        "ppo.asynchronous.max_staleness applies to partial rollouts or apart rollouts: set "
        "ppo.asynchronous.min_finished or ppo.asynchronous.rollout_ranks"
    ) in line


@pytest.mark.parametrize("on_stale", ["regenerate", "drop"])
def test_a_partial_config_validates(on_stale):
    config = validated(
        compose(
            [
                PARTIAL,
                "ppo.asynchronous.max_staleness=2",
                f"ppo.asynchronous.on_stale={on_stale}",
                "ppo.asynchronous.chunk_tokens=3",
            ]
        )
    )
    assert config.ppo.asynchronous.enabled and config.ppo.asynchronous.on_stale == on_stale


# --- the combinations partial rollouts refuse --------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key", "accepted"),
    [
        (["algo=remax"], "ppo.advantage.estimator='remax'", "greedy baseline"),
        (["algo=dapo"], "ppo.advantage.dynamic_sampling=True", "false with partial rollouts"),
        (["ppo.rollout.stop_at_eos=false"], "ppo.rollout.stop_at_eos=False", "nothing to carry"),
        (
            ["ppo.update.on_policy_shortcut=true"],
            "ppo.update.on_policy_shortcut=True",
            "the update's forward would stand in for their old log-probs",
        ),
        (
            ["ppo.rollout.logprobs=false"],
            "ppo.rollout.logprobs=False",
            "null or true with partial rollouts (ppo.asynchronous.min_finished set) and "
            "ppo.rollout.correction=none",
        ),
        (
            ["ppo.rollout.correction=tis", "ppo.rollout.logprobs=true"],
            "ppo.rollout.logprobs=True",
            "null or false with partial rollouts (ppo.asynchronous.min_finished set) and "
            "ppo.rollout.correction=tis",
        ),
        (
            ["ppo.rollout.engine=vllm", "ppo.rollout.correction=none"],
            "ppo.rollout.correction='none'",
            "engine=vllm's log-probs",
        ),
        (["ppo.rollout.top_k=5"], "ppo.rollout.correction=None", "one of tis"),
        (["ppo.kl.estimator=full"], "ppo.rollout.correction=None", "reads the actor's logits"),
        (["actor.hybrid_engine=true"], "ppo.rollout.correction=None", "hybrid_engine"),
    ],
    ids=[
        "remax",
        "dynamic-sampling",
        "no-eos",
        "shortcut",
        "logprobs-false",
        "logprobs-true-tis",
        "vllm-none",
        "top-k-none",
        "full-kl-none",
        "hybrid-none",
    ],
)
def test_each_refusal_is_one_line_before_any_model(overrides, key, accepted):
    line = refusal([PARTIAL, *overrides])
    assert line.startswith(key) and accepted in line, line


def test_a_multi_turn_task_validates_with_partial_rollouts():
    """Its episodes are carried whole (rlhf.rl.partial_episodes)."""
    assert validated(compose([PARTIAL, "data=toy_tools"])).ppo.asynchronous.enabled


def test_each_is_accepted_with_partial_rollouts_off():
    for overrides in (["algo=remax"], ["algo=dapo"], ["data=toy_tools"]):
        validated(compose(overrides))
    validated(compose(["ppo.rollout.stop_at_eos=false", "ppo.rollout.drop_finished_rows=false"]))


def test_a_correction_with_hf_only_under_partial_rollouts():
    line = refusal(["ppo.rollout.correction=tis"])
    assert line.startswith("ppo.rollout.correction='tis'") and "engine=hf" in line
    assert validated(compose([PARTIAL, "ppo.rollout.correction=tis"])).ppo.rollout.correction


# --- apart rollouts (ppo.asynchronous.rollout_ranks) ----------------------------------------

APART = "ppo.asynchronous.rollout_ranks=1"
# apart rollouts run at step=ppo only (the default step is all), which reads its models' paths
PPO = ["step=ppo", "actor.model.path=/tmp", "critic.model.path=/tmp"]
WITH_APART = "with apart rollouts (ppo.asynchronous.rollout_ranks > 0)"


@pytest.fixture
def two_ranks(monkeypatch):
    """A launch of two ranks (torchrun sets WORLD_SIZE): one to generate, one to train."""
    monkeypatch.setenv("WORLD_SIZE", "2")


def test_the_apart_properties():
    section = PPOAsyncConfig(rollout_ranks=1)
    assert section.apart and section.off_policy and not section.enabled
    partial = PPOAsyncConfig(min_finished=0.5)
    assert partial.off_policy and not partial.apart


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_an_apart_config_validates_and_reads_max_staleness(two_ranks, max_staleness):
    config = validated(compose([*PPO, APART, f"ppo.asynchronous.max_staleness={max_staleness}"]))
    section = config.ppo.asynchronous
    assert section.apart and section.max_staleness == max_staleness


@pytest.mark.parametrize(("world", "ranks"), [(None, 1), ("1", 1), ("2", 2), ("4", 5)])
def test_as_many_rollout_ranks_as_the_launch_has_is_refused(monkeypatch, world, ranks):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    line = refusal([*PPO, f"ppo.asynchronous.rollout_ranks={ranks}"])
    assert line.startswith(
        f"ppo.asynchronous.rollout_ranks={ranks}: expected fewer than the world size "
        f"({world or 1}): at least one rank must train; launch with torchrun "
        f"--nproc_per_node N, N > {ranks}"
    ), line


def test_fewer_rollout_ranks_than_the_launch_has_validate(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert validated(compose([*PPO, "ppo.asynchronous.rollout_ranks=3"])).ppo.asynchronous.apart


@pytest.mark.parametrize(
    ("overrides", "key", "accepted"),
    [
        (
            [PARTIAL],
            "ppo.asynchronous.min_finished=0.5",
            f"null {WITH_APART}: partial rollouts on the rollout ranks are not built yet",
        ),
        (
            ["algo=remax"],
            "ppo.advantage.estimator='remax'",
            f"{WITH_APART}: remax's greedy baseline must answer the same prompt under the same "
            "policy as it trains, not on another rank ahead of time",
        ),
        (
            ["algo=dapo"],
            "ppo.advantage.dynamic_sampling=True",
            f"false {WITH_APART}: DAPO's refilling",
        ),
        (
            ["ppo.update.on_policy_shortcut=true"],
            "ppo.update.on_policy_shortcut=True",
            "ppo.asynchronous.rollout_ranks=1 (apart rollouts train tokens another process sampled",
        ),
        (
            ["ppo.rollout.logprobs=false"],
            "ppo.rollout.logprobs=False",
            f"null or true {WITH_APART} and ppo.rollout.correction=none: the old log-probs "
            "are the sampler's, the only record of the policy that sampled a token decoded on "
            "a rollout rank",
        ),
        (
            ["ppo.rollout.correction=tis", "ppo.rollout.logprobs=true"],
            "ppo.rollout.logprobs=True",
            f"null or false {WITH_APART} and ppo.rollout.correction=tis",
        ),
        (
            ["ppo.rollout.engine=vllm", "ppo.rollout.correction=none"],
            "ppo.rollout.correction='none'",
            f"{WITH_APART} here: with none the old log-probs would be the sampler's (a rollout "
            "rank's, ppo.asynchronous.max_staleness versions behind the update), which cannot "
            "serve: engine=vllm's log-probs",
        ),
        (["ppo.rollout.top_k=5"], "ppo.rollout.correction=None", "one of tis"),
        (["actor.hybrid_engine=true"], "ppo.rollout.correction=None", "hybrid_engine"),
        (
            ["ppo.asynchronous.on_stale=drop"],
            "ppo.asynchronous.on_stale='drop'",
            "ppo.asynchronous.on_stale applies to partial rollouts: drop it (the rollout ranks "
            "of apart rollouts do not decode partially yet)",
        ),
        (
            ["ppo.asynchronous.chunk_tokens=8"],
            "ppo.asynchronous.chunk_tokens=8",
            "ppo.asynchronous.chunk_tokens applies to partial rollouts: drop it",
        ),
    ],
    ids=[
        "min-finished",
        "remax",
        "dynamic-sampling",
        "shortcut",
        "logprobs-false",
        "logprobs-true-tis",
        "vllm-none",
        "top-k-none",
        "hybrid-none",
        "on-stale",
        "chunk-tokens",
    ],
)
def test_each_apart_refusal_is_one_line_before_any_model(two_ranks, overrides, key, accepted):
    line = refusal([*PPO, APART, *overrides])
    assert line.startswith(key) and accepted in line, line


def test_apart_rollouts_at_step_all_are_refused(two_ranks):
    line = refusal([APART])  # step=all, the default
    assert line == (
        f"{APART}: expected 0 with step=all: its SFT and reward steps train on every rank, only "
        "PPO's ranks split into rollout and training ranks: run step=ppo"
    )


def test_apart_rollouts_keep_what_only_partial_rollouts_refuse(two_ranks):
    """Nothing is carried over: stop_at_eos=false is no refusal of apart rollouts."""
    overrides = ["ppo.rollout.stop_at_eos=false", "ppo.rollout.drop_finished_rows=false"]
    assert validated(compose([*PPO, APART, *overrides])).ppo.asynchronous.apart


def test_a_multi_turn_task_validates_with_apart_rollouts(two_ranks):
    """Its episodes are played on the rollout ranks, against the task's environment."""
    config = validated(compose([*PPO, APART, "data=toy_tools"]))
    assert config.ppo.asynchronous.apart


def test_a_correction_with_hf_under_apart_rollouts(two_ranks):
    config = validated(compose([*PPO, APART, "ppo.rollout.correction=tis"]))
    assert config.ppo.rollout.correction == "tis"


def test_step_dpo_and_a_pipeline_without_ppo_refuse_rollout_ranks():
    line = refusal(["step=dpo", "model.path=/tmp", APART])
    assert line == f"{APART}: expected 0 with step=dpo: {STEPS}"
    line = refusal(["algo=dpo", APART])
    assert line == f"{APART}: expected 0 with step=all's steps [sft, dpo]: {STEPS}"
    [line] = unread_problems("sft", ["step=sft", APART])
    assert line.startswith(f"{APART}: step=sft does not read it")


@pytest.mark.parametrize("facts", [Facts(), Facts(device="cuda", bf16=True)], ids=["fp32", "bf16"])
def test_apart_with_no_correction_takes_the_samplers_log_probs(two_ranks, facts):
    cfg = resolved(*PPO, APART, facts=facts)
    assert cfg.ppo.rollout.correction == "none"
    assert cfg.ppo.rollout.logprobs is True  # bf16 too, as for partial rollouts
    assert cfg.ppo.update.on_policy_shortcut is False
    assert cfg.ppo.asynchronous.chunk_tokens is None  # partial rollouts only


@pytest.mark.parametrize(
    "overrides",
    [["ppo.rollout.correction=tis"], ["ppo.rollout.engine=vllm"]],
    ids=["hf-tis", "vllm"],
)
def test_apart_with_a_correction_recomputes_the_proximal_log_probs(two_ranks, overrides):
    cfg = resolved(*PPO, APART, *overrides)
    assert cfg.ppo.rollout.correction != "none"
    assert cfg.ppo.rollout.logprobs is False
    assert cfg.ppo.update.on_policy_shortcut is False


def test_apart_rollouts_are_an_off_policy_reason():
    on_policy = [
        "ppo.update.epochs=1",
        "ppo.kl.in_loss=true",
        "ppo.rollout.per_device_batch_size=2",
        "ppo.update.per_device_batch_size=2",
        "ppo.update.grad_accum=1",
    ]
    assert off_policy_reasons(to_config(compose(on_policy))) == []
    [reason] = off_policy_reasons(to_config(compose([APART, *on_policy])))
    assert reason == (
        f"{APART} (apart rollouts train tokens another process sampled, "
        "max_staleness versions behind: the update's forward would stand in "
        "for their old log-probs)"
    )


# --- the steps without a PPO phase ---------------------------------------------------------------


@pytest.mark.parametrize("step", ["sft", "reward", "dpo"])
def test_the_section_on_the_command_line_of_another_step_is_refused(step):
    overrides = [f"step={step}", PARTIAL, "ppo.asynchronous.max_staleness=1"]
    [line] = unread_problems(step, overrides)
    assert line.startswith(f"{PARTIAL}, ppo.asynchronous.max_staleness=1: step={step}")
    assert "ppo.asynchronous.* apply to step=ppo (and step=all's PPO phase)" in line
    assert unread_problems(step, [f"step={step}", "ppo.asynchronous.min_finished=null"]) == []
    assert unread_problems("ppo", overrides) == unread_problems("all", overrides) == []


def test_step_dpo_and_a_pipeline_without_ppo_refuse_the_section_in_any_file():
    line = refusal(["step=dpo", "model.path=/tmp", PARTIAL])
    assert line.startswith(f"{PARTIAL}: expected null with step=dpo")
    assert "ppo.asynchronous.* apply to step=ppo (and step=all's PPO phase)" in line
    with pytest.raises(ConfigError) as err:
        validated(compose(["algo=dpo", PARTIAL, "ppo.asynchronous.on_stale=drop"]))
    assert str(err.value).splitlines()[1:] == [
        f"  {PARTIAL}: expected null with step=all's steps [sft, dpo]: {STEPS}",
        f"  ppo.asynchronous.on_stale='drop': expected regenerate with step=all's steps "
        f"[sft, dpo]: {STEPS}",
    ]


def test_step_all_composes_its_earlier_steps_with_the_section():
    """step=all composes its SFT and reward steps with the whole command line: their configs
    hold ppo.asynchronous.* and validate (the command-line check is step=sft's own)."""
    for step in ("all", "sft", "reward"):
        assert validated(compose([f"step={step}", PARTIAL])).ppo.asynchronous.enabled


# --- ppo.async.* -----------------------------------------------------------------------------


def test_ppo_async_names_ppo_asynchronous(tmp_path):
    said = "no such key; ppo.async.min_finished is ppo.asynchronous.min_finished"
    assert unknown_key("ppo.async.min_finished") == f"{said} (async is a Python keyword)"
    assert unknown_key("ppo.async").endswith(
        "ppo.async is ppo.asynchronous (async is a Python keyword)"
    )
    assert unknown_keys(compose(["++ppo.async.max_staleness=1"])) == [
        "ppo.async.max_staleness: no such key; ppo.async.max_staleness is "
        "ppo.asynchronous.max_staleness (async is a Python keyword)"
    ]
    path = tmp_path / "exp.yaml"
    path.write_text("ppo:\n  async:\n    min_finished: 0.5\n")
    with pytest.raises(ConfigError) as err:
        check_yaml_file(path)
    assert (
        str(err.value) == f"{path}: ppo.async.min_finished: {unknown_key('ppo.async.min_finished')}"
    )
    assert unknown_key("ppo.asynchronous.min_finished") is None


def test_help_lists_the_section():
    from rlhf.cli import help as key_help

    rows = key_help.keys()  # (dotted key, owning class, field) of every key
    keys = [key for key, *_ in rows]
    assert key_help.matching(keys, ["ppo.asynchronous"]) == [
        "ppo.asynchronous.min_finished",
        "ppo.asynchronous.chunk_tokens",
        "ppo.asynchronous.phase_tokens",
        "ppo.asynchronous.max_staleness",
        "ppo.asynchronous.on_stale",
        "ppo.asynchronous.rollout_ranks",
    ]
    meanings = key_help.field_meanings()
    assert all(meanings[("PPOAsyncConfig", f.name)] for f in dataclasses.fields(PPOAsyncConfig))


# --- resolution ------------------------------------------------------------------------------


@pytest.mark.parametrize("facts", [Facts(), Facts(device="cuda", bf16=True)], ids=["fp32", "bf16"])
def test_partial_with_no_correction_takes_the_samplers_log_probs(facts):
    cfg = resolved(PARTIAL, facts=facts)
    assert cfg.ppo.rollout.correction == "none"
    assert cfg.ppo.rollout.logprobs is True  # bf16 too: no forward can recompute them
    assert cfg.ppo.update.on_policy_shortcut is False


@pytest.mark.parametrize(
    "overrides",
    [
        ["ppo.rollout.correction=tis"],
        ["ppo.rollout.correction=mask_token"],
        ["ppo.rollout.engine=vllm"],
    ],
    ids=["hf-tis", "hf-mask", "vllm"],
)
def test_partial_with_a_correction_recomputes_the_proximal_log_probs(overrides):
    cfg = resolved(PARTIAL, *overrides)
    assert cfg.ppo.rollout.correction != "none"
    assert cfg.ppo.rollout.logprobs is False
    assert cfg.ppo.update.on_policy_shortcut is False


def test_partial_rollouts_are_an_off_policy_reason():
    on_policy = [
        "ppo.update.epochs=1",
        "ppo.kl.in_loss=true",
        "ppo.rollout.per_device_batch_size=2",
        "ppo.update.per_device_batch_size=2",
        "ppo.update.grad_accum=1",
        "ppo.rollout.correction=tis",
    ]
    alone = to_config(compose(on_policy[:-1]))
    assert off_policy_reasons(alone) == []
    assert resolve(alone, Facts()).config.ppo.update.on_policy_shortcut is False  # logprobs on
    partial = to_config(compose([PARTIAL, *on_policy]))
    [reason] = off_policy_reasons(partial)
    assert reason.startswith(PARTIAL)
    assert resolve(partial, Facts()).config.ppo.update.on_policy_shortcut is False


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], (64 - 32) // 8),  # data=toy: the answer budget is max_seq_len - max_prompt_len
        (["ppo.rollout.max_new_tokens=100"], 12),
        (["ppo.rollout.max_new_tokens=7"], 1),
        (["ppo.asynchronous.chunk_tokens=5"], 5),
    ],
)
def test_chunk_tokens_null_resolves_to_an_eighth_of_the_answer_budget(overrides, expected):
    cfg = resolved(PARTIAL, *overrides)
    assert cfg.ppo.asynchronous.chunk_tokens == expected

"""algo=opd around its math (tests/test_opd_math.py): the bad settings refused by the real
command line before any model is built, one line each; the teacher that is the student's own
start warned of; what the registry, step=all's pipeline and the resolver decide for it; the
registered estimator on hand tensors; and ``--help opd`` / ``--help teacher``. Fast: tiny
save_pretrained directories, composed configs, no training."""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
from pathlib import Path

import hydra
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM, OPTForSequenceClassification

from rlhf import registry
from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.checks.teacher import teacher_launch_problems, teacher_problems
from rlhf.checks.validate import check_launch, validated
from rlhf.cli import help as key_help
from rlhf.config import ConfigError, OPDConfig, TeacherConfig, register_configs, to_config
from rlhf.config.resolve import Facts, off_policy_reasons, resolve
from rlhf.config.sharing import pipeline_steps
from rlhf.registry import ESTIMATORS, AdvantageInputs, AdvantageParams
from rlhf.steps.all import compose_steps, pipeline
from tests.conftest import CONF_DIR, FAST, cache_overrides, compose, run_rlhf

register_configs()  # the schema, for the tests that compose in-process
NO_TRACE = {"HYDRA_FULL_ERROR": "0"}
OUTPUTS = ("actor", "critic", "checkpoints", "metrics.jsonl", "summary.json", "sft", "ppo")
OPD = ["step=ppo", "algo=opd"]


# ---------------------------------------------------------------- tiny export directories


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """save_pretrained directories of a 1-layer OPT: ``student`` with the shipped tokenizer
    (1280 tokens); ``special``, a teacher whose tokenizer adds a special token; ``vocab``, one
    whose tokenizer adds a plain token (both with room for it in the embeddings, so that only
    the tokenizer differs); ``copy``, the student's files in another directory; and teachers no
    step could use: ``reward``, a reward model (OPTForSequenceClassification) with the student's
    tokenizer, ``small``, a causal LM of 256 embeddings with it, ``empty``, no files."""
    root = tmp_path_factory.mktemp("opd-exports")
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
    names = ("student", "special", "vocab", "copy", "reward", "small", "empty")
    dirs = {name: root / name for name in names}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        OPTForCausalLM(OPTConfig(vocab_size=len(tok), **arch)).save_pretrained(dirs["student"])
        tok.save_pretrained(dirs["student"])
        teacher = OPTForCausalLM(OPTConfig(vocab_size=len(tok) + 8, **arch))
    for name, add in (
        ("special", lambda t: t.add_special_tokens({"additional_special_tokens": ["<|t|>"]})),
        ("vocab", lambda t: t.add_tokens(["zzzteacherzzz"])),
    ):
        other = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
        assert add(other) == 1 and len(other) == len(tok) + 1
        teacher.save_pretrained(dirs[name])
        other.save_pretrained(dirs[name])
    shutil.copytree(dirs["student"], dirs["copy"])
    reward = OPTForSequenceClassification(OPTConfig(vocab_size=len(tok), num_labels=1, **arch))
    reward.save_pretrained(dirs["reward"])
    tok.save_pretrained(dirs["reward"])
    OPTForCausalLM(OPTConfig(vocab_size=256, **arch)).save_pretrained(dirs["small"])
    tok.save_pretrained(dirs["small"])
    dirs["empty"].mkdir()
    return dirs


# ---------------------------------------------------------------- 1. bad input, by the CLI


def _refused(overrides: list[str], tmp_path: Path, cache: Path, named: list[str]) -> str:
    """``python -m rlhf OVERRIDES`` exits 2 with one ``error:`` naming each of ``named`` on one
    line (an 'invalid configuration:' header aside), no traceback, no model built, nothing
    written. Returns that line."""
    run_dir = tmp_path / "run"
    proc = run_rlhf(
        [*overrides, *FAST, *cache_overrides(cache)],
        run_dir=run_dir,
        check=False,
        timeout=300,
        extra_env=NO_TRACE,
    )
    out = proc.stderr + proc.stdout
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-4000:]
    message = proc.stderr[proc.stderr.index("error: ") :].strip().splitlines()
    if message[0] == "error: invalid configuration:":
        message = message[1:]  # the problems, one a line, follow the header
    assert len(message) == 1, message  # the one problem, alone
    [line] = message
    for name in named:
        assert name in line, (name, line)
    assert "teacher: " not in out  # build_teacher's log line: no teacher was built
    for name in OUTPUTS:
        assert not (run_dir / name).exists(), f"{name} written before the error"
    return line


BAD = [
    # id, overrides ({name}: an export dir; {tmp}: the test's tmp_path), what the line names
    (
        "no-teacher",
        ["actor.model.path={student}"],
        ["teacher.model.path=None", "algo=opd", "the teacher's weights"],
    ),
    (
        "teacher-path-missing",
        ["actor.model.path={student}", "teacher.model.path={tmp}/no-such-teacher"],
        ["teacher.model.path='{tmp}/no-such-teacher'", "an existing directory or a hub id"],
    ),
    (
        "unknown-loss",
        ["actor.model.path={student}", "teacher.model.path={student}", "opd.loss=bogus"],
        ["opd.loss='bogus'", "sampled, topk"],
    ),
    (
        "topk-zero",
        ["actor.model.path={student}", "teacher.model.path={student}", "opd.topk=0"],
        ["opd.topk=0", ">= 1"],
    ),
    (
        # a rule scores (no reward model, so critic.model.path is not asked for): the one problem
        # is the group that the task's group-normalised advantages need
        "task-reward-without-groups",
        [
            "actor.model.path={student}",
            "teacher.model.path={student}",
            "opd.task_reward=true",
            "ppo.reward.function=toy_gold",
        ],
        ["ppo.rollout.samples_per_prompt=1", ">= 2", "opd.task_reward=true"],
    ),
    (
        "tokenizer-with-another-special-token",
        ["actor.model.path={student}", "teacher.model.path={special}"],
        ["teacher.model.path={special}", "tokenizer", "({student})"],
    ),
]


@pytest.mark.parametrize(("overrides", "named"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_opd_settings_are_one_line_before_any_model(
    overrides, named, exports, tmp_path, cache_dir
):
    dirs = {k: str(v) for k, v in exports.items()} | {"tmp": str(tmp_path)}
    _refused(
        [*OPD, *(o.format(**dirs) for o in overrides)],
        tmp_path,
        cache_dir,
        [n.format(**dirs) for n in named],
    )


def test_opd_config_problems_name_each_bad_key():
    assert OPDConfig().problems() == []
    bad = OPDConfig(loss="forward", topk=0, kl_coef=-0.5).problems()
    assert [(k, v) for k, v, _ in bad] == [("loss", "forward"), ("topk", 0), ("kl_coef", -0.5)]


def _config(*overrides: str):
    return to_config(compose([*OPD, *overrides]))


def test_teacher_problems_are_step_3s_only():
    assert [k for k, *_ in teacher_problems(_config())] == ["teacher.model.path"]
    assert [k for k, *_ in teacher_problems(_config("step=all"))] == ["teacher.model.path"]
    # another step reads no teacher, and no other estimator has one
    assert teacher_problems(_config("step=sft")) == []
    assert teacher_problems(to_config(compose(["step=ppo", "algo=grpo"]))) == []
    task = teacher_problems(_config("teacher.model.path=/x", "opd.task_reward=true"))
    assert [(k, v) for k, v, _ in task] == [("ppo.rollout.samples_per_prompt", 1)]
    grouped = ("opd.task_reward=true", "ppo.rollout.samples_per_prompt=2")
    assert teacher_problems(_config("teacher.model.path=/x", *grouped)) == []


@pytest.mark.parametrize("other", ["special", "vocab"])
def test_a_teacher_with_another_tokenizer_names_both_paths(exports, other):
    config = _config(
        f"actor.model.path={exports['student']}", f"teacher.model.path={exports[other]}"
    )
    [problem] = teacher_launch_problems(config)
    assert problem.startswith(f"teacher.model.path={exports[other]}: its tokenizer")
    assert f"({exports['student']})" in problem


def test_the_launch_checks_accept_a_copy_of_the_student_as_teacher(exports):
    check_launch(
        _config(f"actor.model.path={exports['student']}", f"teacher.model.path={exports['copy']}")
    )


# the teacher's directory is checked before launch as the actor's is: a teacher with no files,
# a reward model (its score head would be dropped) or a model whose embeddings are smaller than
# the shared tokenizer (resized with new random rows) is refused by name
@pytest.mark.parametrize(
    ("teacher", "named"),
    [
        ("empty", "no config.json"),
        ("reward", "OPTForSequenceClassification"),
        ("small", "256"),
    ],
)
def test_a_teacher_no_step_can_use_is_refused_before_loading(exports, teacher, named):
    config = _config(
        f"actor.model.path={exports['student']}", f"teacher.model.path={exports[teacher]}"
    )
    with pytest.raises(ConfigError) as err:
        check_launch(config)
    assert f"teacher.model.path={exports[teacher]}" in str(err.value)
    assert named in str(err.value)


# ---------------------------------------------------------------- 2. the student as teacher


def test_the_students_own_export_as_teacher_warns_and_passes(exports, caplog):
    student = exports["student"]
    # the same directory, spelled otherwise
    config = _config(f"actor.model.path={student}", f"teacher.model.path={student}/.")
    with caplog.at_level(logging.WARNING, logger="rlhf.checks.teacher"):
        assert teacher_launch_problems(config) == []
    [record] = [r for r in caplog.records if r.name == "rlhf.checks.teacher"]
    assert record.levelno == logging.WARNING
    assert f"teacher.model.path={student}/." in record.getMessage()
    assert "the student's own start" in record.getMessage()


def test_a_copy_of_the_student_passes_without_the_warning(exports, caplog):
    config = _config(
        f"actor.model.path={exports['student']}", f"teacher.model.path={exports['copy']}"
    )
    with caplog.at_level(logging.WARNING, logger="rlhf.checks.teacher"):
        assert teacher_launch_problems(config) == []
    assert not [r for r in caplog.records if r.name == "rlhf.checks.teacher"]


# ---------------------------------------------------------------- 3. registry and pipeline


@pytest.mark.parametrize(
    ("overrides", "reward_model"),
    [
        ([], False),  # the teacher's gap alone reads no reward
        (["opd.task_reward=true"], True),  # the task's: a reward model scores
        (["opd.task_reward=true", "ppo.reward.function=toy_gold"], False),  # a rule does
        (["ppo.reward.function=toy_gold"], False),
    ],
)
def test_the_registry_builds_a_teacher_and_a_reward_model_only_for_the_tasks_reward(
    overrides, reward_model
):
    composed = compose(["algo=opd", *overrides])
    config = to_config(composed)
    assert config.ppo.advantage.estimator == "opd" and config.ppo.kl.coef == 0
    assert registry.uses_teacher(config.ppo)
    assert not registry.uses_critic(config.ppo)
    # the typed config and step=all's composed one answer alike
    assert (
        registry.uses_reward_model(config) is registry.uses_reward_model(composed) is reward_model
    )
    assert registry.reads_critic_path(config) is reward_model
    assert registry.reads_reward("opd", config.opd.task_reward) is config.opd.task_reward
    assert registry.reads_reward("grpo", False) and registry.reads_reward("no_such_name", False)
    assert not registry.uses_teacher(to_config(compose(["algo=grpo"])).ppo)


def test_step_3_asks_for_no_critic_path_without_the_tasks_reward(exports):
    actor = [f"actor.model.path={exports['student']}", f"teacher.model.path={exports['student']}"]
    config = validated(compose([*OPD, *actor]))
    assert config.critic.model.path is None
    with pytest.raises(ConfigError, match=r"critic.model.path=None: expected a model directory"):
        validated(
            compose([*OPD, *actor, "opd.task_reward=true", "ppo.rollout.samples_per_prompt=2"])
        )


@pytest.mark.parametrize(
    ("overrides", "steps"),
    [
        ([], ["sft", "ppo"]),
        (["opd.task_reward=true", "ppo.rollout.samples_per_prompt=2"], ["sft", "reward", "ppo"]),
        (
            [
                "opd.task_reward=true",
                "ppo.rollout.samples_per_prompt=2",
                "ppo.reward.function=toy_gold",
            ],
            ["sft", "ppo"],
        ),
    ],
)
def test_step_all_trains_a_reward_model_only_for_the_tasks_reward(overrides, steps, tmp_path):
    user = ["algo=opd", f"teacher.model.path={tmp_path}", *overrides]
    composed = compose(["step=all", *user])
    assert composed.pipeline.steps == ["sft", "reward", "ppo"]  # the file's; the rest is dropped
    reward_model = registry.uses_reward_model(composed)
    assert pipeline_steps(OmegaConf.to_container(composed, resolve=True), reward_model) == steps
    assert list(pipeline(composed.pipeline.steps, reward_model)) == steps
    config = validated(composed)  # the teacher path exists; nothing else is asked for
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        by_step = compose_steps(config, user, "config", tmp_path / "run")
    assert list(by_step) == steps
    ppo = by_step["ppo"]
    assert ppo.actor.model.path == str(tmp_path / "run" / "sft" / "model")
    assert ppo.teacher.model.path == str(tmp_path)  # the user's, not an earlier step's


# ---------------------------------------------------------------- 4. resolution


def _resolved(*overrides: str, device: str = "cpu", bf16: bool = False):
    config = _config(*overrides)
    facts = Facts(
        device=device,
        bf16=bf16,
        teacher=registry.uses_teacher(config.ppo),
        aggregation=registry.loss_aggregation_default(config.ppo),
    )
    return resolve(config, facts).config


# one optimizer step a rollout, no KL in the reward: only the teacher keeps the shortcut off
ON_POLICY = [
    "actor.model.dtype=bf16",
    "ppo.rollout.per_device_batch_size=2",
    "ppo.update.per_device_batch_size=2",
]


def test_the_teachers_gap_keeps_the_on_policy_shortcut_off():
    opd = _config(*ON_POLICY)
    assert off_policy_reasons(opd, teacher=True) == [
        "algo=opd's advantages are the student-teacher gap of the old log-probs"
    ]
    assert off_policy_reasons(opd, teacher=False) == []  # what the shortcut would see else
    assert _resolved(*ON_POLICY).ppo.update.on_policy_shortcut is False
    # the same config without the teacher's fact: the shortcut is on
    assert resolve(opd, Facts(teacher=False)).config.ppo.update.on_policy_shortcut is True


def test_an_asked_for_on_policy_shortcut_is_refused_naming_the_teacher(exports):
    paths = [f"actor.model.path={exports['student']}", f"teacher.model.path={exports['student']}"]
    with pytest.raises(ConfigError) as err:
        validated(compose([*OPD, *paths, *ON_POLICY, "ppo.update.on_policy_shortcut=true"]))
    [line] = [ln.strip() for ln in str(err.value).splitlines() if "on_policy_shortcut" in ln]
    assert line.startswith("ppo.update.on_policy_shortcut=True: expected null or false")
    assert "algo=opd's advantages are the student-teacher gap" in line


def test_the_rollout_logprobs_follow_opd_loss():
    # sampled reads the (B, R) log-probs: the sampler's serve in fp32 as for any estimator
    sampled = _resolved("actor.model.dtype=fp32")
    assert (sampled.ppo.rollout.logprobs, sampled.opd.loss) == (True, "sampled")
    # topk reads the student's (B, R, V) logits, which the sampler does not keep
    topk = _resolved("actor.model.dtype=fp32", "opd.loss=topk")
    assert topk.ppo.rollout.logprobs is False
    asked = _resolved("actor.model.dtype=fp32", "opd.loss=topk", "ppo.rollout.logprobs=true")
    assert asked.ppo.rollout.logprobs is False  # overridden, silently (see the BUG below)
    assert _resolved("actor.model.dtype=bf16").ppo.rollout.logprobs is False  # as any bf16 run


# opd.loss=topk needs the actor's logits: an explicit ppo.rollout.logprobs=true is refused by
# name, as with ppo.kl.estimator=full (rlhf.registry.dependency_problems)
def test_asked_for_rollout_logprobs_with_the_topk_loss_are_refused(exports):
    paths = [f"actor.model.path={exports['student']}", f"teacher.model.path={exports['student']}"]
    full = [*paths, "ppo.kl.estimator=full", "ppo.rollout.logprobs=true"]
    with pytest.raises(ConfigError, match=r"ppo.rollout.logprobs=True: expected null or false"):
        validated(compose([*OPD, *full]))  # the KL that reads the logits: refused
    with pytest.raises(ConfigError, match=r"ppo.rollout.logprobs=True: expected null or false"):
        validated(compose([*OPD, *paths, "opd.loss=topk", "ppo.rollout.logprobs=true"]))


@pytest.mark.parametrize(
    ("overrides", "normalize"),
    [
        ([], False),  # no reward is read
        (["opd.task_reward=true", "ppo.rollout.samples_per_prompt=2"], True),  # a reward model's
        (["opd.task_reward=true", "ppo.reward.function=toy_gold"], False),  # a rule's, as is
        (["ppo.reward.normalize=true"], True),  # set: kept
    ],
)
def test_reward_normalize_is_off_without_a_reward_model(overrides, normalize):
    assert _resolved(*overrides).ppo.reward.normalize is normalize


@pytest.mark.parametrize(
    ("overrides", "device", "bf16", "dtype"),
    [
        ([], "cpu", False, "fp32"),
        ([], "cuda", True, "bf16"),
        ([], "cuda", False, "fp16"),
        (["actor.model.dtype=fp32"], "cuda", True, "fp32"),  # follows the actor's
        (["teacher.model.dtype=bf16"], "cpu", False, "bf16"),  # its own, set
    ],
)
def test_teacher_dtype_auto_is_the_devices_unless_set(overrides, device, bf16, dtype):
    composed = _config(*overrides)
    assert composed.teacher.model.dtype == ("auto" if not overrides else overrides[0].split("=")[1])
    assert _resolved(*overrides, device=device, bf16=bf16).teacher.model.dtype == dtype


def test_the_teacher_follows_the_actors_stage_unless_set():
    assert _config("actor.zero.stage=3").teacher.zero.stage == 3
    assert _config("actor.zero.stage=3", "teacher.zero.stage=0").teacher.zero.stage == 0
    teacher = _config().teacher
    assert teacher.model.path is None and teacher.model.dropout == 0.0 and not teacher.zero.offload


# ---------------------------------------------------------------- 5. the registered estimator

# B = 4 answers of R = 3 tokens, 2 prompts x 2 answers; the last two tokens of row 1 and the
# last of row 3 are padding, holding garbage the estimator must not read
MASK = torch.tensor(
    [[True, True, True], [True, False, False], [True, True, True], [True, True, False]]
)
GAP = torch.tensor(
    [[0.5, -1.0, 2.0], [0.25, math.nan, math.inf], [-0.5, 0.0, 1.5], [1.0, -2.0, -math.inf]]
)


def _batch() -> AdvantageInputs:
    outcomes = torch.tensor([1.0, 0.0, 0.5, 2.0])
    rewards = torch.zeros(4, 3)
    last = MASK.sum(-1) - 1
    rewards[torch.arange(4), last] = outcomes
    return AdvantageInputs(
        rewards=rewards,
        outcomes=outcomes,
        values=torch.zeros(4, 3),
        response_mask=MASK,
        teacher_gap=GAP,
    )


def test_opd_estimator_is_minus_coef_times_the_gap_on_real_tokens():
    spec = ESTIMATORS["opd"]
    assert spec.teacher and not (spec.needs_critic or spec.group or spec.greedy_baseline)
    assert spec.whiten == "never"  # the gap's scale is the signal
    params = AdvantageParams(teacher_coef=0.5, task_reward=False, group_size=2)
    advantages, returns = spec.compute(_batch(), params)
    expected = torch.tensor(
        [[-0.25, 0.5, -1.0], [-0.125, 0.0, 0.0], [0.25, 0.0, -0.75], [-0.5, 1.0, 0.0]]
    )
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)
    assert advantages[~MASK].eq(0).all()
    zero, _ = spec.compute(_batch(), dataclasses.replace(params, teacher_coef=0.0))
    assert zero.eq(0).all()  # no gap, no signal: the outcomes are not read without task_reward


@pytest.mark.parametrize("std_normalize", [True, False])
def test_opd_with_the_task_reward_adds_exactly_grpos_advantages(std_normalize):
    params = AdvantageParams(
        teacher_coef=2.0, task_reward=True, group_size=2, std_normalize=std_normalize
    )
    batch = _batch()
    with_task, _ = ESTIMATORS["opd"].compute(batch, params)
    gap_only, _ = ESTIMATORS["opd"].compute(batch, dataclasses.replace(params, task_reward=False))
    grpo, _ = ESTIMATORS["grpo"].compute(batch, params)
    assert grpo.abs().sum() > 0  # the groups' outcomes differ: there is something to add
    torch.testing.assert_close(with_task, gap_only + grpo)
    torch.testing.assert_close(with_task[MASK], -2.0 * GAP[MASK] + grpo[MASK])
    assert with_task[~MASK].eq(0).all()


# ---------------------------------------------------------------- 6. --help


@pytest.fixture(scope="module")
def help_text() -> str:
    """``python -m rlhf --help opd teacher`` (one process: --help takes seconds here)."""
    proc = run_rlhf(
        ["--help", "opd", "teacher"], check=False, timeout=300, extra_env={"COLUMNS": "160"}
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _help_keys(text: str, word: str) -> dict[str, str]:
    """Each key=value printed under WORD, with the lines that follow it up to the next key (its
    meaning, a long value's wrapped lines), whitespace joined."""
    out, setting = {}, None
    for line in text.splitlines():
        if line.startswith(f"  {word}."):
            setting, _, rest = line.strip().partition(" ")
            out[setting] = rest
        elif setting is not None and line.startswith("  "):
            out[setting] += " " + line
        else:
            setting = None
    return {k: " ".join(v.split()) for k, v in out.items()}


@pytest.mark.parametrize(
    ("word", "schema", "shown"),
    [
        (
            "opd",
            OPDConfig,
            {
                "opd.kl_coef=1.0": "-kl_coef x the student-teacher gap",
                "opd.loss=sampled": "sampled: the gap is the sampled token's log-ratio",
                "opd.topk=16": "opd.loss=topk: the tokens the KL runs over",
                "opd.task_reward=false": "group-normalised advantages",
            },
        ),
        (
            "teacher",
            TeacherConfig,
            {
                "teacher.model.path=null": "hub id or local dir",
                "teacher.model.dtype=auto": "auto",
                "teacher.zero.stage=0": "0 (plain data parallel)",
                "teacher.zero.offload=false": "parameters at stage 3",
            },
        ),
    ],
)
def test_help_prints_each_key_with_its_comment(help_text, word, schema, shown):
    printed = _help_keys(help_text, word)
    keys = [key for key, *_ in key_help.keys(schema, f"{word}.")]
    assert keys and [s.split("=")[0] for s in printed] == keys  # every key, in order, only these
    meanings = key_help.field_meanings()
    for key, owner, name in key_help.keys(schema, f"{word}."):
        [setting] = [s for s in printed if s.split("=")[0] == key]
        assert printed[setting], f"{key} printed without its meaning"
        assert " ".join(meanings[(owner.__name__, name)].split()) in printed[setting]
    for setting, fragment in shown.items():
        assert fragment in printed[setting], (setting, printed[setting])

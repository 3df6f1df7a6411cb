"""One rule for the keys PPO's models share with the top level (rlhf/config/sharing.py): a top-level
``zero.*``, ``lora.*``, ``optim.*`` or ``model.*`` value reaches the actor and the critic unless
set for the role, in step=ppo and in step=all's PPO step, or is refused by name; ``--cfg job``
shows the result. The slow test sweeps zero.offload and lora.rank through both and reads what
DeepSpeed built in each job."""

from __future__ import annotations

import re
from pathlib import Path

import hydra
import pytest
import yaml
from omegaconf import OmegaConf

from rlhf.checks.ppo_launch import dropout_problems
from rlhf.checks.validate import validated
from rlhf.config import ConfigError, register_configs
from rlhf.config.sharing import SHARED_GROUPS, share_command_line, shared_keys, unread_problems
from rlhf.steps.all import compose_steps, path_override
from tests.conftest import CONF_DIR, FAST, cache_overrides, compose, run_rlhf

register_configs()
ROLES = ("actor", "critic")


def cfg_job(args: list[str]) -> dict:
    proc = run_rlhf([*args, "--cfg", "job"], check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def composed(overrides: list[str]):
    """As a run composes: Hydra, then the command line's values shared with the roles."""
    cfg = compose(overrides)
    share_command_line(cfg, overrides)
    return cfg


def test_config_yaml_lets_every_shared_key_follow_the_top_level():
    """A schema key added to zero/lora/optim/model must reach PPO's models too."""
    roles = OmegaConf.load(CONF_DIR / "config.yaml")
    for role in ROLES:
        for group in SHARED_GROUPS:
            expected = {key: f"${{{group}.{key}}}" for key in shared_keys(group)}
            assert OmegaConf.to_container(roles[role][group]) == expected, (role, group)


def test_cfg_job_shows_top_level_values_in_both_ppo_models():
    shared = ["zero=stage3", "zero.offload=true", "lora=r8", "lora.rank=64", "lora.dropout=0.1"]
    c = cfg_job(["step=ppo", *shared, "optim.lr=5e-6", "model.dtype=bf16"])
    for role in ROLES:
        r = c[role]
        assert (r["zero"]["stage"], r["zero"]["offload"]) == (3, True), role
        assert (r["lora"]["rank"], r["lora"]["alpha"], r["lora"]["dropout"]) == (64, 16, 0.1)
        assert (r["optim"]["lr"], r["model"]["dtype"]) == (5e-6, "bf16"), role
        assert r["model"]["dropout"] == 0.0  # PPO's own: never the top level's


def test_a_role_value_wins_over_the_top_level_one():
    top = ["zero=stage2", "zero.offload=true", "optim.lr=1e-5", "lora.rank=4"]
    own = ["actor.zero.offload=false", "critic.optim.lr=2e-6", "zero@critic.zero=stage3"]
    c = cfg_job(["step=ppo", *top, *own, "lora@actor.lora=r8"])
    assert (c["actor"]["zero"]["offload"], c["critic"]["zero"]["offload"]) == (False, True)
    assert (c["actor"]["optim"]["lr"], c["critic"]["optim"]["lr"]) == (1e-5, 2e-6)
    assert (c["actor"]["zero"]["stage"], c["critic"]["zero"]["stage"]) == (2, 3)
    assert (c["actor"]["lora"]["rank"], c["critic"]["lora"]["rank"]) == (8, 4)


def test_the_command_line_beats_what_an_experiment_sets_for_a_role():
    recipe = composed(["experiment=opt-1.3b-350m", "step=ppo"])
    assert (recipe.actor.optim.lr, recipe.critic.optim.lr) == (9.65e-6, 5e-6)
    c = composed(["experiment=opt-1.3b-350m", "step=ppo", "optim.lr=1e-5"])
    assert (c.actor.optim.lr, c.critic.optim.lr) == (1e-5, 1e-5)
    # a group choice sets every key of its group: the actor's and the critic's too
    c = composed(["experiment=opt-1.3b-350m", "step=ppo", "lora=r8"])
    assert (c.actor.lora.rank, c.critic.lora.rank) == (8, 8)


def test_top_level_values_in_a_config_file_reach_the_roles(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - config\n  - _self_\n  - override step: ppo\n"
        "zero:\n  stage: 3\n  offload: true\nlora:\n  rank: 4\n"
    )
    c = cfg_job(["-cd", str(tmp_path), "-cn", "mine"])
    for role in ROLES:
        assert (c[role]["zero"]["stage"], c[role]["zero"]["offload"]) == (3, True)
        assert c[role]["lora"]["rank"] == 4


def test_step_all_composes_each_step_with_the_shared_values(tmp_path):
    user = ["zero=stage2", "zero.offload=true", "lora=r8", "lora.rank=4", "optim.lr=3e-5"]
    config = validated(compose(user))
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        steps = compose_steps(config, user, "config", tmp_path)
    ppo = steps["ppo"]
    for role in ROLES:
        assert (ppo[role].zero.offload, ppo[role].lora.rank, ppo[role].optim.lr) == (True, 4, 3e-5)
    assert (steps["sft"].zero.offload, steps["sft"].lora.rank) == (True, 4)


def test_help_shows_the_shared_values():
    proc = run_rlhf(["step=ppo", "lora.rank=64", "--help"], check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shown = {ln.split()[0] for ln in proc.stdout.splitlines() if ln.startswith("  ")}
    assert {"actor.lora.rank=64", "critic.lora.rank=64", "lora.rank=64"} <= shown


def test_a_top_level_key_no_ppo_model_reads_is_refused_by_name():
    problems = unread_problems("ppo", ["optim.epochs=2", "optim.lr=1e-5", "model.path=x"])
    assert len(problems) == 2
    assert problems[0].startswith("optim.epochs=2: step=ppo does not read optim.epochs")
    assert "ppo.update.prompt_epochs" in problems[0]
    assert problems[1].startswith("model.path=x: step=ppo does not read model.path")
    # step=all's SFT and reward steps read them
    assert unread_problems("all", ["optim.epochs=2", "model.path=x"]) == []


def test_refused_before_anything_loads(tmp_path):
    paths = [f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"]
    run_dir = tmp_path / "run"
    proc = run_rlhf(
        ["step=ppo", "optim.micro_batch_size=4", *paths], run_dir, check=False, timeout=120
    )
    assert proc.returncode == 2
    assert "optim.micro_batch_size=4: step=ppo does not read" in proc.stderr
    assert not (run_dir / ".hydra").exists()


def test_lora_dropout_reaches_the_ppo_models_and_is_refused(tmp_path):
    """Before the rule, lora.dropout=0.1 never reached them, so it was not even refused."""
    paths = [f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"]
    config = validated(composed(["step=ppo", "lora=r8", "lora.dropout=0.1", *paths]))
    for role in ROLES:
        trained = getattr(config, role)
        [problem] = dropout_problems(role, trained.model, trained.lora, {"dropout": 0.0})
        assert problem.startswith(f"{role}.lora.dropout=0.1: expected 0.0")


# --- item 1: the embedded model's tuning is model=tiny's, in conf/tuning/tiny/ ------------------

# the keys conf/tuning/tiny/ sets, per step, and their values
TOY = {
    "sft": {"optim.lr": 2e-3, "optim.epochs": 6, "optim.micro_batch_size": 32},
    "reward": {"optim.lr": 2e-4, "optim.epochs": 3, "optim.micro_batch_size": 16},
    "ppo": {"actor.optim.lr": 1e-4, "critic.optim.lr": 1e-4, "ppo.kl.coef": 0.3},
    "dpo": {"optim.lr": 2e-5, "optim.epochs": 1},
}
DSCHAT_STEP = CONF_DIR / "experiment_step" / "deepspeed-chat"
# DeepSpeed-Chat's step2_dpo_finetuning/training_scripts/opt/single_node/run_350m.sh
DSCHAT_DPO = {"optim.lr": 5e-5, "optim.weight_decay": 0.1, "optim.epochs": 1}
SCALE_KEYS = ("lr", "weight_decay", "epochs", "micro_batch_size", "eval_micro_batch_size")


def value(cfg, key: str):
    return OmegaConf.select(cfg, key)


def published(step: str) -> dict:
    """The values experiment=deepspeed-chat records for a step's scale-dependent keys."""
    if step == "dpo":
        return DSCHAT_DPO
    recorded = OmegaConf.load(DSCHAT_STEP / f"{step}.yaml")
    if step == "ppo":
        out = {
            f"{r}.optim.{k}": recorded[r].optim[k] for r in ROLES for k in ("lr", "warmup_steps")
        }
        keys = ("rollout.per_device_batch_size", "update.per_device_batch_size", "kl.coef")
        return out | {f"ppo.{k}": OmegaConf.select(recorded.ppo, k) for k in keys}
    return {f"optim.{k}": recorded.optim[k] for k in SCALE_KEYS if k in recorded.optim}


@pytest.mark.parametrize("step", TOY)
def test_the_embedded_default_keeps_its_tuning(step):
    cfg = composed([f"step={step}"])
    for key, expected in TOY[step].items():
        assert value(cfg, key) == expected, (step, key)


@pytest.mark.parametrize("step", TOY)
def test_a_real_model_on_real_data_gets_deepspeed_chats_values(step):
    cfg = composed([f"step={step}", "model=opt-1.3b", "data=rm-static"])
    for key, expected in published(step).items():
        assert value(cfg, key) == expected, (step, key)
    assert cfg.ppo.ptx.coef == 0.0


@pytest.mark.parametrize(
    "overrides",
    [["model=opt-125m"], ["model=opt-125m", "data=[toy,rm-static]"], ["experiment=opt-1.3b-350m"]],
    ids=lambda o: o[-1],
)
def test_a_real_model_gets_the_real_values_on_any_data(overrides):
    cfg = composed(["step=sft", *overrides])
    assert (cfg.optim.lr, cfg.optim.epochs) == (9.65e-6, 16)


@pytest.mark.parametrize("data", ["data=rm-static", "data=[toy,rm-static]", "data=toy_tools"])
def test_the_tiny_model_keeps_its_tuning_on_any_data(data):
    """Its sizes are the 1M model's, whatever it trains on: at DeepSpeed-Chat's lr 9.65e-6 it
    would learn nothing in a run's time."""
    cfg = composed(["step=sft", data])
    assert (cfg.optim.lr, cfg.optim.epochs) == (2e-3, 6)


def toy_values(step: str, algo: str) -> dict:
    """key -> value of what conf/tuning/tiny/ sets at ``step`` under ``algo`` (interpolations,
    another key's value, left out)."""
    files = [CONF_DIR / "tuning" / "tiny" / f"{step}.yaml"]
    files.append(CONF_DIR / "algo_tuning" / "tiny" / f"{algo}.yaml")
    out = {}
    for path in [f for f in files if f.exists()]:
        node = OmegaConf.load(path)
        for parent in node.get("defaults", []):  # the files each includes
            out |= _leaf_values(OmegaConf.load(CONF_DIR / f"{parent.lstrip('/')}.yaml"))
        out |= _leaf_values(node)
    return out


def _leaf_values(node, prefix=""):
    out = {}
    for key in node:
        if key == "defaults" or OmegaConf.is_interpolation(node, key):
            continue
        if OmegaConf.is_dict(node[key]):
            out |= _leaf_values(node[key], f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = node[key]
    return out


@pytest.mark.parametrize("algo", sorted(p.stem for p in (CONF_DIR / "algo").glob("*.yaml")))
def test_a_real_model_holds_no_toy_sized_value_under_any_algo(algo):
    """Every value the embedded model's tuning sets (any step, any algorithm) is another in each
    step a real-model command runs (--cfg job composes them the same way)."""
    for step in ("all", "sft", "reward", "ppo", "dpo"):
        toy = toy_values(step, algo)
        assert toy, (step, algo)  # every step has the embedded model's values
        cfg = composed([f"step={step}", f"algo={algo}", "model=opt-1.3b", "data=rm-static"])
        for key, toy_value in toy.items():
            assert value(cfg, key) != toy_value, (algo, step, key)


def test_cfg_job_of_a_real_model_under_grpo_has_deepspeed_chats_sizes():
    job = cfg_job(["model=opt-1.3b", "data=rm-static", "algo=grpo", "step=ppo"])
    assert job["ppo"]["rollout"]["per_device_batch_size"] == 4
    assert (job["ppo"]["kl"]["coef"], job["actor"]["optim"]["lr"]) == (0.04, 9.65e-6)


def test_the_tuning_is_chosen_by_the_model_option_and_never_read_from_disk(tmp_path, monkeypatch):
    """Which values run follows model=, never a probe of a model directory; a directory that is
    not the embedded model under model=tiny is refused, naming the fix."""
    from rlhf.checks import hub, validate
    from rlhf.config import TINY_VOCAB_SIZE
    from rlhf.modeling.loading import tiny_model_dir

    tiny = tiny_model_dir(compose().model, str(tmp_path / "cache"))
    assert yaml.safe_load((tiny / "config.json").read_text())["vocab_size"] == TINY_VOCAB_SIZE
    real = tmp_path / "opt"
    real.mkdir()
    (real / "config.json").write_text('{"model_type": "opt", "vocab_size": 50272}')
    for step, key in [("sft", "model.path"), ("dpo", "model.path"), ("ppo", "actor.model.path")]:
        kept = composed([f"step={step}", f"{key}={tiny}", f"critic.model.path={tiny}"])
        assert value(kept, "optim.lr") == {"sft": 2e-3, "dpo": 2e-5, "ppo": 1e-4}[step]
        validated(kept)
        refused = composed([f"step={step}", f"{key}={real}", f"critic.model.path={tiny}"])
        with pytest.raises(
            ConfigError, match=rf"{key}={real}: a model of 50272 tokens, under model=tiny"
        ):
            validated(refused)
        named = composed([f"step={step}", "model=opt-1.3b", f"{key}={real}"])
        assert value(named, "optim.lr") == published(step).get("optim.lr", 9.65e-6)
    on_hub = validated(composed(["step=sft", "model.path=facebook/opt-125m"]))
    monkeypatch.setattr(hub, "_hub_cached", lambda repo_id, kind: True)  # as once downloaded
    [problem] = validate.launch_problems(on_hub)
    assert problem.startswith("model.path=facebook/opt-125m: a hub model, under model=tiny")
    monkeypatch.setattr(hub, "_hub_cached", lambda repo_id, kind: False)
    monkeypatch.setattr(hub, "_hub_answer", lambda repo_id, kind: "unreachable")
    [problem] = validate.launch_problems(on_hub)  # the hub's own problem, alone
    assert "the hub is not reachable" in problem
    # step=all's later steps read exports not written yet: nothing to refuse
    later = tmp_path / "later" / "model"
    validated(composed(["step=dpo", f"model.path={later}"]), produced=(later,))


def test_a_value_set_anywhere_replaces_the_tuned_value():
    assert composed(["step=sft", "model=opt-1.3b", "optim.lr=1e-5"]).optim.lr == 1e-5
    assert composed(["step=sft", "optim.epochs=2"]).optim.epochs == 2
    recipe = composed(["experiment=opt-1.3b-350m", "step=ppo"])  # its own values
    assert (recipe.actor.optim.lr, recipe.critic.optim.lr, recipe.ppo.kl.coef) == (
        9.65e-6,
        5e-6,
        0.1,
    )


@pytest.mark.parametrize(("model", "batch"), [("tiny", 32), ("opt-125m", 4)])
def test_a_bad_value_at_a_tuned_key_is_reported_there(model, batch, tmp_path):
    """The embedded model's tuning and the real values set a key as any file does: its problems
    are reported at that key."""
    paths = [f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"]
    match = rf"ppo\.update\.per_device_batch_size={batch}: expected"
    with pytest.raises(ConfigError, match=match):
        validated(composed(["step=ppo", f"model={model}", "ppo.update.grad_accum=5", *paths]))


def test_cfg_job_at_step_all_lists_what_each_step_runs_with():
    proc = run_rlhf(["model=opt-1.3b", "data=rm-static", "--cfg", "job"], timeout=120)
    header = [ln for ln in proc.stdout.splitlines() if ln.startswith("#   ")]
    assert "#   optim.lr: sft 9.65e-06, reward 5e-05" in header
    assert "#   critic.optim.lr: ppo 5e-06" in header
    assert yaml.safe_load(proc.stdout)["step"]["name"] == "all"


def test_help_at_step_all_shows_each_steps_value():
    proc = run_rlhf(["--help", "optim.lr", "actor.optim.lr"], timeout=120)
    assert "optim.lr=0.002 (sft), 0.0002 (reward)" in proc.stdout
    assert "actor.optim.lr=0.0001 (ppo)" in proc.stdout


# --- item 2: PTX reads the user's text, never the toy's for other data --------------------------


def ptx_config(tmp_path: Path, *overrides: str):
    paths = [f"actor.model.path={tmp_path}", f"critic.model.path={tmp_path}"]
    return validated(composed(["step=ppo", "ppo.ptx.coef=1.0", *paths, *overrides]))


def test_ptx_reads_the_prompts_task_or_a_named_file(tmp_path):
    from rlhf.data.ptx_text import ptx_source

    assert ptx_source(ptx_config(tmp_path)) == "toy"  # data=toy: the toy task's statements
    assert ptx_source(ptx_config(tmp_path, "data=toy_facts")) == "toy_facts"
    text = tmp_path / "wiki.txt"
    text.write_text("Some pretraining text.\n")
    named = ptx_config(tmp_path, "data=rm-static", f"ppo.ptx.source={text}")
    assert ptx_source(named) == str(text)


def test_ptx_on_real_data_without_a_named_text_is_refused(tmp_path):
    with pytest.raises(ConfigError) as refused:
        ptx_config(tmp_path, "data=rm-static")
    assert "ppo.ptx.source=None: expected an existing .txt/.jsonl file" in str(refused.value)
    assert "(rm-static)" in str(refused.value)
    with pytest.raises(ConfigError, match=re.escape("ppo.ptx.source='/nowhere.txt'")):
        ptx_config(tmp_path, "data=rm-static", "ppo.ptx.source=/nowhere.txt")


# --- the real thing: a sweep through step=all and step=ppo, and what DeepSpeed built -----------

TINY_RUN = [
    *FAST,
    "step.max_steps=2",
    "step.eval_at_start=false",
    "data.max_eval_rows=16",
    "sft.gold_eval_prompts=4",
    "reward.gold_eval_prompts=4",
    "ppo.rollout.per_device_batch_size=4",
    "ppo.update.per_device_batch_size=4",
    "ppo.rollout.max_new_tokens=8",
    "ppo.eval.prompts=4",
    "ppo.eval.samples=1",
    "zero=stage2",
    "lora=r8",
]
ENGINE = re.compile(r"\] - (actor|critic): ZeRO-(\d), offload=(\w+) \(\w+\), LoRA rank (\d+) ")


def engines(job_dir: Path) -> dict[str, tuple[int, str, int]]:
    """What the PPO run in ``job_dir`` logged of its engines: role -> (stage, offload, rank)."""
    found = {}
    for line in (job_dir / "__main__.log").read_text().splitlines():
        if m := ENGINE.search(line):
            found[m[1]] = (int(m[2]), m[3], int(m[4]))
    return found


def sweep(tmp_path: Path, name: str, overrides: list[str], cache_dir: Path) -> Path:
    sweep_dir = tmp_path / name
    run_rlhf(
        ["-m", *TINY_RUN, *overrides, *cache_overrides(cache_dir), f"hydra.sweep.dir={sweep_dir}"],
        timeout=1200,
    )
    return sweep_dir


@pytest.mark.slow
def test_a_sweep_moves_offload_and_lora_rank_in_every_ppo_job(tmp_path, cache_dir):
    """2 jobs of step=all (tiny: 2 steps each; the offload moves, LoRA rank 8 in both), then 4
    of step=ppo from the first one's exports over both axes; each job's PPO engines have its
    offload and LoRA rank (before: the same in every job)."""
    offloads, ranks = "zero.offload=false,true", "lora.rank=4,8"
    pipelines = sweep(tmp_path, "all", ["step=all", offloads, "lora.rank=8"], cache_dir)
    first = job_dirs(pipelines)[("false", "8")]
    exports = [
        path_override("actor.model.path", first / "sft" / "model"),
        path_override("critic.model.path", first / "reward" / "model"),
    ]
    ppo = sweep(tmp_path, "ppo", ["step=ppo", offloads, ranks, *exports], cache_dir)
    for sweep_dir, want_ranks in ((pipelines, ("8",)), (ppo, ("4", "8"))):
        jobs = job_dirs(sweep_dir)
        assert set(jobs) == {(o, r) for o in ("false", "true") for r in want_ranks}
        for (offload, rank), job in jobs.items():
            want = (2, "cpu" if offload == "true" else "none", int(rank))
            assert engines(job) == {"actor": want, "critic": want}, job


def job_dirs(sweep_dir: Path) -> dict[tuple[str, str], Path]:
    """(zero.offload, lora.rank) as each job of the sweep was given them -> its directory."""
    out = {}
    for overrides in sweep_dir.glob("*/.hydra/overrides.yaml"):
        given = dict(line.split("=", 1) for line in yaml.safe_load(overrides.read_text()))
        out[(given["zero.offload"].lower(), given["lora.rank"])] = overrides.parent.parent
    return out

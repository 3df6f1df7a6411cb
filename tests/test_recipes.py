"""experiment=opt-1.3b-350m gives DeepSpeed-Chat's published values in each step, and the step-2
and step-3 sweeps are its grids. In-process composition only: nothing is built or downloaded.

Sources (microsoft/DeepSpeedExamples, applications/DeepSpeed-Chat/training/):
step2_reward_model_finetuning/training_scripts/single_node/run_350m.sh,
step3_rlhf_finetuning/training_scripts/opt/single_node/run_1.3b.sh and main.py's defaults, and the
opt/single_node/sweep/ scripts of both steps."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rlhf.checks.validate import validated
from rlhf.config import Config, ConfigError, register_configs
from rlhf.steps.all import step_overrides
from tests.conftest import (
    CONF_DIR,
    SWEEPS_DIR,
    assert_contains,
    compose,
    compose_sweep,
    sweep_axes,
    sweep_jobs,
)

register_configs()

RECIPE = "experiment=opt-1.3b-350m"
STEP_FILES = CONF_DIR / "experiment_step" / "opt-1.3b-350m"
STEP1_FOUR = [
    "rm-static",
    "full-hh-rlhf",
    "synthetic-instruct-gptj-pairwise",
    "rlhf-reward-datasets",
]


@pytest.fixture
def exports(tmp_path) -> list[str]:
    """Stand-ins for the SFT and reward exports step=ppo requires (validation wants directories)."""
    sft, reward = tmp_path / "sft" / "model", tmp_path / "reward" / "model"
    sft.mkdir(parents=True)
    reward.mkdir(parents=True)
    return [f"actor.model.path={sft}", f"critic.model.path={reward}"]


def recipe(step: str, *overrides: str) -> Config:
    return validated(compose([RECIPE, f"step={step}", *overrides]))


# --- the step files ------------------------------------------------------------------------------


@pytest.mark.parametrize("step", ["sft", "reward", "ppo"])
def test_step_file_holds_values_only_and_every_value_arrives(step, exports):
    """Selected through ${experiment}/${step}: Hydra allows no defaults list there."""
    path = STEP_FILES / f"{step}.yaml"
    assert path.read_text().splitlines()[0] == "# @package _global_"
    values = OmegaConf.load(path)
    assert "defaults" not in values
    if step == "ppo":  # the exports' paths: null in the file, given on the command line
        for role in ("actor", "critic"):
            assert values[role].model.pop("path") is None
    cfg = compose([RECIPE, f"step={step}", *(exports if step == "ppo" else [])])
    assert_contains(values, cfg, step)


def test_reward_step_has_the_published_step2_values():
    c = recipe("reward")
    assert c.step.name == "reward"
    # --model_name_or_path facebook/opt-350m, trained from the base model, --dropout 0.0
    assert (c.model.name, c.model.path, c.model.dropout) == ("opt-350m", "facebook/opt-350m", 0.0)
    assert list(c.data.sources) == STEP1_FOUR  # --data_path: the same four as step 1
    assert list(c.data.phase_split) == [2, 4, 4]
    assert (c.data.max_seq_len, c.data.seed, c.seed) == (512, 1234, 1234)
    o = c.optim
    assert (o.lr, o.weight_decay, o.epochs, o.scheduler) == (5e-5, 0.1, 1, "cosine")
    assert (o.warmup_steps, o.warmup_ratio, o.grad_accum) == (0, 0.0, 1)
    assert (o.micro_batch_size, o.eval_micro_batch_size) == (4, 4)
    assert (c.reward.loss, c.reward.score_position) == ("divergence_span", "last")
    assert c.lora.rank == 0
    assert c.zero.stage == 2  # the experiment's; the stage does not change the numbers


def test_ppo_step_has_the_published_step3_values(exports):
    c = recipe("ppo", *exports)
    assert c.step.name == "ppo"
    assert (c.actor.model.name, c.critic.model.name) == ("opt-1.3b", "opt-350m")
    assert c.actor.model.path.endswith("sft/model")
    assert c.critic.model.path.endswith("reward/model")
    assert (c.actor.model.dropout, c.critic.model.dropout) == (0.0, 0.0)  # --actor_dropout 0.0
    a, k = c.actor.optim, c.critic.optim
    assert (a.lr, k.lr) == (9.65e-6, 5e-6)  # Actor_Lr, Critic_Lr
    assert (a.weight_decay, k.weight_decay) == (0.0, 0.0)
    assert (a.warmup_steps, k.warmup_steps) == (100, 100)
    assert (a.scheduler, k.scheduler) == ("cosine", "cosine")
    assert (a.betas, a.max_grad_norm) == ([0.9, 0.95], 1.0)
    assert (c.actor.zero.stage, c.critic.zero.stage) == (2, 2)
    assert not c.actor.zero.offload and not c.critic.zero.offload
    assert (c.actor.lora.rank, c.critic.lora.rank) == (0, 0)
    # --enable_hybrid_engine: vLLM rollouts in its place
    assert c.ppo.rollout.engine == "vllm" and c.actor.hybrid_engine is False
    assert not c.actor.offload_reference and not c.critic.offload_reward_model
    p = c.ppo
    assert p.rollout.prompt_sources == ["rm-static"]  # --data_path Dahoas/rm-static
    assert list(c.data.sources) == STEP1_FOUR and list(c.data.phase_split) == [2, 4, 4]
    assert (c.data.max_prompt_len, p.rollout.max_new_tokens) == (256, 256)
    assert c.data.overlong_prompts == "skip"  # phase 3 drops prompts over 256 tokens
    assert (p.rollout.per_device_batch_size, p.update.per_device_batch_size) == (4, 4)
    assert (p.rollout.batches, p.update.epochs, p.update.prompt_epochs, p.update.grad_accum) == (
        1,
        1,
        1,
        1,
    )
    # ppo_trainer.py's constants
    assert (p.kl.coef, p.kl.estimator, p.kl.adaptive) == (0.1, "k1", False)
    assert (p.loss.clip_range, p.loss.value_clip, p.reward.clip) == (0.2, 0.2, 5.0)
    assert (p.advantage.gamma, p.advantage.lam, p.rollout.min_response_tokens) == (1.0, 0.95, 2)
    assert not p.advantage.whiten and not p.reward.normalize
    assert (p.ema.enabled, p.ema.beta) == (True, 0.992)  # --enable_ema
    assert p.ptx.coef == 0.0  # no unsupervised dataset: PTX off
    assert p.rollout.stop_at_eos and not p.rollout.greedy


def test_ppo_step_asks_for_the_exports():
    with pytest.raises(ConfigError) as err:
        recipe("ppo")
    assert "actor.model.path=None" in str(err.value)
    assert "critic.model.path=None" in str(err.value)


def test_sft_step_keeps_the_step1_values():
    c = recipe("sft")
    assert (c.model.name, c.model.path, c.model.dropout) == ("opt-1.3b", "facebook/opt-1.3b", None)
    assert (c.optim.lr, c.optim.weight_decay, c.optim.epochs) == (9.65e-6, 0.0, 16)
    assert (c.optim.micro_batch_size, c.optim.eval_micro_batch_size) == (8, 8)
    assert c.sft.loss_on_prompt and c.zero.stage == 2
    assert (
        c.reward.loss == "pairwise" and c.ppo.rollout.prompt_sources == []
    )  # no other step's values


def test_step_all_trains_the_reward_model_from_the_base_opt_350m(tmp_path):
    """step=all reads pipeline.* from its own composition (no step file), then composes each step
    from the same overrides: the reward step must keep its OPT-350m."""
    c = validated(compose([RECIPE]))
    assert c.step.name == "all" and c.pipeline.reward_from_sft is False
    (tmp_path / "sft" / "model").mkdir(parents=True)  # step=all runs each step after the last
    reward = recipe("reward", *step_overrides("reward", tmp_path, c.pipeline.reward_from_sft, True))
    assert reward.model.path == "facebook/opt-350m"
    # no extra SFT model is loaded on every rank to correlate scores with gold (PPO's evaluation
    # reports it on the answers it samples anyway)
    assert reward.reward.gold_policy is None
    (tmp_path / "reward" / "model").mkdir(parents=True)
    ppo = recipe("ppo", *step_overrides("ppo", tmp_path, c.pipeline.reward_from_sft, True))
    assert ppo.actor.model.path == str(tmp_path / "sft" / "model")
    assert ppo.critic.model.path == str(tmp_path / "reward" / "model")


def test_command_line_wins_over_the_step_files(exports):
    c = recipe("reward", "zero=stage3", "model.path=facebook/opt-125m", "optim.lr=1e-5")
    assert (c.zero.stage, c.model.path, c.optim.lr) == (3, "facebook/opt-125m", 1e-5)
    c = recipe("ppo", *exports, "actor.zero.stage=3", "actor.hybrid_engine=false")
    assert (c.actor.zero.stage, c.critic.zero.stage, c.actor.hybrid_engine) == (3, 2, False)


# --- the sweeps ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["step2", "step3"])
def test_sweep_header_gives_its_commands(name):
    lines = (SWEEPS_DIR / f"{name}.yaml").read_text().splitlines()
    comments = "\n".join(ln for ln in lines if ln.startswith("#"))
    assert lines[0].startswith("# DeepSpeed-Chat's")
    assert f"python -m rlhf -cd sweeps -cn {name} {RECIPE}" in comments
    if name == "step3":
        assert "actor.model.path=RUN/sft/model critic.model.path=RUN/reward/model" in comments
        assert "actor.hybrid_engine=false,true" in comments


def test_step2_sweep_is_deepspeed_chats_grid():
    axes = sweep_axes("step2")
    assert axes["zero"] == ["stage2", "stage3"]
    assert [v.lower() for v in axes["zero.offload"]] == ["false", "true"]
    assert len(sweep_jobs(axes)) == 4
    for overrides in ([], [RECIPE]):
        base = validated(compose_sweep("step2", overrides))
        assert base.step.name == "reward"
        for stage in (2, 3):
            for offload in (False, True):
                job = validated(
                    compose_sweep(
                        "step2", [*overrides, f"zero=stage{stage}", f"zero.offload={offload}"]
                    )
                )
                assert (job.zero.stage, job.zero.offload) == (stage, offload)
    published = validated(compose_sweep("step2", [RECIPE]))
    assert (published.model.name, published.optim.lr, published.model.dropout) == (
        "opt-350m",
        5e-5,
        0.0,
    )
    other = validated(compose_sweep("step2", ["model=opt-125m", "data=rm-static"]))
    assert (other.model.name, list(other.data.sources)) == ("opt-125m", ["rm-static"])


def test_step3_sweep_is_deepspeed_chats_grid_without_the_hybrid_engine(exports):
    axes = sweep_axes("step3", exports)
    assert axes["zero"] == ["stage2", "stage3"]
    assert [v.lower() for v in axes["zero.offload"]] == ["false", "true"]
    [lora_axis] = set(axes) - {"zero", "zero.offload"}
    assert len(sweep_jobs(axes)) == 8  # on CPU: no hybrid-engine axis
    assert len(sweep_jobs({**axes, "actor.hybrid_engine": ["false", "true"]})) == 16
    ranks = set()
    for overrides in (exports, [*exports, RECIPE]):
        for stage in (2, 3):
            for offload in (False, True):
                for lora in axes[lora_axis]:
                    job = validated(
                        compose_sweep(
                            "step3",
                            [
                                *overrides,
                                f"zero=stage{stage}",
                                f"zero.offload={offload}",
                                f"{lora_axis}={lora}",
                            ],
                        )
                    )
                    assert job.step.name == "ppo"
                    # --actor_zero_stage ${z} --critic_zero_stage ${z}; --offload for both
                    assert (job.actor.zero.stage, job.critic.zero.stage) == (stage, stage)
                    assert (job.actor.zero.offload, job.critic.zero.offload) == (offload, offload)
                    assert job.actor.hybrid_engine is False and job.ppo.ema.enabled is False
                    assert job.critic.lora.rank == 0  # --critic_lora_dim 0
                    ranks.add(job.actor.lora.rank)
                    if job.actor.lora.rank:  # --actor_lora_dim 128 --actor_lora_module_name
                        lo = job.actor.lora
                        assert (lo.alpha, lo.module_filter) == (128, "decoder.layers.")
                        assert not lo.only_optimize_lora and lo.learning_rate == 5e-4
    assert ranks == {0, 128}
    hybrid = [*exports, RECIPE, "actor.hybrid_engine=true", "ppo.rollout.engine=hf"]
    on_gpu = validated(compose_sweep("step3", hybrid))
    assert on_gpu.actor.hybrid_engine is True and not on_gpu.critic.hybrid_engine
    published = validated(compose_sweep("step3", [*exports, RECIPE]))
    assert (published.actor.optim.lr, published.critic.optim.lr) == (9.65e-6, 5e-6)
    assert (published.ppo.rollout.prompt_sources, published.ppo.rollout.max_new_tokens) == (
        ["rm-static"],
        256,
    )


def test_step3_job_dirs_leave_out_the_export_paths(exports):
    dirname = compose_sweep("step3", exports, hydra_config=True).hydra.job.config.override_dirname
    assert {"actor.model.path", "critic.model.path"} <= set(dirname.exclude_keys)
    base = compose(hydra_config=True).hydra.job.config.override_dirname.exclude_keys
    assert set(base) <= set(dirname.exclude_keys)

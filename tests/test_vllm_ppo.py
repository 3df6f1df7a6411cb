"""PPO and the critic-free estimators with rollouts on vLLM (ppo.rollout.engine=vllm), end to
end on a reduced embedded default: the engine is given the actor's weights after every update
(its log-probs then equal the trainer's in fp32, iteration after iteration), the correction is
logged, groups come from vLLM's n and ReMax's baseline from its greedy decoding, a run killed
with SIGKILL resumes to the uninterrupted run's metrics, ZeRO-3 on 2 ranks runs with one
engine a rank, and the engine sleeps through every update (emulated on CPU)."""

import signal

import pytest

from tests.conftest import FAST, cache_overrides, read_metrics, read_summary, run_rlhf
from tests.test_vllm_memory import assert_released_for_every_update, decoder_calls

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# vLLM's CPU attention takes head sizes of 32 and up: FAST's 64-wide model has 16
SHAPE = {"model.init.hidden_size": "128", "model.init.word_embed_proj_dim": "128"}
SMALL = [o for o in FAST if o.split("=", 1)[0] not in SHAPE] + [
    f"{k}={v}" for k, v in SHAPE.items()
]
KILLED = -signal.SIGKILL


@pytest.fixture(scope="module")
def sft(cache_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vllm-sft")
    # init_seed 0: an SFT model whose greedy answers 3 PPO updates visibly change (the
    # assertion on eval/reward below); seed 1234's initial weights change none of 8
    overrides = ["step=sft", *SMALL, "step.max_steps=40", "model.init_seed=0"]
    overrides += cache_overrides(cache_dir)
    run_rlhf(overrides, run_dir=run_dir)
    return run_dir / "model"


def _ppo(sft, cache_dir, *overrides) -> list[str]:
    return [
        "step=ppo",
        *SMALL,
        f"actor.model.path={sft}",
        f"critic.model.path={sft}",  # a causal LM: the critic gets a new value head
        "ppo.reward.function=tests.test_critic_free:answer_length",
        "ppo.rollout.per_device_batch_size=8",
        "ppo.update.per_device_batch_size=8",
        "ppo.rollout.max_new_tokens=16",
        "ppo.eval.prompts=8",
        "ppo.rollout.engine=vllm",
        "ppo.rollout.logprob_gap_interval=1",
        "step.log_interval=1",
        *overrides,
        *cache_overrides(cache_dir),
    ]


def _training_rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "ppo/actor_loss" in r]


def test_ppo_pushes_the_weights_after_every_update(sft, cache_dir, tmp_path):
    run_rlhf(_ppo(sft, cache_dir, "step.max_steps=3"), tmp_path)
    rows = _training_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["perf/sync_s"] > 0
        # the engine samples with the weights the trainer scores with (fp32), every iteration
        assert row["ppo/logprob_diff_max"] < 1e-4
        assert row["ppo/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert row["ppo/tis_clipfrac"] == 0
    assert abs(rows[-1]["ppo/kl"]) > 0  # the actor did move away from the reference
    summary = read_summary(tmp_path)
    assert summary["eval/reward"] != summary["initial/eval/reward"]


@pytest.mark.parametrize(
    "estimator",
    [
        ["ppo.advantage.estimator=grpo", "ppo.rollout.samples_per_prompt=4"],
        ["ppo.advantage.estimator=remax"],
    ],
    ids=["grpo", "remax"],
)
def test_critic_free_estimators_sample_on_vllm(estimator, sft, cache_dir, tmp_path):
    run_rlhf(
        _ppo(
            sft,
            cache_dir,
            "step.max_steps=2",
            "ppo.rollout.top_k=20",
            "ppo.rollout.top_p=0.9",
            *estimator,
        ),
        tmp_path,
    )
    rows = _training_rows(tmp_path)
    assert len(rows) == 2
    # a truncated sampler, scored by the trainer under the same truncation
    assert all(r["ppo/logprob_diff_max"] < 1e-4 for r in rows)
    assert not (tmp_path / "critic").exists()


def test_opd_samples_on_vllm_and_the_teacher_scores_on_the_trainer(sft, cache_dir, tmp_path):
    """algo=opd with vLLM's rollouts: the teacher (here the student's own start) scores the
    sampled tokens; no critic, no reward model; the teacher answers the held-out prompts once
    on its own module."""
    overrides = _ppo(sft, cache_dir, "step.max_steps=2", "algo=opd", f"teacher.model.path={sft}")
    run_rlhf(
        [o for o in overrides if not o.startswith("ppo.reward.function")],
        tmp_path,
    )
    rows = _training_rows(tmp_path)
    assert len(rows) == 2
    assert rows[0]["ppo/teacher_kl"] == pytest.approx(0.0, abs=1e-5)  # the start is the teacher
    assert all(r["ppo/logprob_diff_max"] < 1e-4 for r in rows)
    first = read_metrics(tmp_path)[0]
    assert "eval/teacher_gold_accuracy" in first and "eval/teacher_kl" in first
    assert not (tmp_path / "critic").exists()


def test_a_run_killed_mid_ppo_resumes_to_the_uninterrupted_metrics(sft, cache_dir, tmp_path):
    overrides = _ppo(sft, cache_dir, "step.max_steps=4", "step.checkpoint_interval=2")
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_rlhf(overrides, reference)
    killed = run_rlhf(
        [*overrides, "debug.kill_at_step=3"],
        resumed,
        check=False,
        timeout=1800,
    )
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    run_rlhf(overrides, resumed)  # resume=auto from step 2

    def comparable(run_dir):
        return [
            {k: v for k, v in row.items() if not k.startswith("perf/")}
            for row in read_metrics(run_dir)
        ]

    assert len(_training_rows(reference)) == 4
    assert comparable(resumed) == comparable(reference)


def test_zero3_on_two_ranks_with_an_engine_a_rank(sft, cache_dir, tmp_path):
    overrides = _ppo(sft, cache_dir, "step.max_steps=2", "zero=stage3")
    run_rlhf(overrides, tmp_path, nproc=2, timeout=1800)
    rows = _training_rows(tmp_path)
    assert len(rows) == 2
    assert all(r["ppo/logprob_diff_max"] < 1e-4 for r in rows)  # both ranks' engines synced


def test_the_engine_sleeps_through_every_update_and_wakes_to_the_pushed_weights(
    tiny_lm_dir, cache_dir, tmp_path
):
    """Sleep mode as on a GPU (emulated on CPU: a sleep zeroes the engine's weights): the loop
    releases the engine after each rollout, the push after the update wakes it and reloads the
    weights, so every rollout samples what the trainer scores (fp32: the gap at rounding)."""
    calls = decoder_calls(
        tmp_path,
        tiny_lm_dir,
        "ppo.rollout.engine=vllm",
        "ppo.rollout.logprob_gap_interval=1",
        "step.log_interval=1",
        *cache_overrides(cache_dir),
        sleep=True,
    )
    assert_released_for_every_update(calls, iterations=2)
    rows = _training_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["ppo/logprob_diff_max"] < 1e-4 for r in rows)


def test_partial_rollouts_on_vllm_carry_groups_and_resume_with_them_in_flight(
    sft, cache_dir, tmp_path
):
    """ppo.asynchronous on vLLM: each chunk is one engine call with per-row bounds; the fresh
    tokens' sampler log-probs equal the trainer's (the gap is measured on them only: the
    carried ones are older policies'), TIS weighs the carried ones, and a run killed with
    groups in flight resumes to the uninterrupted rows."""
    overrides = _ppo(
        sft,
        cache_dir,
        "ppo.advantage.estimator=grpo",
        "ppo.rollout.samples_per_prompt=2",
        "ppo.rollout.per_device_batch_size=4",
        "ppo.asynchronous.min_finished=0.5",
        "ppo.asynchronous.chunk_tokens=4",
        "ppo.asynchronous.max_staleness=1",
        "step.max_steps=4",
        "step.checkpoint_interval=2",
    )
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_rlhf(overrides, reference, timeout=1800)
    rows = _training_rows(reference)
    assert len(rows) == 4
    assert all(r["rollout/carried_groups"] == 4 for r in rows)  # 8 in flight, 4 train
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    gaps = [r["ppo/logprob_diff_max"] for r in rows if "ppo/logprob_diff_max" in r]
    assert gaps and max(gaps) < 1e-4  # logged where a phase trained fresh tokens
    assert all("ppo/tis_weight_mean" in r for r in rows)  # the correction of the carried tokens
    killed = run_rlhf([*overrides, "debug.kill_at_step=3"], resumed, check=False)
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    run_rlhf(overrides, resumed, timeout=1800)
    strip = [
        [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(d)]
        for d in (reference, resumed)
    ]
    assert strip[1] == strip[0]


def test_a_rollout_rank_decodes_on_its_own_engine_one_version_ahead(sft, cache_dir, tmp_path):
    """ppo.asynchronous.rollout_ranks on vLLM: rank 1 alone builds an engine and decodes, rank 0
    trains; each answer after the first iteration trains one version old, its tokens weighed
    by TIS against the trainer's proximal log-probs; at k = 0 (the weights that train it) the
    sampler's log-probs equal the trainer's after each push."""
    overrides = _ppo(
        sft,
        cache_dir,
        "ppo.advantage.estimator=grpo",
        "ppo.rollout.samples_per_prompt=2",
        "ppo.rollout.per_device_batch_size=4",
        "ppo.asynchronous.rollout_ranks=1",
        "step.max_steps=3",
    )
    fresh = tmp_path / "fresh"
    run_rlhf(overrides, fresh, nproc=2, timeout=1800)
    rows = _training_rows(fresh)
    assert [r["rollout/staleness_max"] for r in rows] == [0, 0, 0]
    assert all(r["ppo/logprob_diff_max"] < 1e-4 for r in rows)  # pushed weights, fp32

    ahead = tmp_path / "ahead"
    proc = run_rlhf(
        [*overrides, "ppo.asynchronous.max_staleness=1"],
        ahead,
        nproc=2,
        timeout=1800,
    )
    rows = _training_rows(ahead)
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    # no token of the weights that train it after the first: no gap measured, none logged
    assert ["ppo/logprob_diff_max" in r for r in rows] == [True, False, False]
    assert all("ppo/tis_weight_mean" in r for r in rows)
    console = proc.stdout + proc.stderr
    assert "rollout rank 1: decoding for trainers [0] on vllm" in console
    assert console.count("vLLM engine started") == 1  # the trainer built none

"""Partial rollouts (ppo.asynchronous): the pool of groups in flight ends a phase once a generation
batch's worth of groups has finished, carries the rest with their tokens, behaviour log-probs
and versions into the next phase, applies the staleness bound, and hands the collector a Rollout
whose log-probs are the planted behaviour ones (the ratio's old log-probs with no correction;
the correction's sampler log-probs, against a recomputed proximal policy, with one)."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rlhf.data.collate import left_pad
from rlhf.registry import ESTIMATORS
from rlhf.rl.collector import Collector
from rlhf.rl.experience import Experience
from rlhf.rl.generation import Rollout, Sampling
from rlhf.rl.partial import (
    Answer,
    Group,
    PartialRollouts,
    PartialSettings,
    chunk_outcome,
    pool_size,
    too_stale,
    trained_rollout,
)
from rlhf.rl.rollouts import HFDecoder
from tests import test_ppo as ppo_tests
from tests.test_critic_free import SHAPING, LengthReward

PAD, BOS, EOS = ppo_tests.PAD, ppo_tests.BOS, ppo_tests.EOS


class ScriptedDecoder:
    """Answers each prompt [BOS, n, ...] with tokens 10, 11, ... up to n of them, then EOS;
    each token's log-prob -0.5. Records every call's prompts and bounds."""

    def __init__(self):
        self.calls: list[tuple[list[list[int]], list[int]]] = []

    def generate(self, prompts, sampling, seed=None, group_size=1, temperature=None, max_new=None):
        assert group_size == 1 and temperature is not None
        self.calls.append(([list(p) for p in prompts], list(max_new)))
        answers, ended = [], []
        for prompt, bound in zip(prompts, max_new, strict=True):
            length, done = prompt[1], len(prompt) - 2  # answer tokens so far
            full = [10 + k for k in range(done, length)] + [EOS]
            answers.append(full[:bound])
            ended.append(EOS in full[:bound])
        prompt_ids, prompt_mask = left_pad([list(p) for p in prompts], PAD)
        width = max(len(a) for a in answers)
        ids = torch.full((len(answers), width), PAD)
        for i, answer in enumerate(answers):
            ids[i, : len(answer)] = torch.tensor(answer)
        mask = torch.arange(width) < torch.tensor([len(a) for a in answers]).unsqueeze(1)
        return Rollout(
            torch.cat([prompt_ids, ids], 1),
            torch.cat([prompt_mask, mask.long()], 1),
            prompt_ids.shape[1],
            mask,
            torch.where(mask, -0.5, 0.0),
            torch.tensor(ended),
        )


def _pool(
    groups=2,
    pool=4,
    chunk=2,
    budget=16,
    staleness=8,
    on_stale="regenerate",
    refills=None,
    phase_tokens=None,
):
    settings = PartialSettings(groups, pool, chunk, budget, staleness, on_stale, phase_tokens)
    refills = refills if refills is not None else []

    def refill(count, phase):
        refills.append((count, phase))
        return [[BOS, 1]] * count

    return PartialRollouts(ScriptedDecoder(), settings, PAD, refill)


def _answers(rollout: Rollout) -> list[list[int]]:
    response = rollout.sequences[:, rollout.prompt_width :]
    return [row[mask].tolist() for row, mask in zip(response, rollout.response_mask, strict=True)]


SAMPLING = Sampling(16)


def test_the_pool_holds_enough_groups_that_the_batch_is_min_finished_of_them():
    assert pool_size(4, 1.0) == 4
    assert pool_size(4, 0.5) == 8
    assert pool_size(3, 0.75) == 4
    assert pool_size(4, 0.3) == 14  # ceil(13.33)


def test_min_finished_one_waits_for_every_answer_and_returns_the_batch_in_order():
    partial = _pool(groups=2, pool=2)
    rollout = partial.generate([[BOS, 5], [BOS, 1]], SAMPLING, 0, 1, 1.0)
    assert _answers(rollout) == [[10, 11, 12, 13, 14, EOS], [10, EOS]]
    assert partial.carried() == 0 and rollout.ended.all()
    # chunks of 2: the long answer took ceil(6 / 2) decoding calls, the short one stopped early
    assert [len(prompts) for prompts, _ in partial.decoder.calls] == [2, 1, 1]


def test_a_phase_ends_once_enough_groups_finished_and_the_long_tail_continues_under_the_next_version():
    refills = []
    partial = _pool(groups=2, pool=3, refills=refills)
    partial.set_version(7)
    first = partial.generate([[BOS, 1], [BOS, 9]], SAMPLING, 0, 1, 1.0)
    assert refills == [(1, 0)]  # the pool topped up to 3 groups
    assert _answers(first) == [[10, EOS], [10, EOS]]  # the short prompt and the refill's
    assert partial.carried() == 1 and partial.pool[0].answers[0].tokens == [10, 11]
    partial.set_version(8)
    second = partial.generate([[BOS, 12], [BOS, 3]], SAMPLING, 0, 1, 1.0)
    # the carried long answer comes first, whole: its first two tokens from version 7
    assert _answers(second)[0] == [10 + k for k in range(9)] + [EOS]
    assert partial.last_versions[0, :4].tolist() == [7, 7, 8, 8]
    assert second.logprobs[0, :10].tolist() == [-0.5] * 10
    fresh = partial.fresh_mask(second)
    assert fresh[0, :2].tolist() == [False, False] and fresh[0, 2:10].all()
    stats = partial.metrics()
    assert stats["rollout/staleness_max"] == 1.0
    assert stats["rollout/spanning_versions"] == pytest.approx(1 / 4)  # one of four answers


def test_a_spent_token_budget_ends_the_phase_with_the_groups_finished_so_far():
    partial = _pool(groups=2, pool=2, phase_tokens=4)
    rollout = partial.generate([[BOS, 1], [BOS, 9]], SAMPLING, 0, 1, 1.0)
    # one chunk of 2 tokens each spent the 4: the short group trains, the long one waits
    assert _answers(rollout) == [[10, EOS]]
    assert len(partial.decoder.calls) == 1
    assert partial.carried() == 1 and partial.pool[0].answers[0].tokens == [10, 11]
    # the next batch's prompts take the room left in the pool (one), the other is skipped
    partial.set_version(1)
    second = partial.generate([[BOS, 1], [BOS, 2]], SAMPLING, 0, 1, 1.0)
    assert _answers(second) == [[10, EOS]]
    assert [g.prompt for g in partial.pool] == [[BOS, 9]]  # the long one: 4 tokens so far
    assert partial.pool[0].answers[0].versions == [0, 0, 1, 1]
    stats = partial.metrics()
    assert stats["rollout/trained_group_share"] == 0.5  # 2 of 4 groups in two phases
    assert stats["rollout/budget_ended_phases"] == 1.0
    assert stats["rollout/skipped_prompts"] == 1.0


def test_a_spent_token_budget_waits_for_one_finished_group():
    partial = _pool(groups=2, pool=2, phase_tokens=1)
    rollout = partial.generate([[BOS, 7], [BOS, 3]], SAMPLING, 0, 1, 1.0)
    # the budget was spent at the first chunk, with nothing finished: a second chunk finished
    # the 3-token answer (and its end-of-text), and the phase ended there
    assert _answers(rollout) == [[10, 11, 12, EOS]]
    assert len(partial.decoder.calls) == 2 and partial.carried() == 1


def test_a_budget_the_phase_does_not_spend_trains_the_whole_batch():
    partial = _pool(groups=2, pool=3, phase_tokens=100)
    rollout = partial.generate([[BOS, 1], [BOS, 2]], SAMPLING, 0, 1, 1.0)
    assert len(_answers(rollout)) == 2
    stats = partial.metrics()
    assert stats["rollout/trained_group_share"] == 1.0
    assert stats["rollout/budget_ended_phases"] == 0.0
    # without a budget the two metrics are not logged
    unbudgeted = _pool(groups=2, pool=3)
    unbudgeted.generate([[BOS, 1], [BOS, 2]], SAMPLING, 0, 1, 1.0)
    assert "rollout/trained_group_share" not in unbudgeted.metrics()


def test_a_group_trains_only_when_every_answer_has_finished():
    partial = _pool(groups=1, pool=2)
    # group_size 2: the prompt's two answers are the same scripted length, the refill's are 1
    rollout = partial.generate([[BOS, 6]], SAMPLING, 0, 2, 1.0)
    assert _answers(rollout) == [[10, EOS], [10, EOS]]  # the refill's group, both answers
    assert len(partial.pool) == 1 and len(partial.pool[0].answers) == 2


@pytest.mark.parametrize("on_stale", ["regenerate", "drop"])
def test_a_group_that_would_train_on_too_old_tokens_is_regenerated_or_dropped(on_stale):
    refills = []
    partial = _pool(groups=1, pool=2, staleness=1, on_stale=on_stale, refills=refills)
    partial.set_version(0)
    partial.generate([[BOS, 1]], SAMPLING, 0, 1, 1.0)  # [BOS, 1] trains, the refill's waits
    partial.pool = [Group([BOS, 9], [Answer([10, 11], [-0.5] * 2, [0, 0])])]  # planted, version 0
    partial.set_version(1)  # staleness 1: kept
    partial.generate([[BOS, 1]], SAMPLING, 0, 1, 1.0)
    assert partial.pool[0].answers[0].tokens[:2] == [10, 11]
    partial.set_version(2)  # its oldest token would be 2 versions old
    partial.generate([[BOS, 1]], SAMPLING, 0, 1, 1.0)
    stats = partial.metrics()
    if on_stale == "regenerate":
        assert stats["rollout/regenerated_episodes"] == 1 and stats["rollout/dropped_episodes"] == 0
        assert partial.pool[0].prompt == [BOS, 9]
        assert set(partial.pool[0].answers[0].versions) == {2}  # decoded anew
    else:
        assert stats["rollout/dropped_episodes"] == 1 and stats["rollout/regenerated_episodes"] == 0
        assert refills == [(1, 0), (1, 0)]  # its slot went to a fresh prompt


def test_staleness_counts_versions_between_a_token_and_its_update():
    group = Group([BOS], [Answer([10], [-1.0], [3], True, True)])
    assert not too_stale(group, 4, 1) and too_stale(group, 5, 1)
    assert not too_stale(Group([BOS], [Answer()]), 100, 0)  # nothing sampled yet


def test_a_chunk_finishes_an_answer_at_its_end_its_budget_or_when_cut_short():
    assert chunk_outcome(2, 4, True, 6, 16) == {"finished": True, "ended": True}
    assert chunk_outcome(4, 4, False, 16, 16) == {"finished": True, "ended": False}
    assert chunk_outcome(3, 4, False, 7, 16) == {"finished": True, "ended": False}
    assert chunk_outcome(4, 4, False, 8, 16) == {"finished": False, "ended": False}


def test_the_trained_rollout_is_left_padded_prompts_then_right_padded_answers():
    groups = [
        Group([BOS, 5, 6], [Answer([10, EOS], [-1.0, -2.0], [0, 1], True, True)]),
        Group([BOS], [Answer([11, 12, 13], [-3.0] * 3, [1] * 3, True, False)]),
    ]
    rollout = trained_rollout(groups, PAD, prompt_width=4)
    assert rollout.prompt_width == 4
    assert rollout.sequences.tolist() == [
        [PAD, BOS, 5, 6, 10, EOS, PAD],
        [PAD, PAD, PAD, BOS, 11, 12, 13],
    ]
    assert rollout.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1]]
    assert rollout.logprobs.tolist() == [[-1.0, -2.0, 0.0], [-3.0, -3.0, -3.0]]
    assert rollout.ended.tolist() == [True, False]


def test_the_pool_in_flight_survives_a_checkpoint(tmp_path):
    partial = _pool(groups=2, pool=3)
    partial.set_version(4)
    partial.generate([[BOS, 1], [BOS, 9]], SAMPLING, 0, 1, 1.0)
    partial.save(tmp_path)
    restored = _pool(groups=2, pool=3)
    restored.load(tmp_path)
    assert restored.state_dict() == partial.state_dict()
    assert restored.version == 4 and restored.pool[0].answers[0].versions == [4, 4]
    # both continue alike
    a = partial.generate([[BOS, 2], [BOS, 3]], SAMPLING, 0, 1, 1.0)
    b = restored.generate([[BOS, 2], [BOS, 3]], SAMPLING, 0, 1, 1.0)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.logprobs, b.logprobs)


def test_a_checkpoint_without_the_pool_is_refused_by_name(tmp_path):
    with pytest.raises(Exception, match=r"partial-rank0\.pt: missing"):
        _pool().load(tmp_path)


# --- the planted behaviour log-probs reach the loss's inputs ---------------------------------------


def _models_and_decoder(estimator: str):
    """The models ``estimator`` scores with (a critic, a teacher where it reads one), the config
    the collector reads and the hf decoder of the actor; the same seeds every call."""
    spec = ESTIMATORS[estimator]
    models = SimpleNamespace(
        actor=ppo_tests.Trained(ppo_tests._lm(seed=5)),
        reference=ppo_tests._lm(seed=6),
        critic=ppo_tests._critic() if spec.needs_critic else None,
        reward=LengthReward(),
        teacher=ppo_tests._lm(seed=7) if spec.teacher else None,
    )
    cfg = SimpleNamespace(actor=SimpleNamespace(zero=SimpleNamespace(stage=0)))
    return models, cfg, HFDecoder(cfg, models.actor, PAD, EOS)


def _planted_collector(rollout_logprobs: bool, keep_sampler_logprobs: bool):
    models, cfg, decoder = _models_and_decoder("grpo")
    settings = PartialSettings(1, 2, 4, 5, 8, "regenerate")
    partial = PartialRollouts(decoder, settings, PAD, None)
    planted = [-0.25, -1.5, -3.0]  # what versions 2 and 3 sampled, not the actor of version 5
    partial.pool = [
        Group(
            [BOS, 5, 6],
            [
                Answer([12, 13, EOS], planted, [2, 3, 3], True, True),
                Answer([14, EOS], planted[:2], [3, 3], True, True),
            ],
        )
    ]
    partial.set_version(5)
    collect = Collector(
        models,
        cfg,
        PAD,
        EOS,
        Sampling(5),
        rollout_logprobs=rollout_logprobs,
        rollouts=partial,
        keep_sampler_logprobs=keep_sampler_logprobs,
    )
    exp = collect([[BOS, 7]], replace(SHAPING, estimator="grpo", group_size=2))
    return exp, torch.tensor([planted, [*planted[:2], 0.0]]), partial


def test_without_a_correction_the_ratio_is_taken_against_the_planted_behaviour_logprobs():
    exp, planted, partial = _planted_collector(rollout_logprobs=True, keep_sampler_logprobs=False)
    assert exp.sequences[:, exp.prompt_width :].tolist()[0] == [12, 13, EOS]  # the carried group
    mask = exp.response_mask
    torch.testing.assert_close(exp.old_logprobs[mask], planted[mask])
    assert partial.carried() == 1  # the new prompt's group waits, unfinished or finished


def test_with_a_correction_the_proximal_policy_is_recomputed_and_the_behaviour_is_planted():
    exp, planted, _ = _planted_collector(rollout_logprobs=False, keep_sampler_logprobs=True)
    mask = exp.response_mask
    torch.testing.assert_close(exp.sampler_logprobs[mask], planted[mask])
    # the old (proximal) log-probs: the current actor's forward, not what the sampler recorded
    proximal = ppo_tests._manual_logprobs(ppo_tests._lm(seed=5), [BOS, 5, 6], [12, 13, EOS])
    torch.testing.assert_close(exp.old_logprobs[0], proximal, atol=1e-5, rtol=0)
    assert not torch.allclose(exp.old_logprobs[mask], planted[mask])


# --- min_finished = 1: the partial path is the synchronous loop -------------------------------------

NO_BASELINE = [name for name, spec in ESTIMATORS.items() if not spec.greedy_baseline]


def _experience(estimator: str, partial: bool) -> Experience:
    """One generation batch of three prompts (groups of two where the estimator groups), sampled
    from seed 11, collected by the synchronous collector or through a pool of min_finished=1
    whose chunk is the whole answer budget."""
    models, cfg, rollouts = _models_and_decoder(estimator)
    prompts = [[BOS, 5, 6, 7], [BOS, 8], [BOS, 9, 10]]
    if partial:
        rollouts = PartialRollouts(rollouts, PartialSettings(3, 3, 6, 6, 0, "drop"), PAD, None)
    collect = Collector(
        models, cfg, PAD, EOS, Sampling(6), rollout_logprobs=True, rollouts=rollouts
    )
    shaping = replace(SHAPING, estimator=estimator, group_size=2 if estimator != "gae" else 1)
    return collect(prompts, shaping, seed=11)


@pytest.mark.parametrize("estimator", NO_BASELINE)
def test_a_pool_that_waits_for_every_group_collects_what_the_synchronous_loop_does(estimator):
    sync, partial = _experience(estimator, False), _experience(estimator, True)
    assert sync.response_mask.any(dim=1).all()
    mask = sync.response_mask
    assert torch.equal(mask, partial.response_mask)
    for name in Experience._fields:
        a, b = getattr(sync, name), getattr(partial, name)
        if isinstance(a, torch.Tensor) and a.shape == mask.shape and a.is_floating_point():
            a, b = a[mask], b[mask]  # what follows an answer's end is never read
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
        else:
            assert a == b, name


# --- the pool a run builds ---------------------------------------------------------------------------


@pytest.mark.parametrize(("staleness", "warned"), [(4, True), (5, False)])
def test_a_bound_some_answers_cannot_meet_is_warned_with_the_one_they_can(
    staleness, warned, caplog, tmp_path
):
    """data=toy_count's budget is 96 tokens: 16-token chunks need 6 phases, max_staleness 5."""
    from rlhf.config import TINY_VOCAB_SIZE
    from rlhf.config.resolve import Facts, resolve
    from rlhf.steps.ppo_parts import partial_rollouts
    from tests.conftest import compose
    from tests.test_config_async import validated

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": TINY_VOCAB_SIZE}))
    overrides = ["step=ppo", "data=toy_count", f"actor.model.path={tmp_path}"]
    overrides += ["ppo.reward.function=toy_count_gold", "ppo.advantage.estimator=grpo"]
    overrides += ["ppo.rollout.samples_per_prompt=4", "ppo.asynchronous.min_finished=0.5"]
    overrides += ["ppo.asynchronous.chunk_tokens=16", f"ppo.asynchronous.max_staleness={staleness}"]
    cfg = resolve(validated(compose(overrides)), Facts()).config
    with caplog.at_level("WARNING"):
        partial = partial_rollouts(cfg, ScriptedDecoder(), PAD, [{"prompt_ids": [BOS, 1]}])
    assert partial.settings.pool == 2 * partial.settings.groups and partial.settings.budget == 96
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert bool(said) == warned
    if warned:
        assert "max_staleness >= 5" in said[0] and "80 tokens" in said[0]

"""Partial rollouts of multi-turn episodes (rlhf.rl.partial_episodes): whole episodes carried
across phases and versions, each turn decoded a chunk at a time and answered by the environment
when it ends (a tool call split over chunks included), observations never trained on; with one
chunk a turn and nothing carried they are the synchronous episode loop's, record and all."""

from __future__ import annotations

import torch

from rlhf.rl.generation import Rollout, Sampling
from rlhf.rl.partial import PartialSettings
from rlhf.rl.partial_episodes import PartialEpisodes
from tests.test_episodes import END, PAD, Calculator, episodes, ids

BUDGET = 40
SAMPLING = Sampling(max_new_tokens=BUDGET)


def _script(a: int, b: int, extra: int) -> tuple[list[int], list[int], list[int]]:
    """A prompt and its two turns: a calculator call, then the answer (``extra`` words longer)."""
    prompt = ids(f"\n\nHuman: What is {a} + {b}?\n\nAssistant:")
    call = ids(f"<call> {a} + {b}</call>")
    answer = [*ids(f" The answer is {a + b}" + " indeed" * extra), END]
    return prompt, call, answer


SCRIPTS = [_script(1, 2, 0), _script(30, 4, 9), _script(5, 60, 2), _script(7, 8, 14)]


class ByContext:
    """A decoder whose answer depends on the context alone: the rest of the script's current
    turn (so a turn continued from any point goes on as it would have); each token's
    log-prob -0.25."""

    def __init__(self):
        self.calls = 0

    def _rest(self, context: list[int]) -> list[int]:
        for prompt, call, answer in SCRIPTS:
            if context[: len(prompt)] == prompt:
                done = context[len(prompt) :]
                if len(done) < len(call):
                    return call[len(done) :]
                observation = ids(f" = {_sum(call)}")
                return answer[len(done) - len(call) - len(observation) :]
        raise AssertionError(f"no script for {context}")

    def generate(self, prompts, sampling, seed=None, group_size=1, temperature=None, max_new=None):
        self.calls += 1
        bounds = max_new or [sampling.max_new_tokens] * len(prompts)
        answers = [self._rest(list(p))[:bound] for p, bound in zip(prompts, bounds, strict=True)]
        width = max(1, max(len(a) for a in answers))
        left = max(map(len, prompts))
        prompt = torch.tensor([[PAD] * (left - len(p)) + list(p) for p in prompts])
        response = torch.tensor([a + [PAD] * (width - len(a)) for a in answers])
        mask = response != PAD
        return Rollout(
            torch.cat([prompt, response], 1),
            torch.cat([prompt != PAD, mask], 1).long(),
            left,
            mask,
            torch.full(response.shape, -0.25),
        )


def _sum(call: list[int]) -> int:
    from tests.test_episodes import TOKENIZER

    text = TOKENIZER.decode(call).strip().removeprefix("<call>").removesuffix("</call>")
    a, b = text.split("+")
    return int(a) + int(b)


def _pool(min_finished_pool: int, chunk: int, env=None, phase_tokens=None) -> PartialEpisodes:
    player = episodes(ByContext(), env or Calculator(), budget=BUDGET)
    prompts = [p for p, _, _ in SCRIPTS]
    settings = PartialSettings(
        groups=2,
        pool=min_finished_pool,
        chunk_tokens=chunk,
        budget=BUDGET,
        max_staleness=10,
        on_stale="regenerate",
        phase_tokens=phase_tokens,
    )
    return PartialEpisodes(player, settings, PAD, lambda count, phase: prompts[2 : 2 + count])


def _rows(rollout) -> list[tuple[list[int], list[int], list[bool]]]:
    """Each row's prompt, its ids after the prompt, and which of those the model generated."""
    out = []
    for row in range(rollout.sequences.shape[0]):
        real = rollout.attention_mask[row].bool()
        prompt = rollout.sequences[row, : rollout.prompt_width][real[: rollout.prompt_width]]
        after = rollout.sequences[row, rollout.prompt_width :][real[rollout.prompt_width :]]
        action = rollout.response_mask[row][real[rollout.prompt_width :]]
        out.append((prompt.tolist(), after.tolist(), action.tolist()))
    return out


def test_one_chunk_a_turn_and_nothing_carried_plays_the_synchronous_episodes():
    prompts = [p for p, _, _ in SCRIPTS[:2]]
    synchronous = episodes(ByContext(), Calculator(), budget=BUDGET).generate(
        prompts, SAMPLING, None, 1, 1.0
    )
    partial = _pool(2, BUDGET).generate(prompts, SAMPLING, None, 1, 1.0)
    assert _rows(partial) == _rows(synchronous)
    assert torch.equal(partial.record.turns, synchronous.record.turns)  # 2 each: call, answer
    assert torch.equal(partial.record.env_reward, synchronous.record.env_reward)
    assert partial.record.metrics["tool_calls"].tolist() == [1.0, 1.0]
    assert torch.equal(partial.ended, synchronous.ended)


def test_a_phase_token_budget_trains_the_first_episode_to_end_and_carries_the_other():
    prompts = [p for p, _, _ in SCRIPTS[:2]]
    synchronous = _rows(
        episodes(ByContext(), Calculator(), budget=BUDGET).generate(prompts, SAMPLING, None, 1, 1.0)
    )
    pool = _pool(2, 3, phase_tokens=1)  # spent at the first chunk: the phase ends at one episode
    rollout = pool.generate(prompts, SAMPLING, None, 1, 1.0)
    [row] = _rows(rollout)
    assert row in synchronous  # whole, turns and observation, as the synchronous loop's
    assert pool.carried() == 1 and not pool.pool[0].finished
    assert pool.metrics()["rollout/trained_group_share"] == 0.5


def test_episodes_carried_over_phases_and_versions_end_as_the_synchronous_ones():
    env = Calculator()
    pool = _pool(4, 3, env)  # half the pool's groups end a phase; 3-token chunks split calls
    synchronous = {
        tuple(prompt): row
        for prompt, row in zip(
            [p for p, _, _ in SCRIPTS],
            _rows(
                episodes(ByContext(), Calculator(), budget=BUDGET).generate(
                    [p for p, _, _ in SCRIPTS], SAMPLING, None, 1, 1.0
                )
            ),
            strict=True,
        )
    }
    prompts = [p for p, _, _ in SCRIPTS[:2]]
    trained, spanning = [], 0
    for version in range(4):
        pool.set_version(version)
        rollout = pool.generate(prompts, SAMPLING, None, 1, 1.0)
        versions = pool.last_versions
        for row, (prompt, after, action) in enumerate(_rows(rollout)):
            assert (prompt, after, action) == synchronous[tuple(prompt)]
            model = versions[row][: len(after)]
            observed = [not a for a in action]
            assert all(v == -1 for v, o in zip(model.tolist(), observed, strict=True) if o)
            assert all(v >= 0 for v, o in zip(model.tolist(), observed, strict=True) if not o)
            spanning += len({v for v in model.tolist() if v >= 0}) > 1
            trained.append(prompt)
    assert len(trained) == 8 and spanning > 0  # long answers were carried across versions
    # every call the environment answered was a whole call, however the chunks split it
    assert all(turn.endswith("</call>") or "answer" in turn for _, turn in env.seen)
    metrics = pool.metrics()
    assert metrics["rollout/staleness_max"] >= 1 and metrics["rollout/carried_groups"] == 2


def test_the_pool_round_trips_through_a_checkpoint_mid_turn(tmp_path):
    pool = _pool(4, 3)
    prompts = [p for p, _, _ in SCRIPTS[:2]]
    pool.generate(prompts, SAMPLING, None, 1, 1.0)
    pool.save(tmp_path)
    restored = _pool(4, 3)
    restored.load(tmp_path)
    assert [c.episode.ids for g in restored.pool for c in g.answers] == [
        c.episode.ids for g in pool.pool for c in g.answers
    ]
    pool.set_version(1)
    restored.set_version(1)
    assert _rows(restored.generate(prompts, SAMPLING, None, 1, 1.0)) == _rows(
        pool.generate(prompts, SAMPLING, None, 1, 1.0)
    )

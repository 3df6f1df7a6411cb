"""Apart rollouts (ppo.asynchronous.rollout_ranks), the trainer and the rollout rank in two
threads of this process over a real gloo bridge: the rollout rank decodes each batch with the
weights the schedule names (k versions behind the iteration that trains it), a checkpoint
takes the answers in flight, a broken schedule is refused, and the weights pushed are the
actor's to the last bit."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from rlhf.rl.generation import Sampling
from rlhf.rl.remote import RemoteRollouts, Request
from rlhf.rl.rollout_server import serve
from rlhf.rl.rollouts import ModuleDecoder
from rlhf.runtime.bridge import Bridge
from tests import test_ppo as ppo_tests

PAD, EOS = ppo_tests.PAD, ppo_tests.EOS
SAMPLING = Sampling(max_new_tokens=6, temperature=1.0)
ITERATIONS = 4


def _bridges() -> list[Bridge]:
    """Rank 0 trains, rank 1 generates: one bridge each, over one in-memory store."""
    store, groups = torch.distributed.HashStore(), [None, None]

    def join(rank: int) -> None:
        groups[rank] = torch.distributed.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [Bridge(groups[r], r, trainers=1, rollout_ranks=1) for r in (0, 1)]


def _batches(step: int) -> list[tuple[list[list[int]], int]]:
    """Iteration ``step``'s one generation batch: two prompts and a seed of its own."""
    return [([[1, 3 + step, 4], [1, 5]], 100 + step)]


def _request(step, batch, version, prompts, seed) -> Request:
    return Request(step, batch, version, prompts, seed, SAMPLING, 2, 1.0)


class Pair:
    """A trainer's RemoteRollouts and a rollout rank serving it in a thread."""

    def __init__(self, lag: int):
        trainer, generator = _bridges()
        self.actor = ppo_tests._lm(seed=0)
        cfg = SimpleNamespace(
            device="cpu",
            actor=SimpleNamespace(model=SimpleNamespace(dtype="fp32")),
            ppo=SimpleNamespace(rollout=SimpleNamespace(engine="hf")),
        )
        self.server = threading.Thread(target=serve, args=(cfg, generator), daemon=True)
        self.server.start()
        self.remote = RemoteRollouts(
            trainer, _batches, _request, ITERATIONS, lag, (PAD, EOS), 0, 1 << 20
        )

    def decoded_with(self, weights: dict, step: int):
        """What iteration ``step``'s batch decodes to with ``weights`` (in this process)."""
        model = ppo_tests._lm(seed=0)
        model.load_state_dict(weights)
        model.eval()
        prompts, seed = _batches(step)[0]
        return ModuleDecoder(model, PAD, EOS, synced=False).generate(
            prompts, SAMPLING, seed, 2, 1.0
        )

    def collect(self, step: int):
        prompts, seed = _batches(step)[0]
        return self.remote.generate(prompts, SAMPLING, seed, 2, 1.0)

    def update(self, version: int) -> None:
        """A stand-in for an optimizer step, then its weights pushed. (Its own generator: torch's
        global one is the rollout thread's while it decodes, as it would be its process's.)"""
        noise = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for parameter in self.actor.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=noise))
        self.remote.push(self.actor, version)


def _same(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and torch.allclose(a.logprobs, b.logprobs)


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_each_batch_is_decoded_with_the_weights_k_versions_behind_the_one_it_trains(lag):
    pair = Pair(lag)
    versions, rollouts, staleness = [], [], []  # the actor's weights, version by version
    pair.remote.push(pair.actor, 0)
    versions.append({k: v.clone() for k, v in pair.actor.state_dict().items()})
    pair.remote.start(0)
    for step in range(ITERATIONS):
        pair.remote.request_ahead(step)
        rollouts.append(pair.collect(step))
        staleness.append(pair.remote.last_staleness)
        pair.update(step + 1)
        versions.append({k: v.clone() for k, v in pair.actor.state_dict().items()})
    pair.remote.close()
    pair.server.join(timeout=30)
    assert not pair.server.is_alive()  # it took every version pushed, then left
    # decoded here once the rollout thread is gone (torch's RNG is one for both threads)
    for step, rollout in enumerate(rollouts):
        sampled_by = max(0, step - lag)
        assert _same(rollout, pair.decoded_with(versions[sampled_by], step)), (step, sampled_by)
        if sampled_by != step:  # and not by the weights that train it
            assert not _same(rollout, pair.decoded_with(versions[step], step))
        assert staleness[step] == step - sampled_by
    metrics = pair.remote.metrics()
    assert metrics["rollout/staleness_max"] == lag
    assert 0 < metrics["rollout/staleness_mean"] <= lag or lag == 0


def test_a_checkpoint_takes_the_answers_in_flight_and_a_resumed_trainer_trains_them(tmp_path):
    pair = Pair(lag=2)
    pair.remote.push(pair.actor, 0)
    pair.remote.start(0)
    pair.remote.request_ahead(0)
    pair.collect(0)
    pair.update(1)
    assert [r.step for r in pair.remote.pending] == [1, 2]  # requested, not taken
    pair.remote.save(tmp_path)
    assert not pair.remote.pending and [r.step for r, _ in pair.remote.ready] == [1, 2]

    resumed = RemoteRollouts(
        pair.remote.bridge, _batches, _request, ITERATIONS, 2, (PAD, EOS), 0, 1
    )
    resumed.load(tmp_path)  # what a resumed trainer trains at iterations 1 and 2
    for step in (1, 2):  # (it sends nothing: the rollout rank is the first trainer's)
        prompts, seed = _batches(step)[0]
        restored = resumed.generate(prompts, SAMPLING, seed, 2, 1.0)
        assert _same(restored, pair.collect(step))
    pair.remote.close()
    pair.server.join(timeout=30)


def test_a_checkpoint_of_another_lag_is_refused_by_name(tmp_path):
    from rlhf.config import ConfigError

    pair = Pair(lag=1)
    pair.remote.push(pair.actor, 0)
    pair.remote.start(0)
    pair.remote.save(tmp_path)
    other = RemoteRollouts(pair.remote.bridge, _batches, _request, ITERATIONS, 2, (PAD, EOS), 0, 1)
    with pytest.raises(ConfigError, match=r"max_staleness=2.*decoded 1 iterations ahead"):
        other.load(tmp_path)
    pair.remote.request_ahead(0)
    pair.collect(0)
    pair.remote.close()
    pair.server.join(timeout=30)


def test_answers_to_another_batch_than_the_one_collected_stop_the_run():
    pair = Pair(lag=0)
    pair.remote.push(pair.actor, 0)
    pair.remote.start(0)
    pair.remote.request_ahead(0)
    prompts, seed = _batches(0)[0]
    with pytest.raises(RuntimeError, match="iteration 0's batch 0, which is not the batch"):
        pair.remote.generate(prompts, SAMPLING, seed + 1, 2, 1.0)
    pair.remote.close()
    pair.server.join(timeout=30)


def test_a_later_job_of_a_multirun_keeps_the_launch_split(monkeypatch):
    from rlhf.config import ConfigError
    from rlhf.runtime import bridge, dist

    monkeypatch.setattr(bridge, "_bridge", Bridge(None, rank=1, trainers=1, rollout_ranks=1))
    with pytest.raises(ConfigError, match=r"rollout_ranks=0: this launch's ranks were split"):
        dist.init_distributed("cpu", rollout_ranks=0)
    dist.init_distributed("cpu", rollout_ranks=1)  # a rollout rank: no group to join again
    assert not dist.is_initialized()

"""Rollouts decoded apart from training (ppo.asynchronous.rollout_ranks): the last n ranks of a
launch only generate, the others only train (rlhf.runtime.bridge splits them). OpenRLHF's and
verl's one-step-off rollouts, with AReaL's bound: the batches of iteration i + k are decoded
while iteration i trains (k: ppo.asynchronous.max_staleness), so every trained token is exactly
k versions old once the pipeline is full; k = 0 decodes each batch with the weights it trains,
nothing overlapping.

Trainer side, :class:`RemoteRollouts`, the collector's decoder: it sends each of its generation
batches (the plan's prompts and seed for that iteration, known ahead) to its rollout rank k
iterations ahead, the actor's weights after every update (trainer 0, to every rollout rank,
ZeRO-3 gathered a bucket at a time) and takes the answers back in order. A request names the
weight version that decodes it: the pushes so far when it was sent. The answers still in
flight at a checkpoint are received and saved in it (one file a trainer), so a resumed run
trains the same answers the uninterrupted one would.

Rollout side, :func:`serve`: one loop a rollout rank, no DeepSpeed, no process group of the
trainers: the actor's architecture from trainer 0, its weights as they come, every request
decoded on the run's engine (hf: rlhf's own loop; vllm: an engine of its own) and answered.
The answers carry the sampler's log-probs: the behaviour policy of the correction."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf.config import Config, ConfigError
from rlhf.rl.generation import Rollout, Sampling
from rlhf.rl.weight_sync import hf_model, hf_weights
from rlhf.runtime.bridge import TO_ROLLOUTS, TO_TRAINERS, Bridge
from rlhf.runtime.dist import all_reduce_sum, max_over_ranks

log = logging.getLogger(__name__)

WEIGHTS = 3  # the bridge's tag for trainer 0's weights (requests: TO_ROLLOUTS)


@dataclass
class Request:
    """One generation batch to decode: for iteration ``step``'s batch ``batch``, with the
    weights of ``version``."""

    step: int
    batch: int
    version: int
    prompts: list[list[int]]
    seed: int | None
    sampling: Sampling
    group_size: int
    temperature: float


@dataclass
class Stop:
    """No more requests; the last weight version trainer 0 pushed (the rollout rank takes them
    all before it leaves, or trainer 0's sends would never complete)."""

    version: int


@dataclass
class Lag:
    """What the trained answers' staleness was and how long the trainer waited for them."""

    tokens: float = 0.0
    stale_sum: float = 0.0
    stale_max: float = 0.0
    wait_s: float = 0.0
    batches: float = 0.0

    def metrics(self) -> dict[str, float]:
        """Collective: ``rollout/staleness_mean`` / ``_max`` per trained token (versions between
        the weights that sampled it and those it trains), ``rollout/wait_s`` the seconds a
        trainer waited for answers an iteration (verl's phase wait; 0: generation fully hidden
        behind the update). Then starts over."""
        tokens, stale, wait, batches = all_reduce_sum(
            self.tokens, self.stale_sum, self.wait_s, self.batches
        )
        out = {
            "rollout/staleness_mean": stale / max(tokens, 1.0),
            "rollout/staleness_max": max_over_ranks(self.stale_max),
            "rollout/wait_s": wait / max(batches, 1.0),
        }
        self.__init__()
        return out


class RemoteRollouts:
    """The collector's decoder on a trainer when rollout ranks generate. ``batches(step)``: this
    trainer's generation batches of iteration ``step`` as (prompt ids, seed), as the loop
    collects them; ``iterations``: how many the run has; ``lag``: k."""

    def __init__(
        self,
        bridge: Bridge,
        batches: Callable[[int], list[tuple[list[list[int]], int | None]]],
        request: Callable[[int, int, int, list[list[int]], int | None], Request],
        iterations: int,
        lag: int,
        ids: tuple[int, int],
        zero_stage: int,
        bucket_bytes: int,
        environment: str | None = None,
    ):
        """``ids``: the tokenizer's pad and end-of-text ids (the rollout ranks load none);
        ``zero_stage``: the actor's (ZeRO-3: every trainer gathers its weights for a push),
        ``bucket_bytes`` how many a gather and a message hold; ``environment``: the task
        whose multi-turn episodes the rollout ranks play (None: single-turn)."""
        self.bridge, self.batches, self.request = bridge, batches, request
        self.pad_id, self.end_id = ids
        self.zero_stage, self.bucket_bytes = zero_stage, bucket_bytes
        self.environment = environment
        self.iterations, self.lag = iterations, lag
        self.rollout_rank = bridge.rollout_rank_of(bridge.rank)
        self.version = -1  # the last weights pushed
        self.pending: deque[Request] = deque()  # sent, answers not taken yet
        self.ready: deque[tuple[Request, Rollout]] = deque()  # taken, not trained yet
        self.sends: list = []
        self.lag_stats = Lag()
        self.trained_version = 0  # the version the last returned answers train
        self.last_staleness = 0

    # -- the loop's calls
    def start(self, step: int) -> None:
        """The run starts (or resumes) at iteration ``step``, its weights pushed: the batches of
        iterations step .. step + k - 1 not restored from the checkpoint are requested."""
        restored = {(r.step, r.batch) for r, _ in self.ready}
        for ahead in range(step, min(step + self.lag, self.iterations)):
            self._request_step(ahead, skip=restored)

    def request_ahead(self, step: int) -> None:
        """Iteration ``step`` begins: request the batches of iteration step + k."""
        self.trained_version = step
        if step + self.lag < self.iterations:
            self._request_step(step + self.lag)

    def generate(
        self,
        prompts,
        sampling: Sampling,
        seed: int | None = None,
        group_size: int = 1,
        logprobs_temperature: float | None = None,
        max_new=None,
    ) -> Rollout:
        """See :class:`rlhf.rl.rollouts.Decoder`: the answers requested k iterations ago for this
        batch (its prompts and seed checked), with the sampler's log-probs."""
        if not self.ready:
            self._take_one()
        request, rollout = self.ready.popleft()
        if request.prompts != [list(p) for p in prompts] or request.seed != seed:
            raise RuntimeError(
                f"rollout ranks answered iteration {request.step}'s batch {request.batch}, "
                "which is not the batch being collected: the request schedule broke"
            )
        staleness = self.trained_version - request.version
        tokens = float(rollout.response_mask.sum())
        self.lag_stats.tokens += tokens
        self.lag_stats.stale_sum += staleness * tokens
        self.lag_stats.stale_max = max(self.lag_stats.stale_max, float(staleness))
        self.lag_stats.batches += 1
        self.last_staleness = staleness
        return rollout

    def fresh_mask(self, rollout: Rollout) -> torch.Tensor:
        """(B, R) the answer tokens sampled by the weights that train them (all, or none)."""
        return rollout.response_mask & (self.last_staleness == 0)

    def push(self, actor, version: int) -> None:
        """The actor's weights as ``version`` to every rollout rank (trainer 0 sends; under
        ZeRO-3 every trainer gathers with it). The first push sends the architecture first."""
        sends = self.sends = [s for s in self.sends if not s.done()]
        sender = self.bridge.rank == 0
        if sender and self.version < 0:
            model = hf_model(actor)
            architecture = {
                "config": model.config,
                "pad_id": self.pad_id,
                "end_id": self.end_id,
                "environment": self.environment,
            }
            for dst in self.bridge.rollout_ranks_list():
                sends += self.bridge.send(architecture, dst, WEIGHTS)
        if sender or self.zero_stage == 3:
            weights = hf_weights(actor, self.zero_stage, self.bucket_bytes)
            for bucket in weight_buckets(weights, self.bucket_bytes):
                if sender:
                    for dst in self.bridge.rollout_ranks_list():
                        sends += self.bridge.send((version, bucket), dst, WEIGHTS)
            if sender:
                for dst in self.bridge.rollout_ranks_list():
                    sends += self.bridge.send((version, None), dst, WEIGHTS)  # the version whole
        self.version = version

    def close(self) -> None:
        """The run is over: the rollout rank stops once it has every pushed version."""
        self.sends += self.bridge.send(Stop(self.version), self.rollout_rank, TO_ROLLOUTS)
        for sent in self.sends:
            sent.wait()
        self.sends = []

    def metrics(self) -> dict[str, float]:
        return self.lag_stats.metrics()

    # -- checkpoints: the answers in flight are part of the run's state
    def state_dict(self) -> dict:
        """Every answer requested and not yet trained, received now, with its request."""
        while self.pending:
            self._take_one()
        return {"ready": list(self.ready), "lag": self.lag}

    def load_state_dict(self, state: dict) -> None:
        if state["lag"] != self.lag:
            raise ConfigError(
                f"ppo.asynchronous.max_staleness={self.lag}: the checkpoint holds answers "
                f"decoded {state['lag']} iterations ahead; resume with max_staleness="
                f"{state['lag']} or start over with resume=never"
            )
        self.ready = deque(state["ready"])

    def save(self, directory: Path) -> list[Path]:
        path = Path(directory) / f"apart-rank{self.bridge.rank}.pt"
        torch.save(self.state_dict(), path)
        return [path]

    def load(self, directory: Path) -> None:
        path = Path(directory) / f"apart-rank{self.bridge.rank}.pt"
        if not path.is_file():
            raise ConfigError(
                f"{path}: missing; this checkpoint holds no rollouts in flight (it was written "
                "without ppo.asynchronous.rollout_ranks or by another rank count); resume with "
                "the settings that wrote it or start over with resume=never"
            )
        self.load_state_dict(torch.load(path, weights_only=False))

    # -- requests and answers
    def _request_step(self, step: int, skip: Iterable[tuple[int, int]] = ()) -> None:
        for batch, (prompts, seed) in enumerate(self.batches(step)):
            if (step, batch) in skip:
                continue
            request = self.request(step, batch, self.version, prompts, seed)
            self.sends += self.bridge.send(request, self.rollout_rank, TO_ROLLOUTS)
            self.pending.append(request)

    def _take_one(self) -> None:
        """Receive the oldest request's answers (the rollout rank answers in order)."""
        started = time.perf_counter()
        rollout = self.bridge.recv(self.rollout_rank, TO_TRAINERS)
        self.lag_stats.wait_s += time.perf_counter() - started
        self.ready.append((self.pending.popleft(), rollout))


def weight_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterable[dict[str, torch.Tensor]]:
    """The (name, tensor) stream as dicts of about ``bucket_bytes`` each (CPU copies)."""
    bucket, size = {}, 0
    for name, tensor in weights:
        bucket[name] = tensor.detach().to("cpu", copy=True)
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = {}, 0
    if bucket:
        yield bucket


# --- the rollout ranks ---------------------------------------------------------------------------


@dataclass
class Server:
    """A rollout rank's engine and the weight version it holds."""

    bridge: Bridge
    load: Callable[[dict[str, torch.Tensor]], None]
    decode: Callable[[Request], Rollout]
    version: int = -1
    sends: list = field(default_factory=list)

    def take_weights(self, version: int) -> None:
        """Load trainer 0's pushes until the engine holds ``version`` (each version whole, in
        one load: vLLM drops its prefix cache once a push)."""
        weights: dict[str, torch.Tensor] = {}
        while self.version < version:
            pushed, bucket = self.bridge.recv(0, WEIGHTS)
            if bucket is not None:
                weights.update(bucket)
                continue
            self.load(weights)
            self.version, weights = pushed, {}

    def run(self) -> None:
        """Answer the served trainers' requests in turn until each has sent Stop."""
        trainers = self.bridge.served_trainers()
        while True:
            stops = []
            for trainer in trainers:
                message = self.bridge.recv(trainer, TO_ROLLOUTS)
                if isinstance(message, Stop):
                    stops.append(message.version)
                    continue
                self.take_weights(message.version)
                rollout = self.decode(message)
                self.sends = [s for s in self.sends if not s.done()]
                self.sends += self.bridge.send(rollout, trainer, TO_TRAINERS)
            if stops:  # (answers not taken by then never will be: nothing waits for them)
                self.take_weights(max(stops))
                return


def serve(cfg: Config, bridge: Bridge) -> None:
    """A rollout rank's whole run: the actor's architecture (the tokenizer's pad and end ids, the
    task's environment) from trainer 0, an engine for it (ppo.rollout.engine), whole episodes
    against the environment on a multi-turn task, then :meth:`Server.run`. SIGTERM is ignored:
    a preempted run's trainers save the answers in flight, which this rank must still send; it
    ends with their Stop, or when they are gone (the bridge fails)."""
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    architecture = bridge.recv(0, WEIGHTS)
    environment = architecture["environment"]
    log.info(
        "rollout rank %d: decoding for trainers %s on %s%s",
        bridge.rank,
        bridge.served_trainers(),
        cfg.ppo.rollout.engine,
        f", episodes against {environment}" if environment else "",
    )
    engine = (VLLMServing if cfg.ppo.rollout.engine == "vllm" else HFServing)(cfg, architecture)
    decoder = engine.decoder
    if environment:
        decoder = episode_player(cfg, decoder, environment, architecture["end_id"])

    def decode(request: Request) -> Rollout:
        return decoder.generate(
            request.prompts, request.sampling, request.seed, request.group_size, request.temperature
        )

    try:
        Server(bridge, engine.load, decode).run()
    finally:
        engine.close()
    log.info("rollout rank %d: done", bridge.rank)


def episode_player(cfg: Config, decoder, environment: str, end_id: int):
    """``decoder`` playing whole episodes against the task ``environment`` (as the trainers'
    own player would: the same tokenizer, turn bounds and budget)."""
    from rlhf import tasks
    from rlhf.rl.episodes import EpisodeRollouts
    from rlhf.rl.ppo_models import load_tokenizer_pair, max_new_tokens

    env = tasks.resolve(environment)
    tokenizer = load_tokenizer_pair(cfg)
    bounds, budget = cfg.ppo.rollout.multi_turn, max_new_tokens(cfg)
    return EpisodeRollouts(decoder, env, tokenizer, bounds, budget, end_id, synced=False)


class HFServing:
    """The actor's architecture decoding in rlhf's own loop (the trainer's hf path)."""

    def __init__(self, cfg: Config, architecture: dict):
        from transformers import AutoModelForCausalLM

        from rlhf.rl.rollouts import ModuleDecoder
        from rlhf.runtime.engine import TORCH_DTYPES, device_type

        dtype = TORCH_DTYPES[cfg.actor.model.dtype]
        model = AutoModelForCausalLM.from_config(architecture["config"], dtype=dtype)
        self.model = model.to(device_type(cfg.device)).eval()
        self.state = self.model.state_dict()
        ids = architecture["pad_id"], architecture["end_id"]
        self.decoder = ModuleDecoder(self.model, *ids, synced=False)

    @torch.no_grad()
    def load(self, weights: dict[str, torch.Tensor]) -> None:
        for name, tensor in weights.items():
            self.state[name].copy_(tensor)

    def close(self) -> None:
        pass


class VLLMServing:
    """A vLLM engine of the rollout rank's own (the trainer's vllm path)."""

    def __init__(self, cfg: Config, architecture: dict):
        from transformers import AutoModelForCausalLM

        from rlhf.rl.rollouts import VLLMDecoder

        with torch.device("meta"):  # the engine holds the weights; the module its shape only
            shape = AutoModelForCausalLM.from_config(architecture["config"])
        ids = architecture["pad_id"], architecture["end_id"]
        self.decoder = VLLMDecoder(cfg, shape, *ids, cfg.actor.model.dtype)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        self.decoder.engine.push(iter(weights.items()))

    def close(self) -> None:
        self.decoder.close()  # its process groups before the interpreter's exit

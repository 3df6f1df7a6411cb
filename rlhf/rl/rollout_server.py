"""A rollout rank's whole run (ppo.asynchronous.rollout_ranks; the trainers' side is
rlhf.rl.remote): no DeepSpeed, no process group of the trainers. The actor's architecture comes
from trainer 0, its weights as they come, and every request is decoded on the run's engine (hf:
rlhf's own loop; vllm: an engine of its own), as whole episodes on a multi-turn task, and
answered in order."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlhf.config import Config
from rlhf.rl.generation import Rollout
from rlhf.rl.remote import Request, Stop
from rlhf.runtime.bridge import TO_ROLLOUTS, TO_TRAINERS, WEIGHTS, Bridge

log = logging.getLogger(__name__)


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

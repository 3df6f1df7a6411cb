"""``python tests/decoder_calls_worker.py EVENTS [--sleep] OVERRIDES...``: ``python -m rlhf
OVERRIDES`` with the rollout decoder's calls (generate, release, sync) and the PPO update
written to EVENTS, one name a line, in the order they happen. --sleep (vLLM's CPU build, which
has no sleep mode): the engine sleeps as on a GPU, a sleep dropping its weights (zeroed, as
level 2 discards them), so a rollout after a wake without a push would sample garbage."""

from __future__ import annotations

import functools
import runpy
import sys


def main() -> None:
    events_path, args = sys.argv[1], sys.argv[2:]
    sleep = args[:1] == ["--sleep"]
    overrides = args[1:] if sleep else args
    events = open(events_path, "a", buffering=1)  # noqa: SIM115 (open for the whole run)

    def recorded(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            events.write(name + "\n")
            return fn(*a, **k)

        return wrapper

    from rlhf.rl import rollouts
    from rlhf.steps import ppo

    for decoder in (rollouts.HFDecoder, rollouts.VLLMDecoder):
        # release and sync: only the decoder that holds weights of its own has them
        for name in ("generate", "release", "sync"):
            if hasattr(decoder, name):
                setattr(decoder, name, recorded(name, getattr(decoder, name)))
    ppo.ppo_update = recorded("update", ppo.ppo_update)
    if sleep:
        emulate_sleep_mode()

    sys.argv = ["rlhf", *overrides]
    # as `python -m rlhf` (Hydra finds conf/ from the main module's file)
    runpy.run_module("rlhf", run_name="__main__", alter_sys=True)


def emulate_sleep_mode() -> None:
    from rlhf.rl.vllm_engine import VLLMEngine

    built = VLLMEngine.__init__

    def init(self, *args, **kwargs):
        built(self, *args, **kwargs)
        llm = self.llm

        def drop_weights(level):
            llm.apply_model(lambda model: [p.data.zero_() for p in model.parameters()])

        self.sleeps = True
        llm.sleep = drop_weights
        llm.wake_up = lambda tags=None: True

    VLLMEngine.__init__ = init


if __name__ == "__main__":
    main()

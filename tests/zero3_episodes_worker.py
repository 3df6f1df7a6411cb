"""One rank of the ZeRO-3 multi-turn check (run by tests with torchrun --nproc_per_node 2): an
actor partitioned by ZeRO-3 plays episodes whose length depends on the rank (rank 0's end after
one turn, rank 1's after three), so rank 0 runs out of live episodes first and must keep taking
part in rank 1's collective generate. Each rank prints one "rank R ok ..." line or fails."""

from __future__ import annotations

import argparse

import deepspeed
import torch
from rank_report import report  # tests/, the script's own directory
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.config import MultiTurnConfig
from rlhf.rl.episodes import EpisodeRollouts
from rlhf.rl.experience import response_logprobs
from rlhf.rl.generation import Sampling
from rlhf.rl.rollouts import ModuleDecoder
from rlhf.runtime.dist import init_distributed, rank, teardown
from rlhf.tasks import Episode, Step


class RankTurns:
    """Ends every episode after ``turns`` turns; any of many frequent tokens ends a turn."""

    name = "rank_turns"

    def __init__(self, turns: int, stops: tuple[str, ...]):
        self.turns, self.turn_stops = turns, stops

    def step(self, episode: Episode, turn: str) -> Step:
        return Step(" Human: ok.", done=len(episode.turns) + 1 >= self.turns)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    args = parser.parse_args()
    init_distributed("cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    end, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)

    single = [
        t
        for t in range(300, 460)
        if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
    ]
    stops = tuple(tokenizer.decode([t]) for t in single)
    want_turns = 1 if rank() == 0 else 3
    env = RankTurns(want_turns, stops)
    decoder = ModuleDecoder(engine.module, pad, end, synced=True)
    player = EpisodeRollouts(decoder, env, tokenizer, MultiTurnConfig(), 60, end, synced=True)
    prompts = [tokenizer(f"rank {rank()} question {i}:")["input_ids"] for i in range(3)]
    torch.manual_seed(rank())
    rollout = player.generate(
        prompts, Sampling(max_new_tokens=60), group_size=2, logprobs_temperature=1.0
    )

    assert rollout.sequences.shape[0] == 6, rollout.sequences.shape  # no episode dropped
    turns = rollout.record.turns
    assert turns.max().item() <= want_turns, turns
    if rank() == 1:
        assert turns.max().item() > 1, turns  # rank 1 generated after rank 0 had finished
    trained, _ = response_logprobs(
        engine.module, rollout.sequences, rollout.attention_mask, rollout.prompt_width - 1
    )
    mask = rollout.response_mask
    torch.testing.assert_close(trained[mask], rollout.logprobs[mask], atol=1e-4, rtol=1e-4)
    report(f"rank {rank()} ok: turns {turns.tolist()}")
    teardown()


if __name__ == "__main__":
    main()

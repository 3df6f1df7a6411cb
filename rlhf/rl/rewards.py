"""Rule-based rewards for PPO (``ppo.reward.function``), in place of the reward model: what verl
calls a reward function and OpenRLHF a ``reward_func``. A function takes the decoded prompts and
answers of a rollout and returns one float per answer; the PPO step adds it at the answer's last
token exactly where the reward model's score would go.

A task may offer its own (the toy task's ``toy_gold`` is its gold checker as a 0/1 reward). On a
task with a checker this gives the upper bound of what PPO can do with a perfect judge,
measured with the same loop, so a learned reward model's shortfall can be told apart from the
optimiser's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rlhf.config import ConfigError
from rlhf.tasks import resolve_reward


class RewardFunction:
    """Scores rollouts by decoding them and calling a rule-based reward function. A function
    that breaks its contract fails with a ConfigError at the first evaluation or rollout."""

    def __init__(self, name: str, tokenizer, prompt_tasks: Sequence[str] = ()):
        """``prompt_tasks``: the tasks of the PPO prompts, whose own reward of this name (a
        built-in name several tasks offer: toy_gold) is the one taken."""
        self.fn = resolve_reward(name, prompt_tasks)
        self.name, self.tokenizer = name, tokenizer

    def __call__(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_width: int,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        """sequences, attention_mask: (B, P + R) left-padded prompts then answers;
        response_mask: (B, R) the answer tokens up to and with end-of-text. Returns (B,) float32
        scores on the sequences' device."""
        decode = self.tokenizer.decode
        prompt_ids, prompt_mask = sequences[:, :prompt_width], attention_mask[:, :prompt_width]
        prompts = [
            decode(ids[m.bool()], skip_special_tokens=True)
            for ids, m in zip(prompt_ids, prompt_mask)
        ]
        # the whole answer: a multi-turn episode's observations too (what the attention mask
        # covers after the prompt; the same tokens as the response mask's for one turn)
        answers = [
            decode(ids[m.bool()], skip_special_tokens=True)
            for ids, m in zip(sequences[:, prompt_width:], attention_mask[:, prompt_width:])
        ]
        scores = list(self.fn(prompts, answers))
        if len(scores) != len(answers):
            raise ConfigError(
                f"ppo.reward.function={self.name} returned {len(scores)} scores for "
                f"{len(answers)} answers; expected one float per answer"
            )
        values = []
        for i, score in enumerate(scores):
            try:
                value = float(score)  # numpy and 0-d torch scalars too
            except (TypeError, ValueError):
                value = math.nan
            if not math.isfinite(value):
                raise ConfigError(
                    f"ppo.reward.function={self.name} returned {score!r} for answer {i} "
                    f"({answers[i]!r}); expected a finite float"
                )
            values.append(value)
        return torch.tensor(values, dtype=torch.float32, device=sequences.device)

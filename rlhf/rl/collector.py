"""The collector of PPO experience: rollouts of the actor for batches of prompts (ppo.rollout.engine's
decoder, or a multi-turn episode loop), scored by the four models; and the sampler / trainer
log-prob gap it measures."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from rlhf.config import Config
from rlhf.registry import ESTIMATORS
from rlhf.rl.episodes import EpisodeRollouts, EpisodeTally
from rlhf.rl.experience import (
    Experience,
    episode_tokens,
    eval_modules,
    make_experience,
    normalised_scores,
    response_logprobs,
    scoring_args,
)
from rlhf.rl.generation import Sampling
from rlhf.rl.partial import PartialRollouts
from rlhf.rl.ppo_models import Models
from rlhf.rl.remote import RemoteRollouts
from rlhf.rl.rollouts import HFDecoder, VLLMDecoder
from rlhf.rl.shaping import Shaping, outcome_rewards
from rlhf.runtime.dist import all_reduce_sum, max_over_ranks
from rlhf.runtime.engine import model_device
from rlhf.tracking import PhaseClock, Throughput


@dataclass
class LogprobGap:
    """How far the sampler's log-probs of the answer tokens are from the training forward's,
    summed over the rollouts measured since the last :meth:`metrics`."""

    total: float = 0.0
    tokens: float = 0.0
    largest: float = 0.0

    def add(self, sampled: torch.Tensor, trained: torch.Tensor, mask: torch.Tensor) -> None:
        """sampled, trained, mask: (B, R); mask True on the answer tokens."""
        diff = (sampled.float().cpu() - trained.float().cpu()).abs()[mask.cpu().bool()]
        self.total += diff.sum().item()
        self.tokens += diff.numel()
        self.largest = max(self.largest, diff.max().item() if diff.numel() else 0.0)

    def metrics(self) -> dict[str, float]:
        """Collective: ppo/logprob_diff_mean (per answer token) and ppo/logprob_diff_max over
        every rank's tokens, none where no rank measured a token (every trained token older
        than the weights, as under rollouts ahead: a 0 would read as no gap); then starts
        over."""
        total, tokens = all_reduce_sum(self.total, self.tokens)
        largest = max_over_ranks(self.largest)
        self.total = self.tokens = self.largest = 0.0
        if tokens == 0:
            return {}
        return {"ppo/logprob_diff_mean": total / tokens, "ppo/logprob_diff_max": largest}


@torch.no_grad()
def trainer_logprobs(actor, exp: Experience, shaping: Shaping) -> torch.Tensor:
    """(B, R) float32 log-probs of a rollout's answer tokens from the forward the update runs
    (same kernels, logits precision, temperature and packing)."""
    args = scoring_args(shaping, exp.sequences, exp.attention_mask)
    with eval_modules(actor):
        logprobs, _ = response_logprobs(
            actor, exp.sequences, exp.attention_mask, exp.prompt_width - 1, **args
        )
    return logprobs.float()


@dataclass
class Collector:
    """Rollouts of the actor for batches of prompts, decoded by ``rollouts`` (ppo.rollout.engine)
    and scored by the four models into Experiences; ``speed`` times the generation, ``gap``
    sums the sampler / trainer log-prob differences of the rollouts measured."""

    models: Models
    cfg: Config
    pad_id: int
    eot: int
    sampling: Sampling
    rollout_logprobs: bool  # old log-probs from the sampling pass (ppo.rollout.logprobs)
    rollouts: HFDecoder | VLLMDecoder | EpisodeRollouts | PartialRollouts | RemoteRollouts
    # keep the sampler's log-probs in each Experience for ppo.rollout.correction
    keep_sampler_logprobs: bool = False
    # old log-probs from the update's forward (ppo.update.on_policy_shortcut), none computed here
    old_from_update: bool = False
    speed: Throughput = field(default_factory=Throughput)
    clock: PhaseClock = field(default_factory=PhaseClock)  # generate / score seconds
    gap: LogprobGap = field(default_factory=LogprobGap)
    episodes: EpisodeTally = field(default_factory=EpisodeTally)  # multi-turn: what happened

    def __call__(
        self,
        prompt_ids: list[list[int]],
        shaping: Shaping,
        measure_gap: bool = False,
        seed: int | None = None,
    ) -> Experience:
        """One generation batch scored: ``shaping.group_size`` answers to each prompt, in
        contiguous rows (a group stays on its prompt's rank). ``measure_gap``: also compare the
        sampler's log-probs with the training forward's (a second actor forward when the
        rollout's are used). ``seed``: sample from this seed (the process's RNG is left as it
        was), so the answers do not depend on what this rank sampled before."""
        self.speed.start()
        record = self.rollout_logprobs or measure_gap or self.keep_sampler_logprobs
        with self.clock.phase("generate"):  # a multi-turn episode's environment steps too
            rollout = self.rollouts.generate(
                prompt_ids,
                self.sampling,
                seed,
                shaping.group_size,
                shaping.temperature if record else None,
            )
        self.episodes.add(rollout)
        tokens = int(rollout.response_mask.sum())
        if isinstance(self.rollouts, PartialRollouts):  # carried answers were partly decoded before
            tokens = self.rollouts.generated
        baselines = None
        if ESTIMATORS[shaping.estimator].greedy_baseline:
            baselines, greedy_tokens = self.greedy_baselines(prompt_ids, shaping)
            tokens += greedy_tokens
        self.speed.stop(tokens, len(prompt_ids) * shaping.group_size)
        sampled = rollout.logprobs
        if not self.rollout_logprobs:
            rollout = rollout._replace(logprobs=None)  # make_experience recomputes them
        with self.clock.phase("score"):
            return self._score(rollout, sampled, shaping, baselines, measure_gap)

    def _score(
        self, rollout, sampled, shaping: Shaping, baselines, measure_gap: bool
    ) -> Experience:
        """The rollout scored by the four models (old log-probs, reference, values, reward) and
        algo=opd's teacher."""
        models = self.models
        device = model_device(models.actor)
        exp = make_experience(
            rollout,
            models.actor,
            models.reference,
            models.critic,
            models.reward,
            shaping,
            device,
            baselines,
            self.old_from_update,
            models.teacher,
        )
        if self.keep_sampler_logprobs:
            exp = exp._replace(sampler_logprobs=sampled.to(device).float())
        if measure_gap:
            recomputed = rollout.logprobs is None and not self.old_from_update
            trained = exp.old_logprobs if recomputed else None
            if trained is None:
                trained = trainer_logprobs(models.actor, exp, shaping)
            measured = rollout.response_mask
            if isinstance(self.rollouts, PartialRollouts | RemoteRollouts):  # older weights sampled
                measured = self.rollouts.fresh_mask(rollout)
            self.gap.add(sampled, trained, measured)
        return exp

    @torch.no_grad()
    def greedy_baselines(
        self, prompt_ids: list[list[int]], shaping: Shaping
    ) -> tuple[torch.Tensor, int]:
        """ReMax's baselines: (B x group_size,) the reward of a greedy answer to each prompt
        (scored, normalised and penalised as the sampled answers are), repeated over the
        prompt's group; and the greedy answers' token count."""
        with self.clock.phase("generate"):
            rollout = self.rollouts.generate(prompt_ids, replace(self.sampling, greedy=True))
        with self.clock.phase("score"):
            device = model_device(self.models.actor)
            sequences = rollout.sequences.to(device)
            attention_mask = rollout.attention_mask.to(device)
            answer_mask = rollout.response_mask.to(device)
            short = answer_mask.sum(-1) < shaping.min_response_tokens
            unterminated = ~rollout.ended.to(device)
            scores = normalised_scores(
                self.models.reward, sequences, attention_mask, rollout, shaping
            )
            baselines = outcome_rewards(
                scores, short, unterminated, episode_tokens(rollout).to(device), shaping
            )
        return baselines.repeat_interleave(shaping.group_size), int(answer_mask.sum())

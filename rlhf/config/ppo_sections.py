"""``ppo.update``, ``ppo.loss``, ``ppo.kl``, ``ppo.reward``, ``ppo.advantage``, ``ppo.ema.enabled``,
``ppo.ptx``, ``ppo.eval``: PPO's sections other than the rollout, each with its own checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def negatives(node: Any, keys: tuple[str, ...], accepted: str) -> list[tuple[str, Any, str]]:
    """(key, value, accepted) for each of ``keys`` of ``node`` below 0."""
    return [(k, getattr(node, k), accepted) for k in keys if getattr(node, k) < 0]


def below_one(node: Any, keys: tuple[str, ...]) -> list[tuple[str, Any, str]]:
    """(key, value, accepted) for each of ``keys`` of ``node`` below 1."""
    return [(k, getattr(node, k), "an integer >= 1") for k in keys if getattr(node, k) < 1]


@dataclass
class PPOUpdateConfig:
    """The passes of an iteration over its rollout: epochs passes in per_device_batch_size
    rows, grad_accum micro batches per optimizer step."""

    per_device_batch_size: int = 4  # rollout rows per update micro batch
    epochs: int = 1  # passes over each iteration's rollout
    grad_accum: int = 1  # update micro batches per optimizer step
    prompt_epochs: int = 1  # passes over the prompt set
    # the experience and update passes run over the rollout's rows packed end to end
    # (block-diagonal attention, like sft.packing) instead of padded to prompt + answer width.
    # null: on where every PPO model's attention takes a 4D mask (OPT, Llama with eager or sdpa
    # attention), padded elsewhere (logged)
    packing: bool | None = None
    # old log-probs from the update's own forward, detached, with no scoring pass for them: exact
    # when the update is the first and only optimizer step on this rollout (one epoch, one step,
    # the KL out of the reward: rlhf.config.resolve.off_policy_reasons).
    # null: on exactly then, where they would be recomputed; true: refused where not exact
    on_policy_shortcut: bool | None = None
    # stop this iteration's PPO epochs once an epoch's mean approx_kl (k3 of the rollout's
    # policy to the updated one, per answer token) exceeds it; null: every epoch runs
    target_kl: float | None = None
    # iterations at the start whose updates train the critic only: the actor waits for values
    # that have seen its rollouts (a critic started from the reward model predicts scores, not
    # returns); estimators with a critic only
    critic_warmup_steps: int = 0
    # tokens an update micro batch may hold: each optimizer step's rows cut by length, not into
    # per_device_batch_size rows (OpenRLHF's max_tokens_per_gpu, verl's use_dynamic_bsz), as
    # rows x the longest row (packed tokens with packing), each micro batch trimmed to its own
    # width; every rank runs as many micro batches as the rank that needs most. The step's
    # rows, and with the global normalisation its update, do not change. null: fixed rows
    micro_batch_tokens: int | None = None
    # deal each optimizer step's rows over the ranks by their tokens (about equal on each)
    # instead of each rank training the rows it generated, so that no rank waits at every
    # gradient reduce for the one that drew the long answers. The update does not change
    balance_ranks: bool = False

    def problems(self) -> list[tuple[str, Any, str]]:
        out = below_one(self, ("per_device_batch_size", "epochs", "grad_accum", "prompt_epochs"))
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            out.append(
                (
                    "micro_batch_tokens",
                    self.micro_batch_tokens,
                    "null (fixed rows) or an integer >= 1",
                )
            )
        if self.target_kl is not None and self.target_kl <= 0:
            out.append(("target_kl", self.target_kl, "null (no early stop) or a float > 0"))
        return out + negatives(self, ("critic_warmup_steps",), "a number >= 0")


@dataclass
class PPOLossConfig:
    """The actor's and the critic's losses."""

    # the actor's loss, by name (an entry of rlhf.registry.POLICY_LOSSES)
    policy: str = "ppo"
    clip_range: float = 0.2  # PPO's ratio clip epsilon
    # the ratio's clip below 1 (1 - this; 1: no lower bound); null: clip_range
    clip_low: float | None = None
    # the ratio's clip above 1 (1 + this; DAPO's clip-higher: 0.28); null: clip_range
    clip_high: float | None = None
    dual_clip: float | None = None  # e.g. 3.0: bound the loss of negative-advantage tokens
    # how the actor's token losses become one loss: token-mean (every real token of the step
    # weighs the same) | seq-mean-token-mean (each answer's mean, then over answers; GRPO's
    # paper) | seq-mean-token-sum (each answer's sum, then over answers) |
    # seq-mean-token-sum-norm (each answer's sum over max_new_tokens, then over answers; Dr.
    # GRPO). null: the policy loss's own (gspo: seq-mean-token-mean), else the estimator's
    # (grpo: seq-mean-token-mean; the others: token-mean)
    aggregation: str | None = None
    value_clip: float = 0.2  # the value loss's clip around the old values
    entropy_coef: float = 0.0  # weight of an entropy bonus in the actor's loss

    def problems(self) -> list[tuple[str, Any, str]]:
        out = negatives(self, ("clip_range", "value_clip", "entropy_coef"), "a float >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            out.append(("dual_clip", self.dual_clip, "null or a float > 1"))
        if self.clip_low is not None and not 0.0 <= self.clip_low <= 1.0:
            out.append(("clip_low", self.clip_low, "null or a float in [0, 1]"))
        if self.clip_high is not None and self.clip_high < 0:
            out.append(("clip_high", self.clip_high, "null or a float >= 0"))
        return out


@dataclass
class PPOKLConfig:
    """The KL to the reference: its weight, estimator, place and controller."""

    # weight of the per-token KL penalty to the reference in the reward (DeepSpeed-Chat's). The
    # embedded model's is 0.3 (conf/tuning/tiny/common.yaml): it keeps the held-out answers'
    # correctness where SFT left it while the habits go; 0.2 loses 3-5 points of it (4 PPO epochs
    # x 2 generation batches), 0.1 more
    coef: float = 0.1
    # the per-token KL to the reference, by name (an entry of rlhf.registry.KL_ESTIMATORS):
    # k1, k2, k3 read the answer's tokens, unbiased only if they were sampled; full reads both
    # models' logits. Greedy rollouts bias the estimates upwards (argmax tokens):
    # there full with in_loss=true holds the policy (docs/ppo.md, item 8)
    estimator: str = "k1"
    # false: -coef x KL per token in the reward (PPO, REINFORCE++); true: coef x KL
    # (estimator, GRPO's is k3; full: its gradient reaches every token of each position's
    # distribution) per token in the actor's loss, the reward is the score alone
    in_loss: bool = False
    adaptive: bool = False  # Ziegler et al.'s proportional controller towards target
    # the adaptive controller's target: KL to the reference summed over an answer (per
    # sequence, as in Ziegler et al.; verl and OpenRLHF's targets are per-token means)
    target: float = 6.0
    horizon: int = 10000  # samples over which the controller closes the gap

    def problems(self) -> list[tuple[str, Any, str]]:
        return negatives(self, ("coef",), "a float >= 0")


@dataclass
class PPORewardConfig:
    """From the reward model's (or the rule's) score to the reward PPO maximises."""

    # a rule-based reward in place of the reward model (rlhf/rl/rewards.py): toy_gold
    # (1 for an answer the toy task's gold checker accepts, else 0) or package.module:function,
    # called with the decoded prompts and answers, returning one float per answer. The critic
    # still starts from critic.model.path (a causal LM there gets a new value head)
    function: str | None = None
    # (score - mean) / std with the reward export's eval stats; the critic's head is scaled by
    # 1 / std. null: on with a reward model, off with ppo.reward.function (used as is)
    normalize: bool | None = None
    clip: float = 5.0  # scores are clipped to +-this before shaping
    # subtracted from the clipped score of an answer cut at max_new_tokens: the reward model
    # scores it at a token it never saw last (ppo/unterminated: their share). 0 (off): the
    # right size depends on the reward's units (normalised, raw, a 0/1 rule) and DeepSpeed-Chat
    # has none; TRL's 1.0 is one std of normalised scores
    unterminated_penalty: float = 0.0
    # null: answers shorter than ppo.rollout.min_response_tokens are masked out of every loss
    # (counted as ppo/short_answers); a value: they stay in the losses with
    # -short_answer_penalty as their score, so a drift towards empty answers is pushed back
    # (null keeps DeepSpeed-Chat's dropping of such answers, as masking, and the published
    # numbers)
    short_answer_penalty: float | None = None
    # DAPO's overlong penalty: an answer longer than max_new_tokens - overlong_buffer tokens
    # loses up to overlong_penalty from its score, linearly over the buffer; 0: off; null: a
    # fifth of the answer budget (DAPO's 4096 of 20480 tokens)
    overlong_buffer: int | None = 0
    overlong_penalty: float = 1.0  # what an answer of max_new_tokens tokens loses

    @property
    def normalizes(self) -> bool:
        """normalize, resolved: null is on for a reward model, off for a function."""
        if self.normalize is None:
            return self.function is None
        return self.normalize

    def problems(self) -> list[tuple[str, Any, str]]:
        out = negatives(self, ("clip", "unterminated_penalty"), "a float >= 0")
        out += negatives(self, ("overlong_penalty",), "a number >= 0")
        if self.short_answer_penalty is not None and self.short_answer_penalty < 0:
            out.append(("short_answer_penalty", self.short_answer_penalty, "null or a float >= 0"))
        if self.overlong_buffer is not None and self.overlong_buffer < 0:
            out.append(("overlong_buffer", self.overlong_buffer, "null or a number >= 0"))
        if self.function is not None and self.normalize is True:
            out.append(
                (
                    "normalize",
                    True,
                    "false with ppo.reward.function set (it normalises a reward model's "
                    "scores by the reward export's statistics)",
                )
            )
        return out


@dataclass
class PPOAdvantageConfig:
    """How each answer token's advantage is computed."""

    # the estimator, by name (an entry of rlhf.registry.ESTIMATORS;
    # docs/adding_an_algorithm.md adds one). Only an estimator with a critic (gae) loads and
    # trains one; with the others critic.* only names the reward model
    estimator: str = "gae"
    gamma: float = 1.0  # discount (gae, reinforce_pp)
    lam: float = 0.95  # GAE's lambda
    # gae: advantages to zero mean, unit variance over the rollout (reinforce_pp always
    # whitens its returns; the group estimators never whiten)
    whiten: bool = True
    # grpo: divide by the group's std; false: Dr. GRPO (the group mean only, no bias towards
    # prompts whose answers barely differ)
    std_normalize: bool = True
    # drop the groups whose scores are all equal (their advantages are 0) and sample more
    # prompts until the batch is full again (DAPO; grpo and rloo): ppo/groups_dropped
    dynamic_sampling: bool = False
    # dynamic_sampling: extra generation batches an iteration may draw; when they run out the
    # batch is filled with equal-score groups (ppo/groups_padded)
    dynamic_sampling_rounds: int = 4

    def problems(self) -> list[tuple[str, Any, str]]:
        out = negatives(self, ("dynamic_sampling_rounds",), "a number >= 0")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            out.append(("gamma/lam", (self.gamma, self.lam), "floats in [0, 1]"))
        return out


@dataclass
class PPOEMAConfig:
    """An exponential moving average of the actor, exported as actor_ema/."""

    enabled: bool = False  # keep an exponential moving average of the actor (actor_ema/)
    beta: float = 0.992  # its decay per iteration

    def problems(self) -> list[tuple[str, Any, str]]:
        if not 0.0 < self.beta < 1.0:
            return [("beta", self.beta, "a float in (0, 1)")]
        return []


@dataclass
class PPOPTXConfig:
    """PTX: language modelling on unsupervised text, mixed into the actor's loss."""

    coef: float = 0.0  # the LM loss's weight; DeepSpeed-Chat's value when enabled: 27.8
    # the text: a .txt/.jsonl file or a task's corpus (toy: its statements); null: the corpus of
    # the task the PPO prompts come from (data=toy), so real data needs a file named here
    source: str | None = None
    rows: int = 4000  # texts read from source

    def problems(self) -> list[tuple[str, Any, str]]:
        return negatives(self, ("coef",), "a float >= 0")


@dataclass
class PPOEvalConfig:
    """Evaluation on held-out prompts."""

    prompts: int = 256  # held-out prompts answered at each evaluation (1/256 = 0.004 gold)
    greedy: bool = True  # greedy answers for eval/reward and eval/gold_accuracy
    # answers sampled per held-out prompt at the rollout temperature: eval/kl,
    # eval/reward_sampled, eval/gold_accuracy_sampled and eval/gold_score_corr
    samples: int = 2

    def problems(self) -> list[tuple[str, Any, str]]:
        return below_one(self, ("samples",))

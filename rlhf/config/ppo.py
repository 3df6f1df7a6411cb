"""``ppo``: step 3's keys (conf/ppo/) and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf.config.multi_turn import MultiTurnConfig
from rlhf.config.vllm import VLLMConfig

GENERATION_CACHES = ("dynamic", "static")


ROLLOUT_ENGINES = ("hf", "vllm")


@dataclass
class PPOConfig:
    """Step 3. Every constant DeepSpeed-Chat hard-codes is a key here, with its value.

    Each iteration generates generation_batches x per_device_generation_batch_size prompts per
    rank, then runs ppo_epochs passes over them in per_device_training_batch_size rows."""

    # -- batches
    per_device_generation_batch_size: int = 4  # prompts a rank generates for at once
    per_device_training_batch_size: int = 4  # rollout rows per update micro batch
    generation_batches: int = 1  # generation batches per iteration (DeepSpeed-Chat's)
    ppo_epochs: int = 1  # passes over each iteration's rollout
    epochs: int = 1  # passes over the prompt set
    grad_accum: int = 1  # update micro batches per optimizer step
    prompt_sources: list[str] = field(default_factory=list)  # data.sources to take prompts from
    # answers sampled per prompt, one group on the prompt's own rank (grpo and rloo need >= 2):
    # a generation batch holds per_device_generation_batch_size x this rollout rows, and
    # per_device_training_batch_size counts rows
    num_samples_per_prompt: int = 1
    # -- rollouts
    max_new_tokens: int = 0  # answer tokens; 0: data.max_seq_len - data.max_prompt_len
    temperature: float = 1.0  # sampling temperature (log-probs are taken under it too)
    top_p: float = 1.0  # nucleus sampling; 1: off
    top_k: int = 0  # top-k sampling; 0: off
    greedy: bool = False  # decode greedily (DeepSpeed-Chat's rollouts) instead of sampling
    min_response_tokens: int = 2  # shorter answers are masked out of every loss (and counted)
    # subtracted from the clipped score of an answer cut at max_new_tokens: the reward model
    # scores it at a token it never saw last (ppo/unterminated: their share). 0 (off): the
    # right size depends on the reward's units (normalised, raw, a 0/1 rule) and DeepSpeed-Chat
    # has none; TRL's 1.0 is one std of normalised scores
    unterminated_penalty: float = 0.0
    # null: answers shorter than min_response_tokens are masked out of every loss (counted as
    # ppo/short_answers); a value: they stay in the losses with -short_answer_penalty as their
    # score, so a drift towards empty answers is pushed back (null keeps DeepSpeed-Chat's
    # dropping of such answers, as masking, and the published numbers)
    short_answer_penalty: float | None = None
    stop_at_eos: bool = True  # false: always generate max_new_tokens (DeepSpeed-Chat's cost)
    # the KV cache of generation (HF's cache_implementation): static preallocates prompt +
    # max_new_tokens and copies nothing per step (faster decoding on CPU); dynamic grows
    generation_cache: str = "dynamic"
    # drop each answer from the decoding batch and its KV cache as soon as it ends, so later
    # steps compute only the answers still running (our decoding loop with HF's samplers; needs
    # stop_at_eos and the dynamic cache; ZeRO-3 on several ranks uses HF generate regardless).
    # null: on wherever it applies (stop_at_eos, the dynamic cache), HF generate elsewhere
    drop_finished_rows: bool | None = None
    # old log-probs from the logits the sampling pass already computed (the generating weights,
    # no dropout); false: a second actor forward over the rollout, as DeepSpeed-Chat does.
    # null: true in fp32, false in bf16 / fp16, whose KV-cached decoding computes other logits
    # than the update's forward (the first ratio is not 1, the KL gets a floor); always false
    # with actor.hybrid_engine, whose inference kernels differ too, and with a KL estimator that
    # reads the logits (kl_estimator=full)
    rollout_logprobs: bool | None = None
    # old log-probs from the update's own forward, detached, with no scoring pass for them: exact
    # when the update is the first and only optimizer step on this rollout (one epoch, one step,
    # the KL out of the reward: rlhf.rl.experience.off_policy_reasons).
    # null: on exactly then, where they would be recomputed; true: refused where not exact
    on_policy_shortcut: bool | None = None
    # PPO iterations between measurements of the sampler / trainer log-prob gap
    # (ppo/logprob_diff_mean, ppo/logprob_diff_max: |sampled - training forward's| per answer
    # token), a second actor forward where rollout_logprobs is on; 0: never
    logprob_gap_interval: int = 10
    # sample each generation batch from a seed of its own (seed, iteration, the batch's place
    # among all ranks' batches): the rollouts no longer depend on how many ranks share the
    # prompts (2 ranks sample what 1 process samples) or on what was drawn before
    seed_rollouts: bool = False
    # hf: rlhf's KV-cached transformers decoding | vllm: vLLM in each training process
    # (scripts/install_vllm.sh), the actor's weights pushed after every update; every request
    # seeded (seed_rollouts implied). Rollouts, ReMax's greedy baseline and evaluation alike
    rollout_engine: str = "hf"
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # the vLLM engine's bounds
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # episode bounds
    # the sampler / trainer mismatch correction of the policy-gradient loss, by name (an entry
    # of rlhf.registry.CORRECTIONS), with tis_cap and correction_band as its bounds. null: tis
    # with rollout_engine=vllm, none with hf (whose sampler is the trainer)
    rollout_correction: str | None = None
    tis_cap: float = 2.0  # tis's truncation C
    correction_band: list[float] = field(default_factory=lambda: [0.5, 2.0])  # masking's band
    # the experience and update passes run over the rollout's rows packed end to end
    # (block-diagonal attention, like sft.packing) instead of padded to prompt + answer width.
    # null: on where every PPO model's attention takes a 4D mask (OPT, Llama with eager or sdpa
    # attention), padded elsewhere (logged)
    packing: bool | None = None
    # -- reward shaping
    # weight of the per-token KL penalty to the reference in the reward (DeepSpeed-Chat's). The
    # embedded model's is 0.3 (conf/tuning/tiny/common.yaml): it keeps the held-out answers'
    # correctness where SFT left it while the habits go; 0.2 loses 3-5 points of it (4 PPO epochs
    # x 2 generation batches), 0.1 more
    kl_coef: float = 0.1
    # the per-token KL to the reference, by name (an entry of rlhf.registry.KL_ESTIMATORS):
    # k1, k2, k3 read the answer's tokens, unbiased only if they were sampled; full reads both
    # models' logits. Greedy rollouts bias the estimates upwards (argmax tokens):
    # there full with kl_in_loss=true holds the policy (docs/ppo.md, item 8)
    kl_estimator: str = "k1"
    # false: -kl_coef x KL per token in the reward (PPO, REINFORCE++); true: kl_coef x KL
    # (kl_estimator, GRPO's is k3; full: its gradient reaches every token of each position's
    # distribution) per token in the actor's loss, the reward is the score alone
    kl_in_loss: bool = False
    adaptive_kl: bool = False  # Ziegler et al.'s proportional controller towards kl_target
    # the adaptive controller's target: KL to the reference summed over an answer (per
    # sequence, as in Ziegler et al.; verl and OpenRLHF's targets are per-token means)
    kl_target: float = 6.0
    kl_horizon: int = 10000  # samples over which the controller closes the gap
    clip_reward_value: float = 5.0  # scores are clipped to +-this before shaping
    # (score - mean) / std with the reward export's eval stats; the critic's head is scaled by
    # 1 / std. null: on with a reward model, off with ppo.reward_function (used as is)
    normalize_reward: bool | None = None
    # a rule-based reward in place of the reward model (rlhf/rl/rewards.py): toy_gold
    # (1 for an answer the toy task's gold checker accepts, else 0) or package.module:function,
    # called with the decoded prompts and answers, returning one float per answer. The critic
    # still starts from critic.model.path (a causal LM there gets a new value head)
    reward_function: str | None = None
    # DAPO's overlong penalty: an answer longer than max_new_tokens - overlong_buffer tokens
    # loses up to overlong_penalty from its score, linearly over the buffer; 0: off; null: a
    # fifth of the answer budget (DAPO's 4096 of 20480 tokens)
    overlong_buffer: int | None = 0
    overlong_penalty: float = 1.0  # what an answer of max_new_tokens tokens loses
    # -- advantages
    # how each answer token's advantage is computed, by name (an entry of
    # rlhf.registry.ESTIMATORS; docs/adding_an_algorithm.md adds one). Only an estimator with a
    # critic (gae) loads and trains one; with the others critic.* only names the reward model
    advantage_estimator: str = "gae"
    gamma: float = 1.0  # discount (gae, reinforce_pp)
    lam: float = 0.95  # GAE's lambda
    # gae: advantages to zero mean, unit variance over the rollout (reinforce_pp always
    # whitens its returns; the group estimators never whiten)
    whiten_advantages: bool = True
    # grpo: divide by the group's std; false: Dr. GRPO (the group mean only, no bias towards
    # prompts whose answers barely differ)
    std_normalize: bool = True
    # drop the groups whose scores are all equal (their advantages are 0) and sample more
    # prompts until the batch is full again (DAPO; grpo and rloo): ppo/groups_dropped
    dynamic_sampling: bool = False
    # dynamic_sampling: extra generation batches an iteration may draw; when they run out the
    # batch is filled with equal-score groups (ppo/groups_padded)
    dynamic_sampling_rounds: int = 4
    # -- losses
    # the actor's loss, by name (an entry of rlhf.registry.POLICY_LOSSES)
    policy_loss: str = "ppo"
    clip_range: float = 0.2  # PPO's ratio clip epsilon
    # the ratio's clip below 1 (1 - this; 1: no lower bound); null: clip_range
    clip_low: float | None = None
    # the ratio's clip above 1 (1 + this; DAPO's clip-higher: 0.28); null: clip_range
    clip_high: float | None = None
    # how the actor's token losses become one loss: token-mean (every real token of the step
    # weighs the same) | seq-mean-token-mean (each answer's mean, then over answers; GRPO's
    # paper) | seq-mean-token-sum (each answer's sum, then over answers) |
    # seq-mean-token-sum-norm (each answer's sum over max_new_tokens, then over answers; Dr.
    # GRPO). null: the policy loss's own (gspo: seq-mean-token-mean), else the estimator's
    # (grpo: seq-mean-token-mean; the others: token-mean)
    loss_aggregation: str | None = None
    dual_clip: float | None = None  # e.g. 3.0: bound the loss of negative-advantage tokens
    clip_range_value: float = 0.2  # the value loss's clip around the old values
    # iterations at the start whose updates train the critic only: the actor waits for values
    # that have seen its rollouts (a critic started from the reward model predicts scores, not
    # returns); estimators with a critic only
    critic_warmup_steps: int = 0
    entropy_coef: float = 0.0  # weight of an entropy bonus in the actor's loss
    # stop this iteration's PPO epochs once an epoch's mean approx_kl (k3 of the rollout's
    # policy to the updated one, per answer token) exceeds it; null: every epoch runs
    target_kl: float | None = None
    # -- EMA of the actor, exported as actor_ema/
    ema: bool = False  # keep an exponential moving average of the actor (actor_ema/)
    ema_beta: float = 0.992  # its decay per iteration
    # -- PTX: language modelling on unsupervised text, mixed into the actor's loss
    unsup_coef: float = 0.0  # DeepSpeed-Chat's value when enabled: 27.8
    # the text: a .txt/.jsonl file or a task's corpus (toy: its statements); null: the corpus of
    # the task the PPO prompts come from (data=toy), so real data needs a file named here
    unsup_source: str | None = None
    unsup_rows: int = 4000  # texts read from unsup_source
    # -- evaluation on held-out prompts
    eval_prompts: int = 256  # held-out prompts answered at each evaluation (1/256 = 0.004 gold)
    eval_greedy: bool = True  # greedy answers for eval/reward and eval/gold_accuracy
    # answers sampled per held-out prompt at the rollout temperature: eval/kl,
    # eval/reward_sampled, eval/gold_accuracy_sampled and eval/gold_score_corr
    eval_samples: int = 2

    @property
    def normalizes_reward(self) -> bool:
        """normalize_reward, resolved: null is on for a reward model, off for a function."""
        if self.normalize_reward is None:
            return self.reward_function is None
        return self.normalize_reward

    def problems(self) -> list[tuple[str, Any, str]]:
        out = []
        for key in (
            "per_device_generation_batch_size",
            "per_device_training_batch_size",
            "generation_batches",
            "ppo_epochs",
            "epochs",
            "grad_accum",
            "min_response_tokens",
            "eval_samples",
            "num_samples_per_prompt",
        ):
            if getattr(self, key) < 1:
                out.append((key, getattr(self, key), "an integer >= 1"))
        rollout = (
            self.per_device_generation_batch_size
            * self.generation_batches
            * self.num_samples_per_prompt
        )
        step_rows = self.per_device_training_batch_size * self.grad_accum
        if step_rows > 0 and rollout % step_rows:
            out.append(
                (
                    "per_device_training_batch_size",
                    self.per_device_training_batch_size,
                    f"a size such that per_device_training_batch_size x grad_accum "
                    f"({step_rows}) divides the rollout of per_device_generation_batch_size "
                    f"x generation_batches x num_samples_per_prompt ({rollout})",
                )
            )
        if self.drop_finished_rows and (not self.stop_at_eos or self.generation_cache != "dynamic"):
            out.append(
                (
                    "drop_finished_rows",
                    True,
                    "false unless stop_at_eos=true and generation_cache=dynamic",
                )
            )
        if self.generation_cache not in GENERATION_CACHES:
            out.append(
                (
                    "generation_cache",
                    self.generation_cache,
                    f"one of {', '.join(GENERATION_CACHES)}",
                )
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            out.append(("dual_clip", self.dual_clip, "null or a float > 1"))
        if self.target_kl is not None and self.target_kl <= 0:
            out.append(("target_kl", self.target_kl, "null (no early stop) or a float > 0"))
        for key in (
            "kl_coef",
            "clip_range",
            "clip_range_value",
            "clip_reward_value",
            "entropy_coef",
            "unsup_coef",
            "unterminated_penalty",
        ):
            if getattr(self, key) < 0:
                out.append((key, getattr(self, key), "a float >= 0"))
        if self.short_answer_penalty is not None and self.short_answer_penalty < 0:
            out.append(("short_answer_penalty", self.short_answer_penalty, "null or a float >= 0"))
        if self.logprob_gap_interval < 0:
            out.append(("logprob_gap_interval", self.logprob_gap_interval, "an integer >= 0"))
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            out.append(("gamma/lam", (self.gamma, self.lam), "floats in [0, 1]"))
        if not 0.0 < self.ema_beta < 1.0:
            out.append(("ema_beta", self.ema_beta, "a float in (0, 1)"))
        if self.max_new_tokens < 0:
            out.append(("max_new_tokens", self.max_new_tokens, "0 (fill max_seq_len) or more"))
        if self.temperature <= 0:
            out.append(("temperature", self.temperature, "a float > 0"))
        if self.reward_function is not None and self.normalize_reward is True:
            out.append(
                (
                    "normalize_reward",
                    True,
                    "false with ppo.reward_function set (it normalises a reward model's "
                    "scores by the reward export's statistics)",
                )
            )
        return out + self.estimator_problems() + self.rollout_problems()

    @property
    def truncates(self) -> bool:
        """Whether top-k / top-p truncate the sampled distribution (the update then scores the
        answers under the same truncation)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def correction(self) -> str:
        """rollout_correction, resolved: null is tis with vLLM rollouts, none with hf."""
        if self.rollout_correction is None:
            return "tis" if self.rollout_engine == "vllm" else "none"
        return self.rollout_correction

    def rollout_problems(self) -> list[tuple[str, Any, str]]:
        """The rollout engine and its correction."""
        if self.rollout_engine not in ROLLOUT_ENGINES:
            return [("rollout_engine", self.rollout_engine, f"one of {', '.join(ROLLOUT_ENGINES)}")]
        out = []  # the correction's name is rlhf.registry's to check
        if self.tis_cap < 1.0:
            out.append(("tis_cap", self.tis_cap, "a float >= 1"))
        low, high = [*self.correction_band, 0.0, 0.0][:2]
        if len(self.correction_band) != 2 or not 0.0 <= low < 1.0 < high:
            out.append(
                (
                    "correction_band",
                    list(self.correction_band),
                    "[low, high] with 0 <= low < 1 < high",
                )
            )
        if self.rollout_engine == "hf":
            if self.correction != "none":
                out.append(
                    (
                        "rollout_correction",
                        self.rollout_correction,
                        "null or none with rollout_engine=hf (it corrects vLLM's log-probs; "
                        "the hf path samples with the trainer's own weights and kernels)",
                    )
                )
            return out
        # vllm: the hf path's own decoding settings cannot be honoured there
        hf_only = "unset (null) with rollout_engine=vllm: a setting of the hf path's decoding"
        if self.drop_finished_rows is not None:
            out.append(("drop_finished_rows", self.drop_finished_rows, hf_only))
        if self.generation_cache != "dynamic":
            out.append(
                (
                    "generation_cache",
                    self.generation_cache,
                    "dynamic with rollout_engine=vllm: a setting of the hf path's decoding",
                )
            )
        if self.rollout_logprobs:
            out.append(
                (
                    "rollout_logprobs",
                    True,
                    "null or false with rollout_engine=vllm (the old log-probs are the "
                    "trainer's; the sampler's feed ppo.rollout_correction)",
                )
            )
        return out

    def estimator_problems(self) -> list[tuple[str, Any, str]]:
        """The keys of the estimators and losses that need no registry (rlhf.registry checks
        the names and what depends on them)."""
        out = []
        if self.clip_low is not None and not 0.0 <= self.clip_low <= 1.0:
            out.append(("clip_low", self.clip_low, "null or a float in [0, 1]"))
        if self.clip_high is not None and self.clip_high < 0:
            out.append(("clip_high", self.clip_high, "null or a float >= 0"))
        if self.overlong_buffer is not None and self.overlong_buffer < 0:
            out.append(("overlong_buffer", self.overlong_buffer, "null or a number >= 0"))
        for key in (
            "overlong_penalty",
            "dynamic_sampling_rounds",
            "critic_warmup_steps",
        ):
            if getattr(self, key) < 0:
                out.append((key, getattr(self, key), "a number >= 0"))
        if 0 < self.max_new_tokens <= (self.overlong_buffer or 0):
            out.append(
                (
                    "overlong_buffer",
                    self.overlong_buffer,
                    f"fewer tokens than ppo.max_new_tokens ({self.max_new_tokens})",
                )
            )
        return out

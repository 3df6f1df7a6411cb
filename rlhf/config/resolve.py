"""Every null / auto / 0-means-auto value of the config, decided in one pass before any model is
built: one pure function per group, from the typed Config and a few facts (the device, the
models' config.json, what the algorithm registry says of the chosen names).

:func:`resolve` returns the config with those values set and the keys whose value came from
the model files (``--cfg job`` and resolved.yaml mark them). What only a built model can tell
(whether its loaded attention takes a 4D mask for ppo.update.packing) is settled once more by
rlhf.steps.ppo_parts' ``resolve_after_build``, logged. The facts are gathered by
rlhf.modeling.facts (it reads config.json, never weights).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import yaml

from rlhf.config.data import checker_task
from rlhf.config.dpo import DPOConfig
from rlhf.config.lora import LoraConfig
from rlhf.config.model import TINY_INIT, TINY_VOCAB_SIZE, ModelConfig
from rlhf.config.optim import OptimConfig
from rlhf.config.reward import SHARED_PROMPT_LOSSES
from rlhf.config.root import Config
from rlhf.config.sweep import as_list, natural_direction, step_objective

RESOLVED_FILE = "resolved.yaml"  # in each checkpoint and run dir: every auto value decided
FROM_MODEL = "# from model files"  # the comment --cfg job and resolved.yaml put on such keys

# every key :func:`resolve` may decide, with the value that asks it to (null unless named):
# a checkpoint written before its run's config was resolved holds these, and compares equal
# to what they resolve to (rlhf.runtime.resume)
AUTO_KEYS = {
    "device": "auto",
    "model.dtype": "auto",
    "actor.model.dtype": "auto",
    "critic.model.dtype": "auto",
    "teacher.model.dtype": "auto",
    "lora.learning_rate": None,
    "actor.lora.learning_rate": None,
    "critic.lora.learning_rate": None,
    "dpo.reduction": None,
    "sft.packing": None,
    "reward.share_prompt": None,
    "ppo.rollout.max_new_tokens": 0,
    "ppo.rollout.drop_finished_rows": None,
    "ppo.rollout.logprobs": None,
    "ppo.rollout.correction": None,
    "ppo.update.packing": None,
    "ppo.update.on_policy_shortcut": None,
    "ppo.loss.clip_low": None,
    "ppo.loss.clip_high": None,
    "ppo.loss.aggregation": None,
    "ppo.reward.normalize": None,
    "ppo.reward.overlong_buffer": None,
    "sweep.objective": None,
    "sweep.direction": None,
}
# not ppo.asynchronous.chunk_tokens: left null where partial rollouts are off (nothing reads it)


@dataclass(frozen=True)
class ModelFacts:
    """What a model's config.json says, read before it is built (None: not written there)."""

    model_type: str | None = None
    architecture: str | None = None
    max_positions: int | None = None
    vocab_size: int | None = None
    dtype: str | None = None  # config.json's torch_dtype
    # why its attention takes no 4D block mask (packing), or None when it does
    block_mask_problem: str | None = None


@dataclass(frozen=True)
class Facts:
    """What the resolvers read besides the config: the device, each PPO model's facts (by
    role: actor, reference, critic, reward; None where unknown, e.g. a hub id not in the local
    cache), and the algorithm registry's answers for the chosen names."""

    device: str = "cpu"  # cpu | cuda
    bf16: bool = False  # the GPU computes in bf16
    models: dict[str, ModelFacts | None] = field(default_factory=dict)
    # the model step=sft / reward / dpo trains (model.path), with the attention it loads with
    step_model: ModelFacts | None = None
    kl_reads_logits: bool = False  # ppo.kl.estimator reads both models' logits (full)
    teacher: bool = False  # the estimator scores with a teacher (algo=opd)
    aggregation: str = "token-mean"  # the policy loss's or else the estimator's own


class Resolved(NamedTuple):
    """The config with every auto value set, and the dotted keys decided from model files."""

    config: Config
    from_model: frozenset[str]


class ResolvedValues(dict):
    """The resolved config as plain data (dataclasses.asdict: the run's config in W&B and
    TensorBoard), with ``from_model``: the keys decided from the model files."""

    def __init__(self, values: dict[str, Any], from_model: frozenset[str] = frozenset()):
        super().__init__(values)
        self.from_model = frozenset(from_model)

    @classmethod
    def of(cls, resolved: Resolved) -> ResolvedValues:
        return cls(dataclasses.asdict(resolved.config), resolved.from_model)

    def yaml(self) -> str:
        """resolved.yaml's text (:func:`resolved_yaml`)."""
        return resolved_yaml(self, self.from_model)


def resolve(config: Config, facts: Facts) -> Resolved:
    """The config with every null / auto value of each group decided (``config`` unchanged)."""
    out = copy.deepcopy(config)
    out.device = facts.device  # auto: cuda where one is visible, else cpu
    resolve_model(out.model, facts)
    resolve_model(out.teacher.model, facts)
    for role in (out.actor, out.critic):
        resolve_model(role.model, facts)
        resolve_lora(role.lora, role.optim)
    resolve_lora(out.lora, out.optim)
    resolve_dpo(out.dpo)
    from_model = resolve_sft(out, facts) | resolve_reward(out, facts) | resolve_ppo(out, facts)
    resolve_sweep(out, facts)
    return Resolved(out, frozenset(from_model))


def resolve_sweep(cfg: Config, facts: Facts) -> None:
    """sweep.objective null: the step's headline metric (step=all: its last step's, prefixed
    with the step's name); sweep.direction null: each objective's natural direction, one value
    alone: every objective's. Both become lists (a single objective: a list of one)."""
    sweep = cfg.sweep
    if sweep.objective is None:
        step = cfg.pipeline.steps[-1] if cfg.step.name == "all" else cfg.step.name
        graded = any(checker_task(source) for source in cfg.data.sources.values())
        metric = step_objective(step, graded, facts.teacher and not cfg.opd.task_reward)
        sweep.objective = f"{step}/{metric}" if cfg.step.name == "all" else metric
    objectives = as_list(sweep.objective)
    directions = as_list(sweep.direction)
    if not directions:
        directions = [natural_direction(metric) for metric in objectives]
    elif len(directions) == 1:
        directions = directions * len(objectives)
    sweep.objective, sweep.direction = objectives, directions


def resolve_model(model: ModelConfig, facts: Facts) -> None:
    """model.dtype auto: bf16 on a GPU that computes in it, fp16 on another GPU, fp32 on CPU."""
    if model.dtype == "auto":
        model.dtype = ("bf16" if facts.bf16 else "fp16") if facts.device == "cuda" else "fp32"


def resolve_lora(lora: LoraConfig, optim: OptimConfig) -> None:
    """lora.learning_rate null: the group's optim.lr."""
    if lora.learning_rate is None:
        lora.learning_rate = optim.lr


def resolve_dpo(dpo: DPOConfig) -> None:
    """dpo.reduction null: the loss's own (mean for ipo and simpo, sum for sigmoid and hinge)."""
    if dpo.reduction is None:
        dpo.reduction = "mean" if dpo.loss in ("ipo", "simpo") else "sum"


def resolve_sft(cfg: Config, facts: Facts) -> set[str]:
    """sft.packing null: on where the trained model's attention takes a 4D block mask and
    data.pad_to_max_len does not ask for DeepSpeed-Chat's padded rows. Left null where the
    model's config.json cannot be read here (a hub id not cached): the step decides on the
    built model, logged. Returns the keys decided from the model files."""
    if cfg.sft.packing is not None or facts.step_model is None:
        return set()
    takes_mask = facts.step_model.block_mask_problem is None
    cfg.sft.packing = takes_mask and not cfg.data.pad_to_max_len
    return {"sft.packing"}


def resolve_reward(cfg: Config, facts: Facts) -> set[str]:
    """reward.share_prompt null: on where the model's attention takes a 4D block mask, the
    loss reads a pair's two scores only (pairwise, mse) and rows are not padded to
    data.max_seq_len; left null where config.json cannot be read here (as sft.packing)."""
    if cfg.reward.share_prompt is not None or facts.step_model is None:
        return set()
    takes_mask = facts.step_model.block_mask_problem is None
    shares = cfg.reward.loss in SHARED_PROMPT_LOSSES and not cfg.data.pad_to_max_len
    cfg.reward.share_prompt = takes_mask and shares
    return {"reward.share_prompt"}


def resolve_ppo(cfg: Config, facts: Facts) -> set[str]:
    """Step 3's auto values, in dependency order (the answer budget before the overlong
    buffer, the rollout log-probs before the on-policy shortcut); returns the keys decided from
    the model files."""
    ppo = cfg.ppo
    if not ppo.rollout.max_new_tokens:  # 0: what data.max_seq_len leaves after the prompt
        ppo.rollout.max_new_tokens = cfg.data.max_seq_len - cfg.data.max_prompt_len
    if ppo.asynchronous.enabled and ppo.asynchronous.chunk_tokens is None:  # an eighth, >= 1
        ppo.asynchronous.chunk_tokens = max(1, ppo.rollout.max_new_tokens // 8)
    if ppo.reward.overlong_buffer is None:  # a fifth of the answer budget (DAPO's 4096 of 20480)
        ppo.reward.overlong_buffer = ppo.rollout.max_new_tokens // 5
    if ppo.loss.clip_low is None:
        ppo.loss.clip_low = ppo.loss.clip_range
    if ppo.loss.clip_high is None:
        ppo.loss.clip_high = ppo.loss.clip_range
    if ppo.loss.aggregation is None:
        ppo.loss.aggregation = facts.aggregation
    if ppo.rollout.correction is None:  # vLLM's sampler is not the trainer; hf's is
        ppo.rollout.correction = "tis" if ppo.rollout.engine == "vllm" else "none"
    if ppo.reward.normalize is None:  # a reward model's scores; a function's are used as is
        reads_reward = not facts.teacher or cfg.opd.task_reward  # OPD's own reads none
        ppo.reward.normalize = ppo.reward.function is None and reads_reward
    if ppo.rollout.drop_finished_rows is None:  # where it applies: hf decoding, ends, dynamic cache
        ppo.rollout.drop_finished_rows = (
            ppo.rollout.engine == "hf"
            and ppo.rollout.stop_at_eos
            and ppo.rollout.cache == "dynamic"
        )
    ppo.rollout.logprobs = uses_rollout_logprobs(cfg, facts)
    ppo.update.on_policy_shortcut = uses_on_policy_shortcut(cfg, facts)
    from_model = set()
    if ppo.update.packing is None:
        ppo.update.packing = packing_problem(facts) is None
        from_model.add("ppo.update.packing")
    return from_model


PPO_ROLES = ("actor", "reference", "critic", "reward", "teacher")


def packing_problem(facts: Facts) -> str | None:
    """Why PPO's rows cannot be packed before the models are built: the first model whose
    config.json names an attention that takes no 4D mask. None also where a model's facts are
    unknown (rlhf.steps.ppo_parts checks the built models once more)."""
    found = (facts.models.get(role) for role in PPO_ROLES)
    return next((f.block_mask_problem for f in found if f and f.block_mask_problem), None)


def uses_rollout_logprobs(cfg: Config, facts: Facts) -> bool:
    """ppo.rollout.logprobs resolved: null takes the old log-probs from the sampling pass in
    fp32 only (the actor's model.dtype, resolved first). In bf16 / fp16 the KV-cached decoding
    computes other logits than the update's full forward, so the first ratio would not be 1 and
    the KL to the reference would get a floor. Never with the hybrid engine (its inference
    kernels), vLLM (not the trainer's kernels), a top-k / top-p sampler (it records the full
    distribution's log-probs, the update scores the truncated one), nor a KL that reads the
    logits (full: it needs the actor's distributions).

    Partial and apart rollouts (ppo.asynchronous) train tokens older policies sampled: with
    correction=none the old log-probs are the sampler's (true); with one, the proximal policy's
    (a scoring forward), the sampler's the behaviour policy in it (decoupled PPO: false)."""
    ppo = cfg.ppo
    if ppo.asynchronous.off_policy:  # ppo.rollout.correction resolved first (resolve_ppo)
        return ppo.rollout.correction_mode == "none"
    if cfg.actor.hybrid_engine or facts.kl_reads_logits or teacher_reads_logits(cfg, facts):
        return False
    if ppo.rollout.engine == "vllm" or truncates(ppo):
        return False
    if ppo.rollout.logprobs is None:  # an asked-for shortcut serves them exactly
        return cfg.actor.model.dtype == "fp32" and not ppo.update.on_policy_shortcut
    return ppo.rollout.logprobs


def teacher_reads_logits(cfg: Config, facts: Facts) -> bool:
    """opd.loss=topk compares the student's and the teacher's top-k distributions: it needs the
    actor's logits, which the sampler does not keep."""
    return facts.teacher and cfg.opd.loss == "topk"


def truncates(ppo) -> bool:
    """Whether top-k / top-p truncate the sampled distribution."""
    return not ppo.rollout.greedy and (ppo.rollout.top_k > 0 or ppo.rollout.top_p < 1.0)


def off_policy_reasons(
    cfg: Config, kl_reads_logits: bool = False, teacher: bool = False
) -> list[str]:
    """Why the update's own forward cannot stand in for the old log-probs (ppo.update.on_policy_shortcut):
    whatever trains on the rollout after its first optimizer step, or reads the old log-probs
    before the update. Empty: the first forward of the update is on the weights that sampled,
    so its detached log-probs are the old ones and the ratio is 1 by construction.
    ``kl_reads_logits``: ppo.kl.estimator reads the logits (rlhf.registry.kl_needs_logits);
    ``teacher``: the estimator scores with a teacher (rlhf.registry.uses_teacher)."""
    ppo, out = cfg.ppo, []
    if ppo.update.epochs > 1:
        out.append(f"ppo.update.epochs={ppo.update.epochs} (later epochs train on older answers)")
    rows = ppo.rollout.per_device_batch_size * ppo.rollout.batches
    rows *= ppo.rollout.samples_per_prompt
    if rows > ppo.update.per_device_batch_size * ppo.update.grad_accum:
        out.append(
            f"{rows} rows a rollout, more than one optimizer step "
            "(ppo.update.per_device_batch_size x ppo.update.grad_accum)"
        )
    if not ppo.kl.in_loss and ppo.kl.coef > 0:
        out.append("the KL penalty in the reward reads them before the update (ppo.kl.in_loss)")
    if kl_reads_logits:
        out.append("ppo.kl.estimator=full reads the actor's logits before the update")
    if teacher:
        out.append("algo=opd's advantages are the student-teacher gap of the old log-probs")
    if ppo.update.critic_warmup_steps > 0:
        out.append("ppo.update.critic_warmup_steps: iterations without an actor forward")
    section = ppo.asynchronous
    stand_in = "the update's forward would stand in for their old log-probs"
    if section.enabled:
        why = "partial rollouts train tokens older policies sampled"
        out.append(f"ppo.asynchronous.min_finished={section.min_finished} ({why}: {stand_in})")
    if section.apart:
        why = "apart rollouts train tokens another process sampled, max_staleness versions behind"
        out.append(f"ppo.asynchronous.rollout_ranks={section.rollout_ranks} ({why}: {stand_in})")
    # not reasons: ppo.ema.enabled averages the actor for its export only; ppo.rollout.correction weighs
    # the sampler's log-probs against the old ones inside the loss, after the forward filled them
    return out


def uses_on_policy_shortcut(cfg: Config, facts: Facts) -> bool:
    """ppo.update.on_policy_shortcut resolved (after ppo.rollout.logprobs): null is on where the old
    log-probs would otherwise be recomputed and the update is exactly on-policy."""
    ppo = cfg.ppo
    if ppo.update.on_policy_shortcut is None:
        reasons = off_policy_reasons(cfg, facts.kl_reads_logits, facts.teacher)
        return not ppo.rollout.logprobs and not reasons
    return ppo.update.on_policy_shortcut


# --- model facts from config.json, never weights -------------------------------------------------


def model_facts(model: ModelConfig, path: str | None) -> ModelFacts | None:
    """The facts of the model at ``path`` (the embedded model's from its init config when
    None); None where its config.json cannot be read here (a hub id not in the local cache)."""
    if path is None:
        return ModelFacts(
            model_type="opt",
            architecture="OPTForCausalLM",
            max_positions={**TINY_INIT, **model.init}.get("max_position_embeddings"),
            vocab_size=TINY_VOCAB_SIZE,
            dtype="float32",
        )
    data = config_json(path, model.trust_remote_code)
    if data is None:
        return None
    return ModelFacts(
        model_type=data.get("model_type"),
        architecture=(data.get("architectures") or [None])[0],
        max_positions=data.get("max_position_embeddings") or data.get("n_positions"),
        vocab_size=data.get("vocab_size"),
        dtype=data.get("torch_dtype") or data.get("dtype"),
    )


def config_json(path: str, trust_remote_code: bool = False) -> dict[str, Any] | None:
    """A model's config.json: a local directory's, else the hub cache's (nothing is downloaded)."""
    local = os.path.join(os.path.expanduser(path), "config.json")
    if os.path.isfile(local):
        try:
            with open(local, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None  # the model checks report it
    try:
        from transformers import AutoConfig

        hub = AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception:  # not cached, not a model: unknown here
        return None
    return hub.to_dict()


# --- the resolved config as text ------------------------------------------------------------------


def resolved_yaml(values: dict[str, Any], from_model: frozenset[str] | set[str]) -> str:
    """``values`` (the resolved config as plain data) as YAML, each key decided from the model
    files followed by ``# from model files``."""
    plain = dataclasses.asdict(values) if dataclasses.is_dataclass(values) else dict(values)
    plain = json.loads(json.dumps(plain, default=str))  # tuples, paths: YAML's plain types
    lines = yaml.safe_dump(plain, sort_keys=False, default_flow_style=False).splitlines()
    path: list[tuple[int, str]] = []  # (indent, key) of the mapping keys above the line
    out = []
    for line in lines:
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        key = stripped.split(":", 1)[0] if ":" in stripped and not stripped.startswith("-") else ""
        if key:
            path = [(i, k) for i, k in path if i < indent] + [(indent, key)]
            dotted = ".".join(k for _, k in path)
            if dotted in from_model and not stripped.endswith(":"):
                line = f"{line}  {FROM_MODEL}"
        out.append(line)
    return "\n".join(out) + "\n"

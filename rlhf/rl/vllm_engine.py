"""Rollouts on vLLM, colocated: one engine inside each training process (rank), built once per
run with the actor's architecture and dummy weights, loaded with the actor's weights by
:meth:`VLLMEngine.push` after every update, and asked for the same answers the transformers
path samples (temperature, top_p, top_k, max_new_tokens, the end-of-text stop, a seed per
prompt), returned as a :class:`~rlhf.rl.generation.Rollout` with each answer token's log-prob
under the distribution it was drawn from.

Why one engine per rank: the ranks generate their own prompts as they do on the transformers
path, nothing crosses ranks, and each engine is a plain function call away from its trainer
(weights go in without a copy through another process). An engine on rank 0 alone hangs: vLLM
adopts the trainer's process group and creates its groups with collective calls the other ranks
never make; vLLM's data-parallel launcher mode makes the engines wait for each other's steps.

vLLM is optional (scripts/install_vllm.sh): it is imported only when an engine is built."""

from __future__ import annotations

import copy
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from rlhf.data.collate import left_pad
from rlhf.rl.generation import Rollout, Sampling, decoded_rollout
from rlhf.rl.weight_sync import hf_model
from rlhf.runtime.vllm_install import INSTALL_HINT, TESTED_VLLM_VERSION, vllm_problem

log = logging.getLogger(__name__)

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is built with.

    dtype: fp32 | bf16 | fp16, the actor's. max_model_len: prompt + answer tokens.
    kv_cache_bytes: the KV cache's size (None: vLLM's own, a gpu_memory_utilization share).
    gpu_memory_utilization: the share of the GPU vLLM's start-up check asks to find free.
    enforce_eager: no CUDA graphs / compilation (always on CPU, where compiling takes minutes).
    sleep_level: 0, or between a rollout and the next weight push free the KV cache (1: the
    weights to host memory, 2: the weights dropped) on the GPU (vLLM's sleep mode).
    seed: the engine's own seed (requests carry theirs)."""

    dtype: str
    max_model_len: int
    kv_cache_bytes: int | None = 1 << 30
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool = True
    sleep_level: int = 0
    seed: int = 0


# vLLM allocates the KV cache in blocks: 16 tokens on a GPU, 128 in its CPU build; a sequence
# is counted at whole blocks of the larger size, plus one for the token it decodes next
KV_BLOCK_TOKENS = 128


def kv_cache_bytes(config, dtype: str, sequences: int, max_model_len: int) -> int:
    """The bytes of a KV cache that holds ``sequences`` sequences of ``max_model_len`` tokens
    at once (every rollout row of a generation batch decoding together): keys and values of
    every layer's key-value heads, ``dtype`` wide. ``config``: the actor's transformers config
    (grouped-query heads counted as such)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * DTYPE_BYTES[dtype]
    blocks = -(-max_model_len // KV_BLOCK_TOKENS) + 1
    return sequences * blocks * KV_BLOCK_TOKENS * per_token


# what vLLM holds beside its weights and KV cache on a GPU: the CUDA context, activations of
# its profiling pass, CUDA graphs
ENGINE_OVERHEAD_BYTES = 2 << 30


def gpu_share(weight_bytes: int, cache_bytes: int, device_bytes: int) -> float:
    """The share of the device an engine with these weights and this KV cache asks to find
    free at start-up (vLLM refuses to start where less is free): what it needs, not a constant
    share, so it starts beside the DeepSpeed models already on the device."""
    needed = 1.2 * (weight_bytes + cache_bytes) + ENGINE_OVERHEAD_BYTES
    return min(max(needed / device_bytes, 0.02), 0.95)


def engine_environment() -> None:
    """vLLM's settings that must be in place before it is imported: the engine core in this
    process (otherwise it is a spawned process and a weight push is not a function call), and
    its log at WARNING unless the user chose a level."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class VLLMEngine:
    """A colocated vLLM engine for one process's rollouts."""

    def __init__(self, model: torch.nn.Module, spec: EngineSpec):
        """``model``: the actor (a transformers model, or a DeepSpeed engine / PEFT wrapper
        around one): the engine takes its architecture; the weights come with :meth:`push`."""
        problem = vllm_problem()
        if problem:
            raise RuntimeError(problem)
        engine_environment()
        import vllm
        from vllm import LLM

        if vllm.__version__.split("+")[0] != TESTED_VLLM_VERSION:
            log.warning(
                "vLLM %s: rlhf's weight push and sleep mode are tested with %s (%s)",
                vllm.__version__,
                TESTED_VLLM_VERSION,
                INSTALL_HINT,
            )
        self.spec = spec
        self.on_gpu = torch.cuda.is_available()
        # vLLM's sleep mode is a CUDA allocator's: on CPU the engine keeps its memory
        self.sleeps = spec.sleep_level > 0 and self.on_gpu
        self._config_dir = tempfile.TemporaryDirectory(prefix="rlhf-vllm-")
        config = copy.deepcopy(hf_model(model).config)
        config.architectures = [type(hf_model(model)).__name__]  # a built config names none
        config.save_pretrained(self._config_dir.name)
        memory = {"gpu_memory_utilization": spec.gpu_memory_utilization}
        if spec.kv_cache_bytes is not None:
            memory["kv_cache_memory_bytes"] = spec.kv_cache_bytes
        set_num_threads = torch.set_num_threads
        started = time.perf_counter()
        # the engine seeds torch's global RNG as it starts: the trainer's draws stay its own
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.on_gpu else []):
            self.llm = LLM(
                model=self._config_dir.name,
                runner="generate",
                load_format="dummy",  # weights come from the trainer
                skip_tokenizer_init=True,  # token ids in and out
                generation_config="vllm",  # not the checkpoint's sampling defaults
                logprobs_mode="processed_logprobs",  # after temperature / top-k / top-p
                dtype=VLLM_DTYPES[spec.dtype],
                max_model_len=spec.max_model_len,
                enforce_eager=spec.enforce_eager or not self.on_gpu,
                enable_sleep_mode=self.sleeps,
                seed=spec.seed,
                distributed_executor_backend=rank_local_executor(),
                **memory,
            )
        # vLLM's CPU worker replaces torch.set_num_threads process-wide with a warning no-op
        # (it binds threads in its own worker processes; in this process it bound none)
        torch.set_num_threads = set_num_threads
        self.asleep = False
        log.info("vLLM engine started in %.1f s", time.perf_counter() - started)

    # -- weights
    def push(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Load the trainer's weights (names as in the transformers model's state dict, every
        entry: a tied lm_head is its own entry) into the running engine, then drop the prefix
        cache, whose KV blocks the old weights computed. Returns the seconds it took."""
        started = time.perf_counter()
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True},
        )
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        return time.perf_counter() - started

    def sleep(self) -> None:
        """After a rollout on a GPU: give the KV cache's memory (and the weights', see
        EngineSpec.sleep_level) to the trainer until the next :meth:`push` wakes the engine.
        A no-op where the engine does not sleep."""
        if self.sleeps and not self.asleep:
            self.llm.reset_prefix_cache()  # the cached blocks are gone after the sleep
            self.llm.sleep(level=self.spec.sleep_level)
            self.asleep = True

    # -- rollouts
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        pad_id: int,
        end_id: int,
        sampling: Sampling,
        seeds: Sequence[int] | None = None,
        group_size: int = 1,
        max_new: Sequence[int] | None = None,
    ) -> Rollout:
        """``group_size`` answers to each prompt (vLLM's n), in contiguous rows as the
        transformers path lays them out, with each answer token's log-prob under the sampled
        distribution (temperature, top-k, top-p applied; greedy: the raw distribution).
        ``seeds``: one per prompt (its group's answers are one seeded stream), so the answers
        do not depend on what else was generated before or beside them. ``max_new``: one
        bound a prompt (vLLM's max_tokens is a request's own), never past max_model_len."""
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: push weights before generating")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        seeds = seeds if seeds is not None else [None] * len(prompts)
        bounds = request_bounds(prompts, sampling.max_new_tokens, max_new, self.spec.max_model_len)
        params = [
            request_settings(sampling, end_id, group_size, seed, bound)
            for seed, bound in zip(seeds, bounds, strict=True)
        ]
        answers, logprobs = [], []
        for completions in self._decode(list(prompts), params):
            for tokens, values in completions:  # the group, in order
                answers.append(tokens)
                logprobs.append(values)
        rows = [list(p) for p in prompts for _ in range(group_size)]
        row_bounds, row_seeds = expand(bounds, group_size), expand(seeds, group_size)
        self._finish_stops(rows, answers, logprobs, row_bounds, row_seeds, sampling, end_id)
        return as_rollout(rows, answers, logprobs, (pad_id, end_id), sampling, row_bounds)

    def _finish_stops(self, rows, answers, logprobs, bounds, seeds, sampling, end_id) -> None:
        """Continue, in place, each answer that ended at the last token of a multi-token turn
        stop that did not come whole (:func:`stopped_short`): one request a round from where
        it is, within its bound, seeded from its own seed and the round."""
        stops, turn = sampling.stop_sequences, 1
        while pending := [
            r for r in range(len(rows)) if stopped_short(answers[r], bounds[r], end_id, stops)
        ]:
            params = [
                request_settings(
                    sampling,
                    end_id,
                    1,
                    continued_seed(seeds[r], turn, r),
                    bounds[r] - len(answers[r]),
                )
                for r in pending
            ]
            contexts = [rows[r] + answers[r] for r in pending]
            for r, ((tokens, values),) in zip(pending, self._decode(contexts, params), strict=True):
                answers[r] += tokens
                logprobs[r] += values
            turn += 1

    def _decode(self, prompts: list[list[int]], settings: list[dict]) -> list[list[tuple]]:
        """vLLM's answers to ``prompts`` under SamplingParams ``settings`` (one each): for each
        prompt, its n answers' (token ids, each token's log-prob under the sampled
        distribution)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            [SamplingParams(**kw) for kw in settings],
            use_tqdm=False,
        )
        return [  # in the order of the prompts
            [
                (list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
                for c in output.outputs
            ]
            for output in outputs
        ]

    def close(self) -> None:
        """Tear down vLLM's process groups while the trainer's is still up. vLLM's own shutdown
        (at garbage collection or exit) would destroy the trainer's default process group too,
        or fail on groups destroyed with it."""
        from vllm.distributed import parallel_state

        client = self.llm.llm_engine.engine_core
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        parallel_state.destroy_model_parallel()
        if parallel_state._WORLD is not None:  # vLLM's view of the trainer's ranks
            parallel_state._WORLD.destroy()
            parallel_state._WORLD = None
        self.llm = None
        self._config_dir.cleanup()


def rank_local_executor():
    """vLLM's in-process executor on this rank's own device: the stock one derives the device
    index from the device type alone ("cuda": index 0), so every rank's engine would land on
    the first GPU. torchrun and the DeepSpeed launcher set LOCAL_RANK."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    class RankLocalExecutor(UniProcExecutor):
        def _distributed_args(self) -> tuple[str, int, int]:
            init_method, rank, _ = super()._distributed_args()
            return init_method, rank, int(os.environ.get("LOCAL_RANK", "0"))

    return RankLocalExecutor


def request_bounds(
    prompts: Sequence[Sequence[int]], max_new: int, own: Sequence[int] | None, max_model_len: int
) -> list[int]:
    """Each request's max_tokens: its ``own`` bound (else ``max_new``), never more than what
    the engine's ``max_model_len`` leaves after its prompt (at least 1)."""
    bounds = list(own) if own is not None else [max_new] * len(prompts)
    if len(bounds) != len(prompts):
        raise ValueError(f"{len(bounds)} bounds for {len(prompts)} prompts")
    return [max(1, min(b, max_model_len - len(p))) for b, p in zip(bounds, prompts, strict=True)]


def expand(values: Sequence[int], group_size: int) -> list[int]:
    """One value a row from one a prompt (its group's rows contiguous)."""
    return [v for v in values for _ in range(group_size)]


def stopped_short(
    tokens: list[int], bound: int, end_id: int, stops: tuple[tuple[int, ...], ...]
) -> bool:
    """Whether a request's answer ``tokens`` ended at the last token of a multi-token turn stop
    (a stop token id, see :func:`request_settings`) whose earlier tokens did not come before
    it, with room left in its ``bound``: the answer is not over and goes on."""
    if not tokens or len(tokens) >= bound or tokens[-1] == end_id:
        return False
    if tokens[-1] not in {stop[-1] for stop in stops if len(stop) > 1}:
        return False
    return not any(tuple(tokens[-len(stop) :]) == stop for stop in stops)


def continued_seed(seed: int | None, turn: int, row: int) -> int | None:
    """The seed of the request that continues row ``row``'s answer the ``turn``-th time."""
    return None if seed is None else seed + 7_919 * turn + 104_729 * row


def request_settings(
    sampling: Sampling, end_id: int, n: int, seed: int | None, max_tokens: int | None = None
) -> dict:
    """SamplingParams' keywords for the transformers path's Sampling: greedy is temperature 0;
    top_k 0 and top_p 1 are off in both; the answer stops at end-of-text (kept, as transformers
    keeps it) unless stop_at_eos is off, and at a turn stop; the checkpoint's own EOS never
    stops it. ``max_tokens``: the request's own bound (else sampling.max_new_tokens).

    A turn stop of one token is a stop token id. A longer one ends the request at its last
    token (a stop token id too), vLLM having no stop on a sequence of token ids (its ``stop``
    strings need its detokenizer, and this engine takes and returns token ids): where that
    token came without the rest of the stop, a request continues the answer
    (:func:`stopped_short`), so an answer never runs past its stop."""
    stop_ids = [end_id] if sampling.stop_at_eos else []
    for stop in sampling.stop_sequences:
        if stop[-1] not in stop_ids:
            stop_ids.append(stop[-1])
    return {
        "n": n,
        "max_tokens": max_tokens if max_tokens is not None else sampling.max_new_tokens,
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p,
        "top_k": 0 if sampling.greedy else sampling.top_k,
        "stop_token_ids": stop_ids or None,
        "ignore_eos": True,
        "logprobs": 0,  # the sampled token's own
        "seed": seed,
        "detokenize": False,
    }


def as_rollout(
    prompts: Sequence[Sequence[int]],
    answers: list[list[int]],
    logprobs: list[list[float]],
    pad_end: tuple[int, int],
    sampling: Sampling,
    bounds: list[int],
) -> Rollout:
    """The transformers path's layout: (B, P) left-padded prompts (at least
    sampling.prompt_width) then (B, R) answers padded with the pad id after their end (R: the
    longest answer), each masked after its end-of-text, turn stop or bound."""
    pad_id, end_id = pad_end
    input_ids, prompt_mask = left_pad([list(p) for p in prompts], pad_id, sampling.prompt_width)
    width = max(len(a) for a in answers)
    response = torch.full((len(answers), width), pad_id, dtype=torch.long)
    sampled = torch.zeros((len(answers), width))
    for row, (tokens, values) in enumerate(zip(answers, logprobs, strict=True)):
        response[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        sampled[row, : len(values)] = torch.tensor(values)
    sequences = torch.cat([input_ids, response], dim=1)
    rollout = decoded_rollout(sequences, prompt_mask, end_id, sampling.stop_sequences, bounds, None)
    return rollout._replace(logprobs=sampled)

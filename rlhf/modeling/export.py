"""Weights out of DeepSpeed engines: ZeRO-3's partitioned parameters gathered a bucket of
modules at a time (the weight push to vLLM reads them too), the full state dict on rank 0, and
save_pretrained exports (LoRA merged, with the tokenizer) written to a temporary name and renamed
over the old one only once complete."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch

from rlhf.config import ConfigError
from rlhf.runtime.dist import barrier, is_main
from rlhf.runtime.files import no_space_message, out_of_space, replace_dir


def module_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(prefix, module) in state-dict order; a module's own tensors are ``prefix + name``."""
    return [(f"{name}." if name else "", module) for name, module in model.named_modules()]


def own_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(module.parameters(recurse=False))


def own_tensors(prefix: str, module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's own parameters and persistent buffers, detached, named as its state dict does."""
    for name, param in module._parameters.items():
        if param is not None:
            yield prefix + name, param.detach()
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, buffer.detach()


def gathered_tensors(
    units: Sequence[tuple[str, torch.nn.Module]],
    params: Callable[[torch.nn.Module], list[torch.nn.Parameter]],
    read: Callable[[str, torch.nn.Module], Iterable[tuple[str, torch.Tensor]]],
    zero_stage: int,
    bucket_bytes: int = 256 << 20,
    device: str | torch.device | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) that ``read(prefix, unit)`` gives, unit after unit. ZeRO-3: the ``params``
    of consecutive units are gathered together (DeepSpeed's GatheredParameters) until they hold
    ``bucket_bytes``, so the whole model is never gathered at once, and the tensors read are
    copies (the gathered storage is released after each bucket); every rank must iterate to the
    end (the gathers are collective). ``device``: every tensor is a copy there, whatever the
    stage; None: ZeRO-3's copies stay where the parameters are, other stages' are not copies."""

    def copies(bucket):
        return [
            (name, tensor.to(device or tensor.device, copy=True))
            for prefix, unit in bucket
            for name, tensor in read(prefix, unit)
        ]

    if zero_stage != 3:
        for prefix, unit in units:
            yield from (read(prefix, unit) if device is None else copies([(prefix, unit)]))
        return
    import deepspeed

    for bucket in _buckets(units, params, bucket_bytes):
        gathered = [p for _, unit in bucket for p in params(unit)]  # DeepSpeed drops repeats
        with deepspeed.zero.GatheredParameters(gathered, modifier_rank=None):
            tensors = copies(bucket)
        yield from tensors


def _buckets(units, params, bucket_bytes: int) -> Iterator[list[tuple[str, torch.nn.Module]]]:
    bucket, size = [], 0
    for prefix, unit in units:
        bucket.append((prefix, unit))
        size += sum(_full_bytes(p) for p in params(unit))
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _full_bytes(param: torch.nn.Parameter) -> int:
    """A parameter's gathered size (ZeRO-3 keeps its full element count in ds_numel)."""
    return getattr(param, "ds_numel", param.numel()) * param.element_size()


def full_state_dict(module: torch.nn.Module, zero_stage: int) -> dict[str, torch.Tensor] | None:
    """The state dict, complete, copied to CPU, on rank 0 (None elsewhere). Under ZeRO-3 all
    ranks must call this: the parameters are gathered a bucket at a time."""
    main = is_main()

    def read(prefix: str, unit: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
        return own_tensors(prefix, unit) if main else ()  # the others only join the gathers

    units = module_units(module)
    state = dict(gathered_tensors(units, own_parameters, read, zero_stage, device="cpu"))
    return state if main else None


def export_pretrained(
    module: torch.nn.Module,
    zero_stage: int,
    build_copy: Callable[[], torch.nn.Module],
    tokenizer,
    out_dir: Path,
    extra_files: dict[str, dict] | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write ``out_dir`` in save_pretrained format (LoRA merged into the base weights) with the
    tokenizer. ``build_copy`` makes a fresh CPU model of the same architecture (LoRA wrappers
    included) to load the gathered weights into. Written to a temporary name and renamed, so an
    existing export is replaced only by a complete one. ``state`` (rank 0) exports those
    weights instead of the module's (an EMA)."""
    if state is None:
        state = full_state_dict(module, zero_stage)
    if is_main():
        copy = build_copy()
        _, unexpected = copy.load_state_dict(state, strict=False)
        missing = {name for name, _ in copy.named_parameters()} - state.keys()  # tied: named once
        if unexpected or missing:
            raise RuntimeError(f"export: missing {sorted(missing)}, unexpected {unexpected}")
        if hasattr(copy, "merge_and_unload"):
            copy = copy.merge_and_unload()
        tensors = {t.data_ptr(): t for t in copy.state_dict().values()}  # tied: saved once
        needed = sum(t.numel() * t.element_size() for t in tensors.values())
        _write_export(copy, tokenizer, out_dir, extra_files or {}, needed)
    barrier()


class ExportError(ConfigError):
    """An export could not be written; the message says why and that nothing was replaced."""


def _write_export(copy, tokenizer, out_dir: Path, extra_files: dict[str, dict], needed: int):
    """Write into a temporary sibling and rename it over ``out_dir`` once complete. A failed
    write leaves no temporary directory and the existing export untouched; a full disk is one
    line with the space needed (the summary is written after the exports, so the run is not
    complete: the same command resumes from its last checkpoint)."""
    for stale in out_dir.parent.glob(f"{out_dir.name}.tmp*"):  # a killed run's leftovers
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    try:
        copy.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, payload in extra_files.items():
            (tmp / name).write_text(json.dumps(payload, indent=2))
        replace_dir(tmp, out_dir)
    except Exception as err:  # safetensors reports a failed write as its own SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        if not out_of_space(err, out_dir.parent):
            raise
        kept = "is unchanged" if out_dir.exists() else "was not written"
        raise ExportError(
            f"export to {out_dir} failed: {no_space_message(out_dir.parent, needed)}; "
            f"{out_dir} {kept}. Free some space and run the same command again: it resumes "
            "from the last checkpoint"
        ) from None

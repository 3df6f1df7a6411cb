"""The actor's weights as a rollout engine loads them: the Hugging Face model's full state dict
(what save_pretrained writes, a tied lm_head included), LoRA merged into its base weights, ZeRO-3
partitions gathered a bucket of modules at a time so the whole model is never gathered at once.
Every rank of a ZeRO-3 run must iterate (the gathers are collective); the trained model is never
modified."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a DeepSpeed engine's module (and PEFT's wrapper)."""
    module = getattr(module, "module", module)
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def is_lora_layer(module: torch.nn.Module) -> bool:
    """A PEFT LoRA layer: a base layer plus low-rank adapters, merged into one weight here."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def weight_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(prefix, module) in state-dict order whose own tensors are named ``prefix + name``: a LoRA
    layer counts as one unit (its base layer and adapters merge into ``weight`` / ``bias``)."""
    units, inside_lora = [], ()
    for name, module in model.named_modules():
        if inside_lora and name.startswith(inside_lora):
            continue
        prefix = f"{name}." if name else ""
        inside_lora = prefix if is_lora_layer(module) else ()
        units.append((prefix, module))
    return units


def unit_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters a unit's tensors are read from (a LoRA layer's adapters included)."""
    if is_lora_layer(module):
        return list(module.parameters())
    return list(module.parameters(recurse=False))


def unit_tensors(prefix: str, module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The unit's state-dict entries, parameters gathered: a LoRA layer's base weight plus each
    active adapter's scaled B @ A (PEFT's own delta, fan_in_fan_out handled there)."""
    if is_lora_layer(module):
        weight = module.base_layer.weight.detach()
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
        yield f"{prefix}weight", weight
        if getattr(module.base_layer, "bias", None) is not None:
            yield f"{prefix}bias", module.base_layer.bias.detach()
        return
    for name, param in module._parameters.items():
        if param is not None:
            yield prefix + name, param.detach()
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, buffer.detach()


def hf_weights(
    module: torch.nn.Module, zero_stage: int, bucket_bytes: int = 256 << 20
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the actor's full, LoRA-merged state dict, in state-dict order. ZeRO-3:
    the parameters of consecutive units are gathered together until they hold ``bucket_bytes``,
    and the tensors yielded are copies (the gathered storage is released after each bucket)."""
    units = weight_units(hf_model(module))
    if zero_stage != 3:
        for prefix, unit in units:
            yield from unit_tensors(prefix, unit)
        return
    import deepspeed

    for bucket in _buckets(units, bucket_bytes):
        params = [p for _, unit in bucket for p in unit_parameters(unit)]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            tensors = [
                (n, t.clone()) for prefix, unit in bucket for n, t in unit_tensors(prefix, unit)
            ]
        yield from tensors


def _buckets(units, bucket_bytes: int) -> Iterator[list[tuple[str, torch.nn.Module]]]:
    bucket, size = [], 0
    for prefix, unit in units:
        bucket.append((prefix, unit))
        size += sum(_full_bytes(p) for p in unit_parameters(unit))
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _full_bytes(param: torch.nn.Parameter) -> int:
    """A parameter's gathered size (ZeRO-3 keeps its full element count in ds_numel)."""
    return getattr(param, "ds_numel", param.numel()) * param.element_size()

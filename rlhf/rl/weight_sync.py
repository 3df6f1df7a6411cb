"""The actor's weights as a rollout engine loads them: the Hugging Face model's full state dict
(what save_pretrained writes, a tied lm_head included), LoRA merged into its base weights,
ZeRO-3 partitions gathered a bucket of modules at a time
(:func:`rlhf.modeling.export.gathered_tensors`, which exports use too) so the whole model is
never gathered at once. Every rank of a ZeRO-3 run must iterate (the gathers are
collective); the trained model is never modified."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rlhf.modeling.export import gathered_tensors, module_units, own_parameters, own_tensors


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
    for prefix, module in module_units(model):
        if inside_lora and prefix.startswith(inside_lora):
            continue
        inside_lora = prefix if is_lora_layer(module) else ()
        units.append((prefix, module))
    return units


def unit_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters a unit's tensors are read from (a LoRA layer's adapters included)."""
    if is_lora_layer(module):
        return list(module.parameters())
    return own_parameters(module)


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
    yield from own_tensors(prefix, module)


def hf_weights(
    module: torch.nn.Module, zero_stage: int, bucket_bytes: int = 256 << 20
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the actor's full, LoRA-merged state dict, in state-dict order. ZeRO-3:
    the parameters of consecutive units are gathered together until they hold ``bucket_bytes``,
    and the tensors yielded are copies (the gathered storage is released after each bucket)."""
    units = weight_units(hf_model(module))
    return gathered_tensors(units, unit_parameters, unit_tensors, zero_stage, bucket_bytes)

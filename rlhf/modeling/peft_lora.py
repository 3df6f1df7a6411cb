"""LoRA through PEFT: the target-module pattern, wrapping a model (its base weights training
too unless lora.only_optimize_lora), and a LoRA policy run with its adapters off as its own
frozen reference."""

from __future__ import annotations

import re

import torch

from rlhf.config import ConfigError, LoraConfig


def lora_target(lora: LoraConfig) -> str:
    """PEFT full-match regex: the target modules inside modules named like module_filter."""
    names = "|".join(re.escape(m) for m in lora.target_modules)
    scope = f".*{re.escape(lora.module_filter)}(.*\\.)?" if lora.module_filter else "(.*\\.)?"
    return f"{scope}({names})"


def apply_lora(lm: torch.nn.Module, lora: LoraConfig, modules_to_save=None) -> torch.nn.Module:
    """Wrap in PEFT LoRA. Unless only_optimize_lora, the base weights keep training too
    (DeepSpeed-Chat's behaviour); modules_to_save (a value head) always train."""
    if lora.rank == 0:
        return lm
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora_target(lora),
        modules_to_save=modules_to_save,
    )
    try:
        wrapped = get_peft_model(lm, peft_config)
    except ValueError as err:
        raise ConfigError(
            f"lora.target_modules / lora.module_filter match nothing: {err}"
        ) from None
    if not lora.only_optimize_lora:
        for param in wrapped.parameters():
            param.requires_grad_(True)
    return wrapped


def reference_is_base(lora: LoraConfig) -> bool:
    """Whether a LoRA policy serves as its own reference: its base weights never train
    (only_optimize_lora), so with the adapters off it is the reference exactly."""
    return lora.rank > 0 and lora.only_optimize_lora and not lora.reference_copy


class AdaptersOff:
    """The reference model of a LoRA policy whose base weights do not train
    (:func:`reference_is_base`): the policy's own engine run with its adapters disabled (PEFT's
    ``disable_adapter``), in eval mode and without gradients, instead of a second full copy of
    the model (TRL's and torchtune's way). Called like the frozen reference it replaces."""

    def __init__(self, engine):
        self.engine = engine  # a DeepSpeed engine around a PEFT model

    def __call__(self, *args, **kwargs):
        module = self.engine.module
        training = module.training
        module.eval()  # the reference runs without dropout, as a frozen copy does
        try:
            with torch.no_grad(), module.disable_adapter():
                return self.engine(*args, **kwargs)
        finally:
            module.train(training)

    def parameters(self):
        return self.engine.module.parameters()

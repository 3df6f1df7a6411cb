"""Hugging Face models: loading (hub, local, the embedded tiny model), LoRA (peft_lora), exports
and ZeRO-3 gathers (export), the lean attention, and what decides whether models fit together
and fit DeepSpeed's hybrid engine (compatibility)."""

"""Hugging Face models: loading (hub, local, the embedded tiny model), LoRA, exports, and the
lean attention."""

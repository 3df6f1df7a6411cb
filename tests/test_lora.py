"""LoRA: which modules it wraps, which weights train (only_optimize_lora), and the merged export."""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, OPTConfig, OPTForCausalLM

from rlhf.config import LoraConfig, ModelConfig, OptimConfig
from rlhf.modeling.peft_lora import apply_lora, lora_target
from rlhf.runtime.engine import param_groups
from tests.conftest import FAST, cache_overrides, run_rlhf

LAYERS = 2
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj")
TARGETS += ("fc1", "fc2")


def _opt(seed: int = 0) -> OPTForCausalLM:
    """A small OPT with project_in/out (word_embed_proj_dim != hidden_size), like opt-350m."""
    config = OPTConfig(
        vocab_size=64,
        hidden_size=16,
        word_embed_proj_dim=8,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        ffn_dim=32,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return OPTForCausalLM(config)


def _expected_targets(prefix: str = "model.decoder.layers") -> set[str]:
    return {f"{prefix}.{i}.{name}" for i in range(LAYERS) for name in TARGETS}


def test_lora_target_matches_exactly_the_decoder_layer_linears():
    pattern = lora_target(LoraConfig(rank=8))
    names = [name for name, _ in _opt().named_modules()]
    assert {n for n in names if re.fullmatch(pattern, n)} == _expected_targets()


def test_lora_target_without_module_filter_and_with_fewer_modules():
    names = [name for name, _ in _opt().named_modules()]
    pattern = lora_target(LoraConfig(rank=8, module_filter=None, target_modules=["q_proj", "fc2"]))
    matched = {n for n in names if re.fullmatch(pattern, n)}
    want = {
        f"model.decoder.layers.{i}.{m}" for i in range(LAYERS) for m in ("self_attn.q_proj", "fc2")
    }
    assert matched == want
    # the filter narrows: project_out is a Linear outside decoder.layers
    pattern = lora_target(LoraConfig(rank=8, target_modules=["project_out", "fc1"]))
    assert {n for n in names if re.fullmatch(pattern, n)} == {
        f"model.decoder.layers.{i}.fc1" for i in range(LAYERS)
    }


@pytest.mark.parametrize("module_filter", [None, "decoder.layers."])
def test_lora_target_matches_whole_module_names(module_filter):
    """A target names a module, as in PEFT's list form: "proj" must not match "q_proj", and
    "fc1" not "my_fc1". (Without a module_filter the pattern already requires the dot.)"""
    names = ["model.decoder.layers.0.self_attn.q_proj", "model.decoder.layers.0.my_fc1"]
    pattern = lora_target(LoraConfig(rank=8, module_filter=module_filter, target_modules=["proj"]))
    assert not [n for n in names if re.fullmatch(pattern, n)]
    pattern = lora_target(LoraConfig(rank=8, module_filter=module_filter, target_modules=["fc1"]))
    assert not [n for n in names if re.fullmatch(pattern, n)]


def test_apply_lora_wraps_the_targets_only():
    model = apply_lora(_opt(), LoraConfig(rank=8, only_optimize_lora=True))
    wrapped = {
        name.removeprefix("base_model.model.").split(".lora_A")[0]
        for name, _ in model.named_parameters()
        if ".lora_A." in name
    }
    assert wrapped == _expected_targets()


def _train(model, optim: OptimConfig, lora: LoraConfig, steps: int = 3):
    """A few AdamW steps over engine.param_groups on random tokens."""
    optimizer = torch.optim.AdamW(param_groups(model, optim, lora), lr=optim.lr)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(3, 64, (4, 12), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _changed(before, model) -> dict[str, bool]:
    return {name: not torch.equal(before[name], p) for name, p in model.named_parameters()}


def test_only_optimize_lora_trains_lora_weights_only():
    lora = LoraConfig(rank=8, only_optimize_lora=True, learning_rate=5e-3)
    optim = OptimConfig(lr=1e-3, weight_decay=0.1)
    model = apply_lora(_opt(), lora)
    groups = param_groups(model, optim, lora)
    grouped = {id(p) for g in groups for p in g["params"]}
    lora_params = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert grouped == lora_params  # the optimizer holds nothing else
    assert {g["lr"] for g in groups} == {5e-3}

    before = _snapshot(model)
    _train(model, optim, lora)
    changed = _changed(before, model)
    lora_names = [n for n in changed if "lora_" in n]
    assert len(lora_names) == 2 * len(_expected_targets())
    assert all(changed[n] for n in lora_names)  # lora_A too (from step 2, once lora_B != 0)
    assert not any(changed[n] for n in changed if "lora_" not in n)


def test_without_only_optimize_lora_the_base_weights_train_too():
    lora = LoraConfig(rank=8, only_optimize_lora=False, learning_rate=5e-3)
    optim = OptimConfig(lr=1e-3, weight_decay=0.1)
    model = apply_lora(_opt(), lora)
    groups = param_groups(model, optim, lora)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    by_lr = {g["lr"] for g in groups}
    assert by_lr == {1e-3, 5e-3}
    for group in groups:  # biases and LayerNorms are not decayed
        names = [n for n, p in model.named_parameters() if any(p is q for q in group["params"])]
        decayed = group["weight_decay"] > 0
        assert all(("bias" not in n and "layer_norm" not in n) == decayed for n in names), names

    before = _snapshot(model)
    _train(model, optim, lora)
    changed = _changed(before, model)
    assert all(changed[n] for n in changed if "lora_" in n)
    base = "base_model.model.model.decoder"
    for name in (
        f"{base}.layers.0.self_attn.q_proj.base_layer.weight",
        f"{base}.layers.1.fc2.base_layer.weight",
        f"{base}.embed_tokens.weight",
        f"{base}.final_layer_norm.weight",
    ):
        assert changed[name], name


def _base_model_dir(run_dir: Path, cache) -> Path:
    """The cache's built tiny model the run in ``run_dir`` started from (its resolved model:
    the same architecture under another seed is another model)."""
    from rlhf.modeling.loading import tiny_model_dir

    model = yaml.safe_load((run_dir / "resolved.yaml").read_text())["model"]
    built = tiny_model_dir(ModelConfig(**model), str(cache))
    assert (built / "model.safetensors").is_file(), "the run's tiny model is not in the cache"
    return built


@pytest.mark.slow
def test_merged_lora_export(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_rlhf(
        [
            "step=sft",
            "lora=r8",
            *FAST,
            *cache_overrides(cache_dir),
            "step.max_steps=6",
            "step.eval_at_start=false",
            "sft.gold_eval_prompts=0",
        ],
        run_dir=run_dir,
    )
    model_dir = run_dir / "model"
    exported = load_file(model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    base_dir = _base_model_dir(run_dir, cache_dir)
    base = load_file(base_dir / "model.safetensors")

    assert not [k for k in exported if "lora_" in k or "base_layer" in k]
    assert exported.keys() == base.keys()
    targeted = {
        k
        for k in base
        if re.search(r"layers\.\d+\.(self_attn\.(q|k|v|out)_proj|fc1|fc2)\.weight$", k)
    }
    assert len(targeted) == 6 * config["num_hidden_layers"]
    for key, tensor in exported.items():
        assert tensor.shape == base[key].shape, key
        if key in targeted:  # W + B @ A * alpha / r: merged, so different
            assert not torch.allclose(tensor, base[key]), key
        else:  # frozen (only_optimize_lora): bit-identical
            assert torch.equal(tensor, base[key]), key

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([[2, 100, 200, 300]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()

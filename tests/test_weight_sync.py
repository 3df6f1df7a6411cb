"""The weights a rollout engine is given: the actor's full state dict as save_pretrained writes
it (the tied lm_head included), LoRA merged, and under ZeRO-3 on 2 ranks gathered in buckets to
exactly the unpartitioned model's; an export's ZeRO-3 gather (the same one) likewise."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.config import LoraConfig
from rlhf.modeling.peft_lora import apply_lora
from rlhf.rl.weight_sync import hf_weights
from tests.conftest import REPO, _free_port


def _lora_actor(model_dir, rank: int = 4):
    torch.manual_seed(0)
    actor = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(rank=rank))
    with torch.no_grad():  # PEFT starts B at 0, which would hide a missing merge
        for name, param in actor.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return actor


def test_the_full_state_dict_with_the_tied_lm_head(tiny_lm_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    weights = dict(hf_weights(model, zero_stage=0))
    assert "lm_head.weight" in weights  # tied: named_parameters() leaves it out
    assert "lm_head.weight" not in dict(model.named_parameters())
    assert weights.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name


def test_lora_is_merged_and_the_trained_model_left_alone(tiny_lm_dir):
    actor = _lora_actor(tiny_lm_dir)
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    weights = dict(hf_weights(actor, zero_stage=0))
    merged = _lora_actor(tiny_lm_dir).merge_and_unload().state_dict()
    assert weights.keys() == merged.keys()
    for name, tensor in merged.items():
        assert torch.allclose(weights[name], tensor, atol=1e-6), name
    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).state_dict()
    q = "model.decoder.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(weights[q], base[q])  # the adapters are in
    after = actor.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_zero3_on_two_ranks_gathers_the_merged_weights_in_buckets(tiny_lm_dir):
    proc = _torchrun("zero3_sync_worker.py", tiny_lm_dir)
    tensors = len(AutoModelForCausalLM.from_pretrained(tiny_lm_dir).state_dict())
    assert sorted(line for line in proc.stdout.splitlines() if " ok: " in line) == [
        f"rank {r} ok: {tensors} tensors gathered" for r in (0, 1)
    ]


@pytest.mark.slow
def test_a_zero3_export_on_two_ranks_is_the_unpartitioned_state_dict(tmp_path):
    """Llama's rotary embeddings keep non-persistent buffers, which the export leaves out as
    save_pretrained does (it refused them as unexpected when it gathered named_buffers())."""
    proc = _torchrun("zero3_export_worker.py", tmp_path / "model")
    lines = sorted(line for line in proc.stdout.splitlines() if " ok: " in line)
    assert [line.split(" ok: ")[0] for line in lines] == ["rank 0", "rank 1"], proc.stdout


def _torchrun(worker: str, *args) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            str(REPO / "tests" / worker),
            *map(str, args),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc

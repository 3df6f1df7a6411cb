"""One rank of the ZeRO-3 export check (run by tests with torchrun --nproc_per_node 2): a
Llama-architecture model (rotary embeddings keep non-persistent buffers) partitioned by ZeRO-3
(every parameter) exports, its weights gathered by the bucketed ZeRO-3 gather, exactly the state dict of an
unpartitioned copy. Each rank prints one "rank R ok ..." line or fails."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import deepspeed
import torch
from rank_report import report  # tests/, the script's own directory
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.modeling.export import export_pretrained, full_state_dict
from rlhf.runtime.dist import init_distributed, rank, teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    args = parser.parse_args()
    init_distributed("cpu")
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    config = LlamaConfig(
        vocab_size=len(tokenizer) + 8 - len(tokenizer) % 8,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    expected = copy.deepcopy(model).state_dict()
    assert any(m._non_persistent_buffers_set for m in model.modules())  # rotary's inv_freq
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)

    state = full_state_dict(engine.module, 3)
    if rank() == 0:
        assert list(state) == list(expected), sorted(state.keys() ^ expected.keys())
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), name
    else:
        assert state is None
    out_dir = Path(args.out_dir)
    export_pretrained(engine.module, 3, lambda: LlamaForCausalLM(config), tokenizer, out_dir)
    exported = load_file(out_dir / "model.safetensors")
    for name, tensor in exported.items():
        assert torch.equal(tensor, expected[name]), name
    report(f"rank {rank()} ok: {len(exported)} tensors exported")
    teardown()  # while the engine lives: an abort at exit ('terminate called') failed CI once


if __name__ == "__main__":
    main()

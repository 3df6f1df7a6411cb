"""One rank of the ZeRO-3 weight-sync check (run by tests with torchrun --nproc_per_node 2):
an actor partitioned by ZeRO-3 (every parameter, LoRA on its layers) gives, gathered in small
buckets, exactly the merged state dict of an unpartitioned copy; with --vllm each rank pushes
it into its own engine, whose greedy answers then equal the copy's and whose sampled log-probs
equal the ZeRO-3 actor's own forward. Each rank prints one "rank R ok ..." line or fails."""

from __future__ import annotations

import argparse
import copy

import deepspeed
import torch
from rank_report import report  # tests/, the script's own directory
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.config import LoraConfig
from rlhf.modeling.peft_lora import apply_lora
from rlhf.rl.experience import response_logprobs
from rlhf.rl.generation import Sampling, generate
from rlhf.rl.weight_sync import hf_weights
from rlhf.runtime.dist import init_distributed, rank, teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--vllm", action="store_true")
    args = parser.parse_args()
    init_distributed("cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    torch.manual_seed(0)
    actor = apply_lora(AutoModelForCausalLM.from_pretrained(args.model_dir), LoraConfig(rank=4))
    with torch.no_grad():  # PEFT starts B at 0: a merge would change nothing
        for name, param in actor.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    expected = copy.deepcopy(actor).merge_and_unload().eval()
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=actor, optimizer=optimizer, config=ds)

    gathered = dict(hf_weights(engine, 3, bucket_bytes=64 << 10))
    want = expected.state_dict()
    assert gathered.keys() == want.keys(), sorted(gathered.keys() ^ want.keys())
    for name, tensor in want.items():
        assert torch.allclose(gathered[name], tensor, atol=1e-6), name
    line = f"rank {rank()} ok: {len(gathered)} tensors gathered"

    if args.vllm:
        from rlhf.rl.vllm_engine import EngineSpec, VLLMEngine

        rollouts = VLLMEngine(expected, EngineSpec("fp32", 128, 64 << 20))
        seconds = rollouts.push(hf_weights(engine, 3, bucket_bytes=64 << 10))
        prompts = [tokenizer(f"rank {rank()} question {i}:")["input_ids"] for i in range(4)]
        eot, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        greedy = Sampling(max_new_tokens=12, greedy=True)
        ours = rollouts.generate(prompts, pad, eot, greedy)
        theirs = generate(expected, prompts, pad, eot, greedy, synced_gpus=False)
        assert torch.equal(ours.sequences, theirs.sequences), (ours.sequences, theirs.sequences)
        sampled = rollouts.generate(
            prompts, pad, eot, Sampling(max_new_tokens=12), seeds=[1, 2, 3, 4]
        )
        with torch.no_grad():
            trained, _ = response_logprobs(
                engine, sampled.sequences, sampled.attention_mask, sampled.prompt_width - 1
            )
        gap = (trained - sampled.logprobs)[sampled.response_mask].abs().max().item()
        assert gap < 1e-4, gap
        rollouts.close()
        line += f"; vLLM push {seconds:.3f} s, greedy equal, log-prob gap {gap:.2e}"
    report(line)
    teardown()  # while the engine lives: an abort at exit ('terminate called') failed CI once


if __name__ == "__main__":
    main()

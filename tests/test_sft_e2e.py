"""SFT end to end: learning on the embedded default, an export that reloads and reproduces the
run's own numbers, and a 2-rank ZeRO-3 run that logs once and exports complete weights."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.algos import causal_lm_nll_sum
from rlhf.config import Config
from rlhf.data.collate import count_targets, sft_batch
from rlhf.data.prepare import phase_dataset
from rlhf.modeling.loading import end_of_text_id
from rlhf.rl.generation import Sampling, decode_responses, generate
from tests.conftest import FAST, cache_overrides, read_metrics, read_summary, run_rlhf

pytestmark = pytest.mark.slow


def _run_config(run_dir) -> Config:
    """The typed config a run used, from the .hydra/config.yaml Hydra wrote."""
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), saved))


def _eval_loss(model, tokenizer, rows, batch_size: int = 50) -> float:
    """Per-answer-token NLL of ``rows`` (what eval/loss reports)."""
    nll = targets = 0.0
    rows = list(rows)
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            batch = sft_batch(rows[i : i + batch_size], tokenizer.pad_token_id, False)
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
            nll += causal_lm_nll_sum(logits.float(), batch["labels"]).item()
            targets += count_targets(batch["labels"])
    return nll / targets


@pytest.fixture(scope="module")
def default_run(cache_dir, tmp_path_factory):
    """One epoch of SFT on the embedded default (4000 rows, 125 steps of 32)."""
    run_dir = tmp_path_factory.mktemp("sft-default")
    overrides = ["step=sft", "optim.epochs=1", "logger.progress_bar=false"]
    run_rlhf([*overrides, *cache_overrides(cache_dir)], run_dir=run_dir)
    return run_dir


def test_sft_learns(default_run):
    summary = read_summary(default_run)
    assert summary["train/steps"] == 125
    assert summary["eval/ppl"] < 0.5 * summary["initial/eval/ppl"]
    assert summary["eval/loss"] < summary["initial/eval/loss"]
    assert summary["eval/gold_accuracy"] >= summary["initial/eval/gold_accuracy"]
    losses = [r["train/loss"] for r in read_metrics(default_run) if "train/loss" in r]
    assert losses[-1] < losses[0]


def test_export_reloads_and_reproduces_the_final_eval(default_run):
    cfg = _run_config(default_run)
    model_dir = default_run / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eot = end_of_text_id(cfg.model, tokenizer)
    eval_rows = phase_dataset(cfg.data, "sft", "eval", tokenizer, eot).with_format("python")
    summary = read_summary(default_run)
    # the exported weights are the trained ones: same eval loss as the run's final evaluation
    assert _eval_loss(model, tokenizer, eval_rows) == pytest.approx(summary["eval/loss"], rel=1e-4)

    # greedy answers of the final evaluation (eval_samples.jsonl) come back from the export
    final_step = summary["train/steps"]
    lines = (default_run / "eval_samples.jsonl").read_text().splitlines()
    samples = [s for s in map(json.loads, lines) if s["step"] == final_step]
    assert samples
    prompt_ids = {r["prompt"]: r["prompt_ids"] for r in eval_rows}
    rollout = generate(
        model,
        [prompt_ids[s["prompt"]] for s in samples],
        tokenizer.pad_token_id,
        eot,
        Sampling(max_new_tokens=cfg.sft.gen_max_new_tokens, greedy=True),
        synced_gpus=False,
    )
    assert decode_responses(tokenizer, rollout) == [s["answer"] for s in samples]

    # and a plain transformers user can prompt it
    prompt = "\n\nHuman: What is 2 plus 3?\n\nAssistant:"
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=eot)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    assert answer.strip()


SHORT = [
    "step=sft",
    *FAST,
    "step.max_steps=5",
    "step.log_interval=1",
    "sft.gold_eval_prompts=8",
    "model.dtype=fp32",
]


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model" / "model.safetensors")


def _tiny_base(cache_dir, run_dir) -> dict[str, torch.Tensor]:
    """The untrained tiny model the run started from (built in the cache)."""
    config = json.loads((run_dir / "model" / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "ffn_dim", "vocab_size")
    for config_file in (cache_dir / "models").glob("tiny-*/config.json"):
        if all(json.loads(config_file.read_text())[k] == config[k] for k in keys):
            return load_file(config_file.parent / "model.safetensors")
    raise AssertionError("the run's tiny model is not in the cache")


def test_zero3_two_ranks_logs_once_and_exports_what_one_process_trains(cache_dir, tmp_path):
    zero3, zero0 = tmp_path / "zero3", tmp_path / "zero0"
    base = [*SHORT, *cache_overrides(cache_dir)]
    run_rlhf(
        [
            *base,
            "zero=stage3",
            "optim.micro_batch_size=8",
            "zero.stage3_param_persistence_threshold=0",  # partition every parameter
        ],
        run_dir=zero3,
        nproc=2,
    )
    run_rlhf([*base, "zero=stage0", "optim.micro_batch_size=16"], run_dir=zero0)

    # one run dir, one metrics file, every row once (rank 0 writes alone)
    assert list(zero3.rglob("metrics.jsonl")) == [zero3 / "metrics.jsonl"]
    assert len(list(zero3.rglob("summary.json"))) == 1
    lines = (zero3 / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines))
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 5]
    samples = (zero3 / "eval_samples.jsonl").read_text().splitlines()
    assert len(samples) == len(set(samples)) <= 8  # at most 4 per evaluation

    # the same numbers as one process
    summary3, summary0 = read_summary(zero3), read_summary(zero0)
    assert summary3["eval/loss"] == pytest.approx(summary0["eval/loss"], rel=1e-4)

    # the export gathered every partitioned weight: complete, trained, equal to ZeRO-0's
    exported, reference = _weights(zero3), _weights(zero0)
    untrained = _tiny_base(cache_dir, zero3)
    assert exported.keys() == untrained.keys() == reference.keys()
    for key, tensor in exported.items():
        assert tensor.shape == untrained[key].shape, key
        if tensor.dim() >= 2:
            assert tensor.abs().sum() > 0, f"{key} is all zeros"
            assert not torch.equal(tensor, untrained[key]), f"{key} did not train"
        torch.testing.assert_close(tensor, reference[key], rtol=1e-4, atol=1e-4, msg=key)
    reloaded = AutoModelForCausalLM.from_pretrained(zero3 / "model")
    assert sum(p.numel() for p in reloaded.parameters()) > 0

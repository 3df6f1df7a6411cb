"""The published recipe, experiment=opt-1.3b-350m, runs its three steps with its own settings
(ZeRO-2, batch shapes, schedules and learning rates, EMA; it has no LoRA; its vLLM rollouts take
the transformers path here, where vLLM is not installed), on random-init models
of OPT-125m's and OPT-350m's shapes (the reward model's post-norm layers and 512-wide embeddings
included; the vocabulary is the shipped tokenizer's, which the models read) and local copies of
its four datasets in their hub schemas, on CPU, a few steps each. Only the lengths are cut (the
toy rows are short), the steps counted and the evaluations kept small."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

from rlhf import tasks
from rlhf.assets import TINY_TOKENIZER_DIR
from rlhf.config import TINY_VOCAB_SIZE
from tests.conftest import (
    CONF_DIR,
    cache_overrides,
    read_metrics,
    read_summary,
    run_rlhf,
)

RECIPE = "experiment=opt-1.3b-350m"
SHAPES = {  # facebook/opt-125m and facebook/opt-350m's config.json, random weights
    "opt-125m": dict(hidden_size=768, word_embed_proj_dim=768, num_hidden_layers=12, ffn_dim=3072,
                     num_attention_heads=12, do_layer_norm_before=True),
    "opt-350m": dict(hidden_size=1024, word_embed_proj_dim=512, num_hidden_layers=24, ffn_dim=4096,
                     num_attention_heads=16, do_layer_norm_before=False),
}  # fmt: skip
SOURCES = ("rm-static", "full-hh-rlhf", "synthetic-instruct-gptj-pairwise", "rlhf-reward-datasets")
# the rows are the toy task's, short: the recipe's 512 / 256 / 256 tokens would only pad
SHORT = ["data.max_seq_len=64", "data.max_prompt_len=32", "ppo.rollout.max_new_tokens=16"]
QUICK = [
    "step.max_steps=2",
    "step.eval_at_start=false",
    "step.log_interval=1",
    "data.max_eval_rows=4",
    "sft.gold_eval_prompts=0",
    "ppo.eval.prompts=2",
    "ppo.eval.samples=1",
    "logger.progress_bar=false",
]
ENGINE = re.compile(
    r"\] - (actor|critic): ZeRO-(\d), offload=(\w+) .*, (no LoRA|LoRA rank \d+).* lr ([\d.e+-]+)"
)


def test_the_recipe_takes_vllm_rollouts_in_place_of_the_hybrid_engine():
    recipe = yaml.safe_load(
        (CONF_DIR / "experiment_step" / "opt-1.3b-350m" / "ppo.yaml").read_text()
    )
    assert recipe["actor"].get("hybrid_engine") is not True  # refused on CPU and transformers 5
    assert recipe["ppo"]["rollout"]["engine"] == "vllm"


def _model(name: str, out: Path) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    config = OPTConfig(
        vocab_size=TINY_VOCAB_SIZE,  # the shipped tokenizer's (OPT's own: 50272)
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **SHAPES[name],
    )
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _datasets(root: Path) -> list[str]:
    """Local copies of the recipe's four datasets in their hub schemas, from toy rows."""
    toy = tasks.resolve("toy")
    train, test = toy.rows("train", 600, 0, 0), toy.rows("test", 60, 0, 0)

    def write(rows: list[dict], path: Path, schema) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(schema(r)) + "\n" for r in rows))

    def dahoas(r):  # rm-static, full-hh-rlhf: the prompt as is
        return {k: r[k] for k in ("prompt", "response", "chosen", "rejected")}

    def question(r):
        return r["prompt"].removeprefix("\n\nHuman: ").removesuffix("\n\nAssistant:")

    def plain(r):  # synthetic-instruct-gptj-pairwise: a question and two answers
        return {"prompt": question(r), "chosen": r["chosen"][1:], "rejected": r["rejected"][1:]}

    def turns(r):  # rlhf-reward-datasets: the answers start with "Assistant:"
        prompt = r["prompt"].removesuffix("Assistant:")
        return {"prompt": prompt, "chosen": "Assistant:" + r["chosen"], "rejected": "Assistant:" + r["rejected"]}  # fmt: skip

    out = []
    for name, schema in zip(SOURCES, (dahoas, dahoas, plain, turns)):
        if name == "synthetic-instruct-gptj-pairwise":  # one split: eval rows are carved
            write(train + test, root / f"{name}.jsonl", schema)
            out.append(f"data.sources.{name}.path={root / f'{name}.jsonl'}")
        else:
            write(train, root / name / "train.jsonl", schema)
            write(test, root / name / "test.jsonl", schema)
            out.append(f"data.sources.{name}.path={root / name}")
    return out


def _engines(run_dir: Path) -> dict[str, tuple]:
    found = {}
    for line in (run_dir / "__main__.log").read_text().splitlines():
        if m := ENGINE.search(line):
            found[m[1]] = (int(m[2]), m[3], m[4], float(m[5]))
    return found


@pytest.mark.slow
def test_the_published_recipe_runs_its_three_steps(tmp_path, cache_dir):
    data = _datasets(tmp_path / "data")
    actor, critic = (
        _model("opt-125m", tmp_path / "opt-125m"),
        _model("opt-350m", tmp_path / "opt-350m"),
    )
    common = [RECIPE, *SHORT, *QUICK, *data, *cache_overrides(cache_dir)]

    def run(step: str, *overrides: str) -> Path:
        run_rlhf(
            [*common, f"step={step}", *overrides],
            run_dir=tmp_path / step,
            timeout=1200,
        )
        return tmp_path / step

    sft = run("sft", f"model.path={actor}")
    reward = run("reward", f"model.path={critic}")
    exports = [f"actor.model.path={sft / 'model'}", f"critic.model.path={reward / 'model'}"]
    # the recipe's vLLM rollouts need vLLM (scripts/install_vllm.sh; tests/test_vllm.py runs
    # them): here the transformers path generates, everything else is the recipe's
    ppo = run("ppo", *exports, "ppo.rollout.engine=hf")

    # step 1: run_1.3b.sh's lr 9.65e-6, cosine without warmup (over these 2 steps: half of the
    # peak after the first), micro batches of 8 rows
    first = next(r for r in read_metrics(sft) if "train/lr" in r)
    assert first["train/lr"] == pytest.approx(9.65e-6 / 2, rel=0.01)
    assert read_summary(sft)["train/steps"] == 2
    # step 2: run_350m.sh's OPT-350m (post-norm layers, 512-wide embeddings projected in)
    exported = json.loads((reward / "model" / "config.json").read_text())
    assert (exported["hidden_size"], exported["word_embed_proj_dim"]) == (1024, 512)
    assert exported["do_layer_norm_before"] is False
    assert "eval/accuracy" in read_summary(reward)
    # step 3: ZeRO-2 actor and critic at 9.65e-6 / 5e-6, no LoRA, EMA exported
    assert _engines(ppo) == {
        "actor": (2, "none", "no LoRA", 9.65e-6),
        "critic": (2, "none", "no LoRA", 5e-6),
    }
    rows = [r for r in read_metrics(ppo) if "ppo/kl" in r]
    assert len(rows) == 2 and all(r["ppo/response_length"] > 0 for r in rows)
    for name in ("actor", "critic", "actor_ema"):
        assert (ppo / name / "config.json").exists(), name

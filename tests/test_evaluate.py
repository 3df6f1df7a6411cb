"""python -m rlhf.cli.evaluate reward: the reward step's evaluation table without training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf.cli.evaluate import PooledScore, composed, evaluate_reward, main, scoring_model
from tests.conftest import FAST, REPO, cache_overrides, read_summary, run_rlhf

DATA = [o for o in FAST if o.startswith("data.")]


def evaluate_cmd(path: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "rlhf.cli.evaluate", "reward", "--path", str(path), *overrides]


def test_the_table_is_the_reward_runs_own(tmp_path, cache_dir):
    run_dir = tmp_path / "reward"
    run_rlhf(["step=reward", *FAST, "step.max_steps=8", *cache_overrides(cache_dir)], run_dir)
    out = tmp_path / "metrics.json"
    cmd = evaluate_cmd(run_dir / "model", *DATA, *cache_overrides(cache_dir), "--out", str(out))
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = {k: v for k, v in read_summary(run_dir).items() if k.startswith("eval/")}
    metrics = json.loads(out.read_text())
    assert set(metrics) == set(summary) and "eval/ece" in metrics
    assert "eval/accuracy_rejected/wrong" in metrics  # the embedded task's kinds of rejected answer
    for key, value in summary.items():
        assert metrics[key] == pytest.approx(value, abs=1e-5), key
    assert f"eval/accuracy {summary['eval/accuracy']:.4f}" in " ".join(done.stdout.split())
    assert "64 held-out pairs of toy" in done.stderr


def _classifier(path: Path, labels: int, vocab_size: int = 1280) -> Path:
    """A tiny DeBERTa-v2 classifier (a pooled head, as OpenAssistant's reward models have)
    with the shipped tokenizer."""
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2ForSequenceClassification

    from rlhf.assets import TINY_TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    config = DebertaV2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        num_labels=labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    DebertaV2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_pooled_classifier_scores_each_row_with_its_own_logit(tmp_path, cache_dir):
    path = _classifier(tmp_path / "deberta", labels=1)
    cfg = composed(str(path), [*DATA, *cache_overrides(cache_dir)])
    from rlhf.modeling.loading import load_tokenizer

    model = scoring_model(cfg, str(path), load_tokenizer(cfg.model, str(path)))
    assert isinstance(model, PooledScore)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    scores = model(ids, mask)
    logits = model.hf(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert scores.shape == (2, 4) and torch.equal(scores, logits[:, None].expand(2, 4))
    metrics = evaluate_reward(cfg, str(path))
    assert 0 <= metrics["eval/accuracy"] <= 1 and "eval/margin_p50" in metrics


def test_a_real_sized_export_is_evaluated_under_the_default_model_option(tmp_path, cache_dir):
    """model=tiny's tuning refuses a real model for training; an evaluation trains nothing."""
    path = _classifier(tmp_path / "real", labels=1, vocab_size=50272)
    cfg = composed(str(path), [*DATA, *cache_overrides(cache_dir)])
    assert cfg.model.path == str(path)


def test_a_classifier_of_two_labels_is_refused_in_one_line(tmp_path, capsys):
    path = _classifier(tmp_path / "two", labels=2)
    capsys.readouterr()  # save_pretrained's progress bar, when no earlier test turned it off
    assert main(["reward", "--path", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --path={path}: a classifier of 2 labels; a reward model has one"


def test_a_bad_override_is_one_line(capsys):
    assert main(["reward", "--path", str(REPO), "data=nope"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: data=nope: no such option") and "hh-rlhf" in line


def _causal_lm(path: Path) -> Path:
    """A tiny OPT causal LM, as an SFT export is (its config has num_labels 2: HF's default)."""
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    from rlhf.assets import TINY_TOKENIZER_DIR

    config = OPTConfig(
        vocab_size=1280, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2
    )
    OPTForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR).save_pretrained(path)
    return path


def _refused(path: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["reward", "--path", str(path)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    return line


def test_an_sft_export_is_said_to_be_a_causal_lm(tmp_path, capsys):
    """It was called a classifier of 2 labels; PPO's check of its reward model says what it is."""
    path = _causal_lm(tmp_path / "sft" / "model")
    assert _refused(path, capsys) == (
        f"error: --path={path}: a causal LM (OPTForCausalLM in its config.json), not a reward "
        "model; rlhf.cli.evaluate reward scores answers with it: give a reward export "
        "(RUN/reward/model)"
    )


def test_a_run_dir_names_its_reward_model(tmp_path, capsys):
    """It was a transformers traceback (no config.json there)."""
    run = tmp_path / "run"
    _causal_lm(run / "sft" / "model")
    _classifier(run / "reward" / "model", labels=1)
    (run / ".hydra").mkdir()
    assert _refused(run, capsys) == (
        f"error: --path={run}: a run directory, not a model export; give its reward model: "
        f"--path={run / 'reward' / 'model'}"
    )


def test_a_run_dir_without_a_reward_model_says_so(tmp_path, capsys):
    run = tmp_path / "sft-run"
    _causal_lm(run / "model")
    assert _refused(run, capsys) == (
        f"error: --path={run}: a run directory, not a model export, and no reward model was "
        f"exported in it ({run / 'reward' / 'model'} or {run / 'model'})"
    )

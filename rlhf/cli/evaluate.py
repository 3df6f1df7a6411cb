"""Judge a reward model without training it: the table step 2's evaluation logs, for any export.

    python -m rlhf.cli.evaluate reward --path RUN/reward/model                 # on its own data
    python -m rlhf.cli.evaluate reward --path RUN/reward/model data=hh-rlhf --out rm.json
    python -m rlhf.cli.evaluate reward --path OpenAssistant/reward-model-deberta-v3-large-v2 \\
        data=hh-rlhf model.end_of_text_token=null

Everything after the flags is a Hydra override of the run's config (``data=...``,
``data.sources.*``, ``data.max_seq_len``, ``model.dtype``...), composed as ``python -m rlhf
step=reward model.path=EXPORT`` composes it, so the pairs are those the reward step holds out: the
reward phase's share of each source's eval split, at most ``data.max_eval_rows`` of them
(``data.phase_split=[0,1,0] data.max_eval_rows=0``: every pair of the eval splits).
The scores are read where the export was trained to put them (its ``reward_stats.json`` says the
position; else ``reward.score_position``). A head that scores every token (OPT, Llama, GPT-2...)
goes through the reward step's own scoring; a pooled one (DeBERTa, RoBERTa) gives HF's logit.
Prints the metrics (rlhf.evaluators.pair_metrics) as a table; ``--out`` also writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    from rlhf.config import ConfigError

    try:
        cfg = composed(args.path, overrides)
        metrics = evaluate_reward(cfg, args.path, args.batch_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table(metrics))
    if args.out:
        Path(args.out).write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf.cli.evaluate",
        description="The reward step's evaluation table for a sequence-classification export, "
        "on any preference data rlhf reads; trailing words are overrides (data=hh-rlhf ...).",
    )
    parser.add_argument("what", choices=["reward"], help="what to evaluate")
    parser.add_argument("--path", required=True, help="the export: a directory or a hub id")
    parser.add_argument("--out", help="also write the metrics to this JSON file")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="pairs per forward pass (default: optim.eval_micro_batch_size)",
    )
    return parser


def composed(path: str, overrides: list[str]):
    """The typed config ``python -m rlhf step=reward model.path=PATH OVERRIDES`` would run."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    from rlhf.checks import preflight
    from rlhf.checks.validate import validated
    from rlhf.cli.help import CONF_DIR
    from rlhf.config import ConfigError, schema
    from rlhf.config.sharing import share_command_line

    given = ["step=reward", f"model.path={path}", *overrides]
    preflight.check_override_syntax(given)
    schema.register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", given)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(preflight.composition_error(err)) from None
    with open_dict(cfg):
        cfg.pop("hydra", None)
    share_command_line(cfg, given)
    return validated(cfg, trains=False)  # any export, whatever model= tuned


def evaluate_reward(cfg, path: str, batch_size: int | None = None) -> dict[str, float]:
    """The eval/ metrics of the export at ``path`` on the reward phase's held-out pairs."""
    import datasets
    import transformers

    from rlhf.data.prepare import phase_dataset
    from rlhf.evaluators.pair_metrics import pair_metrics
    from rlhf.evaluators.pair_scores import scored_pairs
    from rlhf.modeling.loading import end_of_text_id, load_tokenizer, read_stats

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    check_reward_export(cfg, path)
    tokenizer = load_tokenizer(cfg.model, path)
    rows = phase_dataset(
        cfg.data, "reward", "eval", tokenizer, end_of_text_id(cfg.model, tokenizer)
    )
    stats = read_stats(path) if Path(path).is_dir() else None
    position = (stats or {}).get("score_position", cfg.reward.score_position)
    model = scoring_model(cfg, path, tokenizer)
    with torch.no_grad():
        pairs = scored_pairs(
            model,
            rows,
            tokenizer.pad_token_id,
            batch_size or cfg.optim.eval_micro_batch_size,
            position,
        )
    sources = ", ".join(cfg.data.sources)
    print(f"{path}: {len(pairs)} held-out pairs of {sources}", file=sys.stderr)
    return pair_metrics(pairs)


def scoring_model(cfg, path: str, tokenizer) -> torch.nn.Module:
    """(B, T) ids and mask -> (B, T) scores, on the device, in eval mode: the reward step's
    ValueModel for a head that scores every token (``score``: OPT, Llama, GPT-2...), else
    :class:`PooledScore`."""
    from transformers import AutoModelForSequenceClassification

    from rlhf.modeling.loading import ValueModel, model_config, pretrained_kwargs
    from rlhf.runtime.engine import device_type, resolve_dtype

    device = device_type(cfg.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    config = model_config(cfg.model, path)
    config.pad_token_id = tokenizer.pad_token_id
    hf = AutoModelForSequenceClassification.from_pretrained(
        path, config=config, **pretrained_kwargs(cfg.model, dtype, None)
    )
    if len(tokenizer) > hf.get_input_embeddings().num_embeddings:
        hf.resize_token_embeddings(
            len(tokenizer)
        )  # a pad token added (rlhf.modeling.loading.load_tokenizer)
    model = ValueModel(hf) if hasattr(hf, "score") else PooledScore(hf)
    return model.to(device).eval()


# where a run dir holds a reward model: step=all's reward step, a step=reward run's export
REWARD_EXPORTS = ("reward/model", "model")


def check_reward_export(cfg, path: str) -> None:
    """--path is a reward model: not a run dir (its exports are named), not a causal LM (the
    check PPO's reward model gets), not a classifier of several labels."""
    from rlhf.checks import model_dirs
    from rlhf.config import ConfigError
    from rlhf.modeling.loading import model_config

    if Path(path).expanduser().is_dir():
        config_json = model_dirs.read_model_config("--path", path)
        if config_json is None:
            raise ConfigError(not_an_export_problem(path))
        need = "rlhf.cli.evaluate reward scores answers with it: give a reward export (RUN/reward/model)"
        check = model_dirs.ModelToCheck("--path", path, model_dirs.REWARD, None, need)
        problem = model_dirs.causal_lm_as_reward_problem(check, config_json)
        if problem:
            raise ConfigError(problem)
    labels = model_config(cfg.model, path).num_labels
    if labels != 1:
        raise ConfigError(f"--path={path}: a classifier of {labels} labels; a reward model has one")


def not_an_export_problem(path: str) -> str:
    """A directory without config.json: a run dir (naming the reward exports in it), or not a
    model at all."""
    from rlhf.checks.model_dirs import missing_config_problem

    run = Path(path)
    exports = [run / e for e in REWARD_EXPORTS if _is_reward_model(run / e)]
    is_run = any((run / e).is_dir() for e in (*REWARD_EXPORTS, ".hydra"))
    if not is_run and not (run / "resolved.yaml").is_file():
        return missing_config_problem("--path", path)
    if not exports:
        where = " or ".join(str(run / e) for e in REWARD_EXPORTS)
        return (
            f"--path={path}: a run directory, not a model export, and no reward model was "
            f"exported in it ({where})"
        )
    return (
        f"--path={path}: a run directory, not a model export; give its reward model: "
        f"--path={' or --path='.join(map(str, exports))}"
    )


def _is_reward_model(export: Path) -> bool:
    from rlhf.checks.model_dirs import read_model_config

    if not (export / "config.json").is_file():
        return False
    config_json = read_model_config("--path", str(export)) or {}
    return any(
        a.endswith("ForSequenceClassification") for a in config_json.get("architectures") or []
    )


class PooledScore(torch.nn.Module):
    """A pooled classifier's one logit per row, at every position (so any score position reads
    it): (B, T) ids and mask -> (B, T)."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits = self.hf(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits[:, :1].float().expand(-1, input_ids.shape[1])


def table(metrics: dict[str, float]) -> str:
    width = max(map(len, metrics), default=0)
    return "\n".join(f"{name:<{width}}  {value:.4f}" for name, value in sorted(metrics.items()))


if __name__ == "__main__":
    sys.exit(main())

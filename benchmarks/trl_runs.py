"""TRL's SFTTrainer and RewardTrainer on the rows, in the order, of an rlhf run: the bench's TRL
columns. :func:`run_trl` plans the rows and starts :func:`trl_worker` in a subprocess
(``python -m benchmarks _trl SPEC``, torchrun for several ranks)."""

from __future__ import annotations

import json
import resource
import shutil
import time
from pathlib import Path

from benchmarks.runs import phase_rows, run_logged


def trl_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("trl")
    except Exception:
        return None


def run_trl(section: str, fast_dir: Path, model: str, steps: int, run_dir: Path, args) -> dict:
    """TRL's trainer on the rows, in the order, of the fast run ``fast_dir`` (:func:`trl_worker`
    in a subprocess)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = {
        "kind": section,
        "run_dir": str(fast_dir),
        "model": model,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "ranks": args.ranks,
        "steps": steps,
        "dtype": args.dtype,
        "max_seq_len": args.max_seq_len,
        "out": str(run_dir),
    }
    # the rows are planned here, in one process: each torchrun rank of the worker would read the
    # rlhf cache before TRL starts torch.distributed, when only rank 0 may
    rows, _ = plan_rows(spec)
    columns = ("prompt_ids", "chosen_ids", "rejected_ids")
    (run_dir / "rows.json").write_text(json.dumps([{c: r[c] for c in columns} for r in rows]))
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    wall = run_logged(["benchmarks", "_trl", str(run_dir / "spec.json")], run_dir, args)
    return {**json.loads((run_dir / "result.json").read_text()), "wall_s": wall}


def plan_rows(spec: dict) -> tuple[list[dict], object]:
    """The rows the rlhf run trained on, in its step order (same cache, same plan)."""
    from rlhf.data.sampling import EpochPlan

    phase = "sft" if spec["kind"] == "sft" else "reward"
    rows, tokenizer, seed = phase_rows(Path(spec["run_dir"]), spec["model"], phase)
    plan = EpochPlan(len(rows), spec["micro_batch"], spec["ranks"], spec["grad_accum"], seed)
    size, order = plan.global_batch_size, []
    for step in range(spec["steps"]):
        epoch, index = divmod(step, plan.steps_per_epoch)
        order += plan.permutation(epoch)[index * size : (index + 1) * size].tolist()
    return rows.select(order).to_list(), tokenizer


def trl_worker(spec_path: str) -> None:
    """Runs in the subprocess: TRL's SFTTrainer or RewardTrainer, sequential sampling over the
    rlhf run's rows (so each step holds the same rows), timed from step begin to step end."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from rlhf.config import ModelConfig
    from rlhf.modeling.loading import load_tokenizer

    spec = json.loads(Path(spec_path).read_text())
    rows = json.loads((Path(spec["out"]) / "rows.json").read_text())
    tokenizer = load_tokenizer(ModelConfig(path=spec["model"]), spec["model"])

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []

        def on_step_begin(self, *_, **__):
            self.seconds.append(-time.perf_counter())

        def on_step_end(self, *_, **__):
            self.seconds[-1] += time.perf_counter()

    common = {
        "output_dir": spec["out"],
        "per_device_train_batch_size": spec["micro_batch"],
        "gradient_accumulation_steps": spec["grad_accum"],
        "max_steps": spec["steps"],
        "max_length": spec["max_seq_len"],
        "train_sampling_strategy": "sequential",
        "learning_rate": 1e-4,
        "logging_steps": spec["steps"],
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "bf16": spec["dtype"] == "bf16",
        "model_init_kwargs": {"dtype": torch.bfloat16 if spec["dtype"] == "bf16" else "float32"},
        "gradient_checkpointing": False,  # TRL's default is on; rlhf's runs keep activations
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "ddp_backend": "gloo" if spec["ranks"] > 1 else None,
    }
    if spec["kind"] == "sft":
        seqs = [(r["prompt_ids"], r["chosen_ids"]) for r in rows]
        dataset = Dataset.from_list(
            [{"input_ids": p + c, "labels": [-100] * len(p) + c} for p, c in seqs]
        )
        trainer_cls, args = trl.SFTTrainer, trl.SFTConfig(**common, packing=False)
        tokens = [len(p) + len(c) for p, c in seqs]
    else:
        dataset = Dataset.from_list(
            [
                {
                    "chosen_ids": r["prompt_ids"] + r["chosen_ids"],
                    "rejected_ids": r["prompt_ids"] + r["rejected_ids"],
                }
                for r in rows
            ]
        )
        trainer_cls, args = trl.RewardTrainer, trl.RewardConfig(**common)
        tokens = [len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows]
        tokens = [n + 2 * len(r["prompt_ids"]) for n, r in zip(tokens, rows)]
    timer = StepTimer()
    trainer = trainer_cls(
        model=spec["model"], args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.add_callback(timer)
    metrics = trainer.train().metrics
    if args.process_index == 0:
        size = len(rows) // spec["steps"]  # rows a step, all ranks
        skip = 1 if spec["steps"] > 1 else 0  # the first step warms up (as for the rlhf runs)
        seconds = sum(timer.seconds[skip:])
        result = {
            "samples_per_s": (spec["steps"] - skip) * size / seconds,
            "tokens_per_s": sum(tokens[skip * size :]) / seconds,
            "peak_mem_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "trl_train_samples_per_second": metrics.get("train_samples_per_second"),
            "trl_version": trl.__version__,
        }
        (Path(spec["out"]) / "result.json").write_text(json.dumps(result, indent=2))

"""DeepSpeed-Chat's own code as ``python -m benchmarks reference --dschat PATH`` runs it (see
benchmarks/dschat.py): finding it in a checkout, the interpreter it needs, its step 1-3
commands on the dschat scenario, the decoding written into its actor's config, its data files,
and the rates read off its output."""

from __future__ import annotations

import ast
import json
import statistics
import subprocess
from pathlib import Path

from benchmarks.wallclock import Timed, median_interval
from benchmarks.workload import DSCHAT, DSCHAT_RUNS, dschat_rows, dschat_split

SCRIPTS = {
    "sft": "training/step1_supervised_finetuning/main.py",
    "reward": "training/step2_reward_model_finetuning/main.py",
    "ppo": "training/step3_rlhf_finetuning/main.py",
}
# DeepSpeed-Chat's learning rates for OPT in its single-node scripts; speed does not depend on
# them, and rlhf's runs keep their own defaults
DSCHAT_LR = {"sft": "9.65e-6", "reward": "5e-5", "actor": "9.65e-6", "critic": "5e-6"}


def dschat_folder(path: Path) -> Path:
    """The DeepSpeed-Chat folder of ``path`` (a DeepSpeedExamples checkout or the folder
    itself), checked for the three steps' main.py."""
    for chat in (path / "applications" / "DeepSpeed-Chat", path):
        if (
            all((chat / script).is_file() for script in SCRIPTS.values())
            and (chat / "dschat").is_dir()
        ):
            return chat.resolve()
    raise ValueError(
        f"--dschat {path}: no DeepSpeed-Chat there (looked for applications/DeepSpeed-Chat/"
        f"{SCRIPTS['sft']} and its dschat/ package); get it with `git clone "
        "https://github.com/deepspeedai/DeepSpeedExamples` (tested at 83757d9c)"
    )


DSCHAT_ENV_HINT = (
    "python3 -m venv ENV && ENV/bin/pip install torch==2.13.0 && ENV/bin/pip install "
    "deepspeed==0.19.8 'transformers>=4.46,<5' 'datasets<4' sentencepiece protobuf "
    "accelerate tensorboard"
)


def dschat_environment(python: str) -> None:
    """Refuse, before any run, an interpreter DeepSpeed-Chat cannot finish in: it needs
    DeepSpeed, datasets and tensorboard, and transformers 4 (at 83757d9c its steps 1 and 2
    save the tokenizer with save_vocabulary, which transformers 5's tokenizers lack)."""
    probe = "import deepspeed, datasets, tensorboard, transformers; print(transformers.__version__)"
    try:
        proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    except OSError as err:
        raise ValueError(f"--dschat-python {python}: {err.strerror}") from err
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"--dschat-python {python}: {last}; make one with: {DSCHAT_ENV_HINT}")
    version = proc.stdout.strip()
    if int(version.split(".")[0]) >= 5:
        raise ValueError(
            f"--dschat-python {python} has transformers {version}: DeepSpeed-Chat's steps 1 "
            f"and 2 need transformers 4 to save their tokenizer; make one with: {DSCHAT_ENV_HINT}"
        )


def dschat_command(
    section: str, args, models: dict[str, Path], out: Path, answers: str
) -> list[str]:
    """DeepSpeed-Chat's ``main.py`` of ``section`` on the workload, under DeepSpeed's launcher
    (the copy in the results directory, whose data/ its dataset reads)."""
    phases = dschat_rows(args.scale)
    common = [
        "--data_path", "local/jsonfile",
        "--data_split", "{sft},{reward},{ppo}".format(**phases),
        "--data_output_path", str(args.out / "dschat-data"),
        "--seed", "1234",
        "--dtype", DSCHAT["dtype"],
        "--deepspeed",
        "--lr_scheduler_type", "cosine",
        "--num_warmup_steps", "0",
        "--gradient_accumulation_steps", str(DSCHAT["grad_accum"]),
        "--output_dir", str(out),
    ]  # fmt: skip
    micro = str(DSCHAT["micro_batch"])
    if section in ("sft", "reward"):
        step = [
            "--model_name_or_path", str(models["actor" if section == "sft" else "critic"]),
            "--num_train_epochs", str(DSCHAT_RUNS[section][1]),
            "--per_device_train_batch_size", micro,
            "--per_device_eval_batch_size", micro,
            "--max_seq_len", str(DSCHAT["max_seq_len"]),
            "--learning_rate", DSCHAT_LR[section],
            "--zero_stage", str(DSCHAT["zero"]),
        ]  # fmt: skip
        if section == "reward":
            step += ["--num_padding_at_beginning", "1"]
    else:
        answer = DSCHAT["max_seq_len"] - DSCHAT["max_prompt_len"]
        step = [
            "--actor_model_name_or_path", str(models["sft"]),
            "--critic_model_name_or_path", str(models["reward"]),
            "--num_padding_at_beginning", "1",
            "--num_train_epochs", "1",
            "--per_device_generation_batch_size", str(DSCHAT["ppo_batch"]),
            "--per_device_training_batch_size", str(DSCHAT["ppo_batch"]),
            "--generation_batches", "1",
            "--ppo_epochs", "1",
            "--max_prompt_seq_len", str(DSCHAT["max_prompt_len"]),
            "--max_answer_seq_len", str(answer),
            "--actor_learning_rate", DSCHAT_LR["actor"],
            "--critic_learning_rate", DSCHAT_LR["critic"],
            "--actor_zero_stage", str(DSCHAT["zero"]),
            "--critic_zero_stage", str(DSCHAT["zero"]),
        ]  # fmt: skip
        step += ["--print_answers", "--print_answers_interval", "1"]  # to count answer tokens
    return [
        args.dschat_python, "-m", "deepspeed.launcher.runner",
        "--num_gpus", str(DSCHAT["ranks"]), "--master_port", str(free_port()),
        str(args.work_chat / SCRIPTS[section]), *common, *step,
    ]  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_decoding(actor: Path, greedy: bool, fixed_answer: int | None) -> None:
    """DeepSpeed-Chat's step 3 samples as the actor checkpoint's config says (its generate()
    passes no sampling settings): sampled at T=1 with top-k and top-p off (rlhf's defaults) or
    greedy, and with ``fixed_answer`` every answer exactly that many tokens."""
    path = actor / "config.json"
    config = json.loads(path.read_text())
    for key in ("do_sample", "top_k", "top_p", "temperature", "min_new_tokens"):
        config.pop(key, None)
    config["do_sample"] = not greedy
    if not greedy:
        config.update(top_k=0, top_p=1.0, temperature=1.0)
    if fixed_answer is not None:
        config["min_new_tokens"] = fixed_answer
    path.write_text(json.dumps(config, indent=2))


def dschat_result(section: str, timed: Timed, args, answers: str, tokenizer) -> dict[str, float]:
    """The rate of a DeepSpeed-Chat run from its output's arrival times (module docstring)."""
    result = {"peak_mem_gb": timed.peak_rss_gb, "wall_s": timed.wall_s}
    global_batch = DSCHAT["ranks"] * DSCHAT["micro_batch"]
    if section == "sft":
        result["samples_per_s"] = global_batch / median_interval(timed.times("Samples/sec:"))
    elif section == "reward":
        start, end = timed.times("Beginning of Epoch 1/"), timed.times(" with loss ")
        result["samples_per_s"] = dschat_rows(args.scale)["reward"] / (end[0] - start[0])
    else:
        s_per_iter = median_interval(timed.times("End-to-End => Latency"))
        answer_cap = DSCHAT["max_seq_len"] - DSCHAT["max_prompt_len"]
        length = answer_length(timed, tokenizer, answer_cap)
        if answers == "fixed":
            # min_new_tokens reached generate(); re-encoding the printed text is approximate
            if length < 0.95 * answer_cap:
                raise RuntimeError(
                    f"DeepSpeed-Chat's answers average {length:.1f} tokens with min_new_tokens "
                    f"{answer_cap} in the actor's config: its generate() did not take it"
                )
            length = float(answer_cap)
        generate_s = statistics.median(timed.values("Generation => Latency: "))
        update_s = statistics.median(timed.values("Training   => Latency: "))
        result.update(
            s_per_iter=s_per_iter,
            response_length=length,
            generate_s=generate_s,
            update_s=update_s,
            # the reference, critic and reward forwards, and what else an iteration does
            score_s=s_per_iter - generate_s - update_s,
        )
    return result


def answer_length(timed: Timed, tokenizer, cap: int) -> float:
    """The mean answer length of rank 0's printed answers (``--print_answers``), re-encoded:
    the text up to the end-of-text plus that token. The tokenizer DeepSpeed-Chat reloads from
    its own SFT output (vocab.json and merges.txt) does not know ``</s>`` as special, so it
    prints it; where an answer shows none and is shorter than ``cap``, its end-of-text was
    skipped as special. Byte-level pieces that do not decode whole make this approximate."""
    lengths = []
    for _, line in timed.lines:
        if line.startswith("--- ans    --> ") and "rank=0," in line:
            for text in ast.literal_eval(line.split("rank=0, ", 1)[1]):
                answer, ended, _ = text.partition("</s>")
                n = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
                lengths.append(min(cap, n + 1 if ended or n < cap else n))
    if not lengths:
        raise RuntimeError("no printed answers of rank 0 (--print_answers) to count")
    return statistics.mean(lengths)


def dschat_export(section: str, out: Path) -> Path:
    """Where a DeepSpeed-Chat run's model went (its save_hf_format)."""
    if not (out / "pytorch_model.bin").exists() and not (out / "model.safetensors").exists():
        raise RuntimeError(f"DeepSpeed-Chat's {section} run saved no model in {out}")
    return out


def dschat_data(args, data: Path) -> None:
    """The rows as DeepSpeed-Chat's ``local/jsonfile`` reads them: the chat folder's
    data/train.json (phases split by --data_split) and data/eval.json (the held-out rows)."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    total, _ = dschat_split(dschat_rows(args.scale))
    held_out = total - sum(dschat_rows(args.scale).values())
    folder = args.work_chat / "data"
    folder.mkdir(exist_ok=True)
    (folder / "train.json").write_text(json.dumps(rows[:-held_out]))
    (folder / "eval.json").write_text(json.dumps(rows[-held_out:]))


def checkout_commit(path: Path) -> str | None:
    proc = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return proc.stdout.strip() if proc.returncode == 0 else None

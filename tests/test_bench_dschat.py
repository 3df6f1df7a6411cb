"""``python -m benchmarks reference --dschat PATH`` (benchmarks/dschat.py): finding DeepSpeed-Chat
in a checkout, the commands it runs, the rates it reads off DeepSpeed-Chat's output, the decoding
it writes into the actor's config, and the report's ratios. No timing is asserted; the bench
itself needs a DeepSpeedExamples checkout (docs/performance.md)."""

import itertools
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from benchmarks import dschat, dschat_code, wallclock
from benchmarks.workload import DSCHAT
from rlhf.assets import TINY_TOKENIZER_DIR
from tests.conftest import REPO


def fake_checkout(root):
    chat = root / "applications" / "DeepSpeed-Chat"
    for script in dschat_code.SCRIPTS.values():
        (chat / script).parent.mkdir(parents=True, exist_ok=True)
        (chat / script).write_text("")
    (chat / "dschat").mkdir()
    return chat


def test_finds_deepspeed_chat_in_a_checkout_or_its_own_folder(tmp_path):
    chat = fake_checkout(tmp_path)
    assert dschat_code.dschat_folder(tmp_path) == chat.resolve()
    assert dschat_code.dschat_folder(chat) == chat.resolve()


def test_a_folder_without_deepspeed_chat_is_one_line_naming_what_was_looked_for(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "reference", "--dschat", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"--dschat {tmp_path}: no DeepSpeed-Chat there" in proc.stderr
    assert "git clone https://github.com/deepspeedai/DeepSpeedExamples" in proc.stderr


def test_an_interpreter_deepspeed_chat_cannot_finish_in_is_refused_before_any_run(tmp_path):
    # this environment's transformers is 5: DeepSpeed-Chat's step 1 would fail at its save
    with pytest.raises(ValueError, match=r"has transformers 5\.\S+: DeepSpeed-Chat's steps 1"):
        dschat_code.dschat_environment(sys.executable)
    with pytest.raises(ValueError, match="No such file"):
        dschat_code.dschat_environment(str(tmp_path / "python"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sections", "sft,dpo"], "--sections: unknown ['dpo']"),
        (["--answers", "short"], "--answers: unknown ['short']"),
        (["--rounds", "0"], "--rounds 0: at least 1"),
    ],
)
def test_bad_options_are_refused_by_name(tmp_path, argv, message, capsys):
    fake_checkout(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        dschat.parse_args(["--dschat", str(tmp_path), "--dschat-python", "/nonexistent", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def command_args(tmp_path):
    chat = fake_checkout(tmp_path / "checkout")
    return SimpleNamespace(scale=1.0, out=tmp_path / "out", work_chat=chat, dschat_python="py")


def test_the_commands_run_deepspeed_chats_own_scripts_on_the_scenarios_shapes(tmp_path):
    args = command_args(tmp_path)
    models = {k: tmp_path / k for k in ("actor", "critic", "sft", "reward")}
    sft = dschat_code.dschat_command("sft", args, models, tmp_path / "run", "-")
    assert sft[:4] == ["py", "-m", "deepspeed.launcher.runner", "--num_gpus"]
    assert sft[7] == str(args.work_chat / dschat_code.SCRIPTS["sft"])
    flags = dict(itertools.pairwise(sft))
    assert flags["--data_split"] == "800,1600,320"
    assert flags["--model_name_or_path"] == str(tmp_path / "actor")
    assert flags["--num_train_epochs"] == "4"
    assert flags["--zero_stage"] == "2"
    assert flags["--dtype"] == "bf16"
    ppo = dschat_code.dschat_command("ppo", args, models, tmp_path / "run", "eos")
    flags = dict(itertools.pairwise(ppo))
    assert flags["--actor_model_name_or_path"] == str(tmp_path / "sft")
    assert flags["--critic_model_name_or_path"] == str(tmp_path / "reward")
    assert flags["--max_answer_seq_len"] == "128"
    assert flags["--per_device_generation_batch_size"] == str(DSCHAT["ppo_batch"])
    assert "--print_answers" in ppo  # answer tokens are counted from them


def timed(lines):
    return wallclock.Timed(lines=lines, wall_s=100.0, peak_rss_gb=0.7)


def test_sft_rate_is_the_global_batch_over_the_median_step_interval():
    step = "Model Parameters: 0.004 B, Latency: 0.40s, TFLOPs: 0.03, Samples/sec: 9.9"
    times = [10.0, 10.5, 11.0, 11.5, 30.0, 30.5]  # an evaluation between epochs
    lines = [(0.0, "Beginning of Epoch 1/4")] + [(t, step) for t in times]
    result = dschat_code.dschat_result("sft", timed(lines), SimpleNamespace(scale=1.0), "-", None)
    assert result["samples_per_s"] == pytest.approx(8 / 0.5)
    assert result["peak_mem_gb"] == 0.7


def test_reward_rate_is_its_rows_over_the_epochs_training_time():
    lines = [
        (3.0, "***** Evaluating reward, Epoch 0/1 *****"),
        (5.0, "Beginning of Epoch 1/1, Total Micro Batches 200"),
        (45.0, "Epoch 1/1 with loss 0.69"),
        (50.0, "***** Evaluating reward, Epoch 1/1 *****"),
    ]
    result = dschat_code.dschat_result(
        "reward", timed(lines), SimpleNamespace(scale=1.0), "-", None
    )
    assert result["samples_per_s"] == pytest.approx(1600 / 40)


def test_ppo_iteration_is_the_median_interval_and_answers_are_counted_from_rank_0():
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER_DIR)
    words = [w for w in ("the", "of", "and", "to") if len(tokenizer.tokenize(" " + w)) == 1]
    short, long_ = " " + " ".join(words[:2]), " " + " ".join(words * 40)
    # as DeepSpeed-Chat prints them: the end-of-text shown, or skipped as special
    answers = [short + "</s>", short, long_]
    lines = []
    for i, t in enumerate((20.0, 21.0, 22.5, 23.5)):
        lines.append((t - 0.5, f"--- ans    --> step={i}, rank=0, {answers!r}"))
        lines.append((t - 0.4, f"--- ans    --> step={i}, rank=1, {['ignored']!r}"))
        lines.append((t, "End-to-End => Latency: 0.90s, TFLOPs: 0.01, Samples/sec: 8.8"))
        lines.append((t, f"Generation => Latency: 0.{5 + i}0s, Per-token Latency 4.1 ms"))
        lines.append((t, "Training   => Latency: 0.30s, TFLOPs: 0.05"))
    args = SimpleNamespace(scale=1.0)
    eos = dschat_code.dschat_result("ppo", timed(lines), args, "eos", tokenizer)
    assert eos["s_per_iter"] == pytest.approx(1.0)  # intervals 1.0, 1.5, 1.0
    # DeepSpeed-Chat's own split: generate and train medians, the rest of the interval scoring
    assert (eos["generate_s"], eos["update_s"]) == pytest.approx((0.65, 0.30))
    assert eos["score_s"] == pytest.approx(1.0 - 0.65 - 0.30)
    # the short answers stopped at their end-of-text (counted); the long one hit the 128 cap
    assert eos["response_length"] == pytest.approx((2 * (len(words[:2]) + 1) + 128) / 3)
    # fixed answers must reach the cap: these did not, so min_new_tokens did not take
    with pytest.raises(RuntimeError, match="did not take it"):
        dschat_code.dschat_result("ppo", timed(lines), args, "fixed", tokenizer)
    full = [(t, line.replace(repr(answers), repr([long_]))) for t, line in lines]
    fixed = dschat_code.dschat_result("ppo", timed(full), args, "fixed", tokenizer)
    assert fixed["response_length"] == 128


def test_too_few_timed_lines_say_so():
    with pytest.raises(RuntimeError, match="1 timed lines"):
        wallclock.median_interval([3.0])


def test_decoding_is_written_into_the_actors_config_and_replaced_each_time(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "opt", "top_k": 50}))
    dschat_code.set_decoding(tmp_path, greedy=False, fixed_answer=128)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["do_sample"] is True
    assert (config["top_k"], config["top_p"], config["temperature"]) == (0, 1.0, 1.0)
    assert config["min_new_tokens"] == 128
    assert config["model_type"] == "opt"
    dschat_code.set_decoding(tmp_path, greedy=True, fixed_answer=None)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["do_sample"] is False
    assert not {"min_new_tokens", "top_k", "top_p", "temperature"} & set(config)


def test_ratios_pair_each_round_and_invert_where_lower_is_better():
    def ppo(s_per_iter, length, peak):
        return {"s_per_iter": s_per_iter, "response_length": length, "peak_mem_gb": peak}

    results = {
        "ppo-fixed": {
            "rlhf": [ppo(1.0, 128, 0.6), ppo(2.0, 128, 0.6)],
            "dschat": [ppo(1.5, 128, 0.8), ppo(2.0, 128, 0.6)],
        }
    }
    rows = dschat.summarize(results)["ppo-fixed"]
    assert rows["iters_per_s"]["ratio"]["median"] == pytest.approx((1.5 + 1.0) / 2)
    assert rows["iters_per_s"]["ratio"]["min"] == pytest.approx(1.0)
    assert rows["ms_per_token"]["ratio"]["max"] == pytest.approx(1.5)
    assert rows["peak_mem_gb"]["ratio"]["median"] == pytest.approx((0.8 / 0.6 + 1) / 2)
    assert "ratio" not in rows["response_length"]
    assert rows["ms_per_token"]["rlhf"]["min"] == pytest.approx(1000 * 1.0 / (8 * 128))
    table = dschat.format_table(dschat.summarize(results))
    assert (
        "ppo-fixed | iterations/s | 0.75 (0.5-1) | 0.583 (0.5-0.667) | 1.25x (1.00-1.50)" in table
    )

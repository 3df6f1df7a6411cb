"""The report a run ends with: each step's headline metrics before -> after, its alarms, wall time,
exports and next commands, and step=all's report of the whole pipeline. The rules on summaries
in-process; the real thing on a short step=all (slow)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhf.steps import report
from tests.conftest import FAST, REPO, cache_overrides, read_summary, run_rlhf

PPO_SUMMARY = {
    "initial/eval/gold_accuracy": 0.02,
    "eval/gold_accuracy": 0.83,
    "initial/eval/gold_accuracy_sampled": 0.11,
    "eval/gold_accuracy_sampled": 0.75,
    "initial/eval/gold_correct": 0.84,
    "eval/gold_correct": 0.83,
    "initial/eval/kl": 0.0,
    "eval/kl": 1.94,
    "eval/hacking_warnings": 0,
    "ppo/skipped_updates": 0,
    "ppo/unterminated": 0.01,
    "perf/eval_share": 0.12,
    "perf/wall_s": 89.4,
}


def _export(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_headlines_are_before_after_and_change():
    rows = dict(report.headline_rows("ppo", PPO_SUMMARY))
    assert rows["gold accuracy, greedy"] == "0.02 -> 0.83 (+0.81)"
    assert rows["right value, greedy"] == "0.84 -> 0.83 (-0.01)"
    assert rows["KL to the reference, nats an answer"] == "0 -> 1.94 (+1.94)"
    assert "clean form, greedy" not in rows  # not in this summary: not shown
    sft = dict(report.headline_rows("sft", {"eval/ppl": 1.15}))
    assert sft == {"held-out perplexity": "1.15"}  # no initial value: the final alone


@pytest.mark.parametrize(
    "step, changed, expected",
    [
        ("ppo", {"eval/hacking_warnings": 3}, "possible reward hacking, 3 time(s)"),
        ("ppo", {"ppo/skipped_updates": 2}, "2 update(s) skipped for a non-finite loss"),
        ("ppo", {"ppo/unterminated": 0.75}, "75% of the last rollout's answers were cut"),
        ("ppo", {"eval/gold_correct": 0.7}, "eval/gold_correct moved the wrong way: 0.84 -> 0.7"),
        ("ppo", {"perf/eval_share": 0.45}, "evaluation took 45% of this step's wall time"),
        ("sft", {"initial/eval/ppl": 3.0, "eval/ppl": 4.0}, "eval/ppl moved the wrong way"),
        ("reward", {"eval/accuracy": 0.52}, "ranks held-out pairs near chance (0.52)"),
        (
            "reward",
            {"eval/accuracy_chosen_longer": 0.95, "eval/accuracy_chosen_shorter": 0.7},
            "prefers length: it ranks 0.95 of the pairs right where the chosen answer is the "
            "longer one, 0.70 where it is the shorter",
        ),
    ],
)
def test_each_alarm_fires_on_its_cause_alone(step, changed, expected):
    assert report.alarms(step, PPO_SUMMARY if step == "ppo" else {}) == []
    [alarm] = report.alarms(step, {**(PPO_SUMMARY if step == "ppo" else {}), **changed})
    assert expected in alarm, alarm


def test_a_step_report_lists_exports_and_the_next_commands(tmp_path):
    actor, critic = _export(tmp_path / "actor"), _export(tmp_path / "critic")
    (tmp_path / "checkpoints").mkdir()
    text = report.step_report("ppo", tmp_path, PPO_SUMMARY, in_pipeline=False)
    lines = text.splitlines()
    assert lines[0].startswith("rlhf: step=ppo finished in ")
    assert lines[0].endswith(f" (1 min 29 s in the step itself): {tmp_path}")
    assert f"  exports: {actor}, {critic}" in lines
    assert "  alarms: none" in lines
    assert any(f"python -m rlhf.cli.chat --path {actor}" in ln for ln in lines)
    assert any(f"python -m rlhf.cli.compare {tmp_path} OTHER_RUN" in ln for ln in lines)
    inside = report.step_report("ppo", tmp_path, PPO_SUMMARY, in_pipeline=True)
    assert inside.startswith(f"rlhf: step=ppo finished in 1 min 29 s: {tmp_path}")
    assert "next:" not in inside  # step=all runs the next step itself


def test_the_pipeline_report_covers_every_step(tmp_path):
    sft = _export(tmp_path / "sft" / "model").parent
    reward = _export(tmp_path / "reward" / "model").parent
    ppo = _export(tmp_path / "ppo" / "actor").parent
    summaries = {
        "sft": {"initial/eval/ppl": 9.0, "eval/ppl": 1.15, "perf/wall_s": 61},
        "reward": {"initial/eval/accuracy": 0.5, "eval/accuracy": 0.52, "perf/wall_s": 116},
        "ppo": PPO_SUMMARY,
    }
    dirs = {"sft": sft, "reward": reward, "ppo": ppo}
    text = report.pipeline_report(tmp_path, dirs, summaries, 275.0, skipped={"sft"})
    lines = text.splitlines()
    assert lines[0] == f"rlhf: step=all (sft -> reward -> ppo) finished in 4 min 35 s: {tmp_path}"
    assert "  sft (done earlier)" in lines and "  reward (1 min 56 s)" in lines
    assert any("held-out perplexity" in ln and "9 -> 1.15 (-7.85)" in ln for ln in lines)
    assert "    ! reward: the reward model ranks held-out pairs near chance (0.52)" in lines
    assert f"  exports: {sft / 'model'}, {reward / 'model'}, {ppo / 'actor'}" in lines
    assert any(f"python -m rlhf.cli.chat --path {ppo / 'actor'}" in ln for ln in lines)
    assert any(f"python -m rlhf.cli.compare {tmp_path} OTHER_RUN" in ln for ln in lines)


@pytest.mark.slow
def test_a_short_step_all_ends_with_its_report(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    overrides = [
        "step=all",
        *FAST,
        "reward.gold_eval_prompts=8",
        "ppo.rollout.per_device_batch_size=8",
        "ppo.update.per_device_batch_size=8",
        "ppo.rollout.max_new_tokens=16",
        "ppo.eval.prompts=8",
        "step.max_steps=2",
        *cache_overrides(cache_dir),
    ]
    proc = run_rlhf(overrides, run_dir=run_dir)
    out = proc.stdout
    for step in ("sft", "reward", "ppo"):  # each step's own report, as it ends
        assert f"rlhf: step={step} finished in" in out
        assert (run_dir / step / "report.txt").read_text().startswith(f"rlhf: step={step}")
    ended = (run_dir / "report.txt").read_text()
    assert out.rstrip().endswith(ended.rstrip())  # the last thing the run prints
    lines = ended.splitlines()
    assert lines[0].startswith("rlhf: step=all (sft -> reward -> ppo) finished in")
    ppo = read_summary(run_dir / "ppo")
    before, after = ppo["initial/eval/gold_accuracy"], ppo["eval/gold_accuracy"]
    assert any(
        "gold accuracy, greedy" in ln and f"{report._show(before)} -> {report._show(after)}" in ln
        for ln in lines
    )
    accuracy = read_summary(run_dir / "reward")["eval/accuracy"]
    assert any("held-out pairs ranked right" in ln and report._show(accuracy) in ln for ln in lines)
    assert any(ln.startswith("  alarms") for ln in lines)
    exports = [run_dir / "sft" / "model", run_dir / "reward" / "model", run_dir / "ppo" / "actor"]
    assert all(str(p) in ended for p in exports)
    # the next command printed runs: chat with the trained actor
    [chat] = [ln.split("#")[0].split() for ln in lines if "rlhf.cli.chat" in ln]
    assert chat[:3] == ["python", "-m", "rlhf.cli.chat"] and chat[-1] == str(exports[-1])
    proc = subprocess.run(
        [sys.executable, *chat[1:], "--max-new-tokens", "4"],
        input="What is 2 + 3?\nquit\n",
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("Assistant:"), proc.stderr


@pytest.mark.parametrize(
    "name", ["plain-run", "run with spaces", "exécution àccentuée", "a,b=c's [x] $HOME"]
)
def test_next_commands_paste_back_to_the_paths(tmp_path, name):
    """Each command, split as a shell splits it (and its overrides parsed as Hydra parses
    them), names the very directories of the run, whatever characters they hold."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    run_dir = tmp_path / name
    cases = {
        "sft": [run_dir / "model"],
        "reward": [run_dir / "model"],
        "ppo": [run_dir / "actor", run_dir / "critic"],
    }
    parser = OverridesParser.create()
    for step, exports in cases.items():
        for command, _ in report.next_commands(step, run_dir, exports):
            words = shlex.split(command)
            if words[:3] == ["python", "-m", "rlhf.cli.chat"]:
                assert words[3:] == ["--path", str(exports[0])]
            elif words[:3] == ["python", "-m", "rlhf.cli.compare"]:
                assert words[3:] == [str(run_dir), "OTHER_RUN"]
            elif words[:3] == ["python", "-m", "rlhf.cli.evaluate"]:
                assert words[3:] == ["reward", "--path", str(exports[0]), "data=OTHER"]
            else:
                overrides = {o.key_or_group: o.value() for o in parser.parse_overrides(words[3:])}
                key = "model.path" if step == "sft" else "critic.model.path"
                assert overrides[key] == str(exports[0]), command


def test_next_commands_after_a_real_model_name_its_option(tmp_path):
    """Without model=, a pasted command would run the embedded model's tuning, which refuses a
    real model's export; the default run's commands stay as short as they were."""
    exports = {"sft": [tmp_path / "model"], "reward": [tmp_path / "model"]}
    for step, paths in exports.items():
        real = [c for c, _ in report.next_commands(step, tmp_path, paths, "opt-1.3b")]
        tiny = [c for c, _ in report.next_commands(step, tmp_path, paths)]
        trains = [c for c in real if c.startswith("python -m rlhf ")]
        assert trains and all(c.startswith("python -m rlhf model=opt-1.3b step=") for c in trains)
        assert not any("model=tiny" in c or " model=" in c for c in tiny), tiny


def test_a_ppo_report_says_where_an_iteration_went():
    parts = {"generate": 0.3, "score": 0.1, "update": 0.5, "sync": 0.0, "other": 0.1}
    summary = {**PPO_SUMMARY, **{f"perf/{name}_s": s for name, s in parts.items()}}
    rows = dict(report.headline_rows("ppo", summary))
    assert rows["time an iteration"] == (
        "1 s: generate 30%, score 10%, update 50%, sync 0%, other 10%"
    )
    assert "time an iteration" not in dict(report.headline_rows("ppo", PPO_SUMMARY))

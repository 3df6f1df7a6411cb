"""Mistakes Hydra answers with a traceback or a message without a way out, answered in one line
before anything runs: a YAML syntax error (file, line, the parser's message), a run directory
that is a file or cannot be made, a path the shell split at a space or an unquoted accent; and a
config error under torchrun printed once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf.checks.preflight import check_output_dir, check_override_syntax, check_yaml_files
from rlhf.config import ConfigError
from tests.conftest import REPO, run_rlhf

NO_TRACE = {"HYDRA_FULL_ERROR": "0"}


def test_a_yaml_syntax_error_names_the_file_the_line_and_the_parser_message(tmp_path):
    (tmp_path / "good.yaml").write_text("optim:\n  lr: 1e-3\n")
    (tmp_path / "myexp.yaml").write_text("defaults:\n  - config\noptim:\n  lr: [1e-3\n\n")
    with pytest.raises(ConfigError) as err:
        check_yaml_files([tmp_path])
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'myexp.yaml'}, line 6:"), message
    assert "while parsing a flow sequence (from line 4)" in message
    assert "expected ',' or ']'" in message
    check_yaml_files([tmp_path / "missing"])  # no directory, nothing to check


def test_the_shipped_config_files_parse():
    from rlhf.cli.help import CONF_DIR

    check_yaml_files([CONF_DIR, CONF_DIR.parent / "sweeps"])


def test_a_run_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    occupied = tmp_path / "occupied"
    occupied.write_text("a file")
    with pytest.raises(ConfigError, match="that is a file; expected a directory"):
        check_output_dir("hydra.run.dir", str(occupied))
    with pytest.raises(ConfigError, match=r"cannot make the directory \(Not a directory"):
        check_output_dir("hydra.run.dir", str(occupied / "run"))
    with pytest.raises(ConfigError, match="cannot make the directory"):
        check_output_dir("hydra.sweep.dir", "/proc/rlhf-no-such-dir/run")
    check_output_dir("hydra.run.dir", str(tmp_path / "new" / "run"))
    assert (tmp_path / "new" / "run").is_dir()
    check_output_dir("hydra.run.dir", "${oc.env:HOME}/x")  # left to Hydra
    assert not (tmp_path / "${oc.env:HOME}").exists()


def test_a_value_split_at_a_space_or_an_accent_gets_the_quoting_hint():
    with pytest.raises(ConfigError) as err:
        check_override_syntax(["data=local", "data.sources.local.path=/tmp/my", "data/x.jsonl"])
    assert "'data/x.jsonl' is not an override (key=value)" in str(err.value)
    assert "quote the whole override: 'data.sources.local.path=/tmp/my data/x.jsonl'" in str(
        err.value
    )
    with pytest.raises(ConfigError) as err:
        check_override_syntax(["data.sources.local.path=/tmp/donnée.jsonl"])
    assert "Hydra cannot parse it (token recognition error at: 'é')" in str(err.value)
    assert "quote the value inside the argument" in str(err.value)
    check_override_syntax(["data.sources.local.path='/tmp/my données/x.jsonl'", "a=1,2"])


@pytest.mark.parametrize(
    "args, expected",
    [
        (["-cd", "{tmp}", "-cn", "myexp"], "myexp.yaml, line 3: YAML syntax error"),
        (["hydra.run.dir={tmp}/myexp.yaml"], "that is a file; expected a directory"),
        (["data.sources.local.path=/tmp/ça.jsonl"], "quote the value inside the argument"),
        (["-m", "zero=stage2,stage3", "--cfg", "job"], "-m and --cfg together: Hydra takes one"),
    ],
)
def test_the_command_line_answers_in_one_line(tmp_path, args, expected):
    (tmp_path / "myexp.yaml").write_text("defaults:\n  - config\n optim: 1\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = run_rlhf(args, check=False, timeout=120, extra_env=NO_TRACE)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and expected in line, line


RENAMED = {
    "actor.twin_path": "actor.reference_path",
    "actor.offload_twin": "actor.offload_reference",
    "critic.twin_path": "critic.reward_model_path",
    "critic.offload_twin": "critic.offload_reward_model",
}


def test_a_renamed_key_names_its_new_name():
    from rlhf.config import RENAMED_KEYS, register_configs, unknown_key, unknown_keys
    from tests.conftest import compose

    register_configs()  # the schema compose() needs, when this file runs alone
    assert RENAMED.items() <= RENAMED_KEYS.items()  # PPO's: tests/test_ppo_keys.py
    for old, new in RENAMED.items():
        assert unknown_key(old) == f"no such key; renamed to {new}"
    # added with "++" the composition takes it: the validation refuses it
    assert unknown_keys(compose(["++actor.twin_path=/x"])) == [
        "actor.twin_path: no such key; renamed to actor.reference_path"
    ]


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["actor.twin_path=/x"],
            "actor.twin_path=/x: no such key; renamed to actor.reference_path",
        ),
        (
            ["+critic.offload_twin=true"],
            "+critic.offload_twin=true: no such key; renamed to critic.offload_reward_model",
        ),
        (
            ["-cd", "{tmp}", "-cn", "exp", "--cfg", "job"],
            "{tmp}/exp.yaml: actor.offload_twin: no such key; renamed to actor.offload_reference",
        ),
        (
            ["-cd", "{tmp}", "-cn", "axes", "-m"],
            "{tmp}/axes.yaml: hydra.sweeper.params.critic.twin_path: no such key; renamed to "
            "critic.reward_model_path",
        ),
    ],
    ids=["command-line", "added", "yaml", "sweep-axis"],
)
def test_a_renamed_key_is_refused_in_one_line_naming_the_new_key(tmp_path, args, expected):
    """The keys PPO's frozen models had before they were named for them (actor.twin_path ...):
    on the command line, in a config file and as a sweep's axis, refused before anything runs."""
    config = "defaults:\n  - config\n  - _self_\n"
    (tmp_path / "exp.yaml").write_text(config + "actor:\n  offload_twin: true\n")
    axes = "hydra:\n  sweeper:\n    params:\n      critic.twin_path: a,b\n"
    (tmp_path / "axes.yaml").write_text(config + axes)
    args = [a.replace("{tmp}", str(tmp_path)) for a in ["step=ppo", *args]]
    proc = run_rlhf(args, check=False, timeout=120, extra_env=NO_TRACE)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line == "error: " + expected.replace("{tmp}", str(tmp_path)), line


def test_a_broken_yaml_file_blocks_only_the_commands_that_compose_it(tmp_path):
    """The pre-flight checks the files Hydra reads, as it reads them: a broken experiment
    beside the one asked for blocks nothing; asked for, it is one line."""
    (tmp_path / "good.yaml").write_text("defaults:\n  - config\n  - _self_\noptim:\n  lr: 0.007\n")
    (tmp_path / "broken.yaml").write_text("defaults:\n  - config\n optim: 1\n")
    good = run_rlhf(["-cd", str(tmp_path), "-cn", "good", "--cfg", "job"], check=False)
    assert good.returncode == 0, good.stderr[-2000:]
    assert "lr: 0.007" in good.stdout
    broken = run_rlhf(
        ["-cd", str(tmp_path), "-cn", "broken", "--cfg", "job"], check=False, extra_env=NO_TRACE
    )
    assert broken.returncode == 2
    [line] = broken.stderr.strip().splitlines()
    assert line.startswith(f"error: {tmp_path / 'broken.yaml'}, line 3: YAML syntax error")


def test_a_run_dir_a_config_file_sets_that_cannot_be_made_is_one_line(tmp_path):
    """hydra.run.dir from a file, not the command line: Hydra makes it before rlhf runs."""
    experiment = "defaults:\n  - config\n  - _self_\nhydra:\n  run:\n    dir: /proc/rlhf-no/run\n"
    (tmp_path / "ro.yaml").write_text(experiment)
    proc = run_rlhf(
        ["-cd", str(tmp_path), "-cn", "ro", "step=sft"], check=False, extra_env=NO_TRACE
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: hydra.run.dir=/proc/rlhf-no/run: cannot make the directory")
    assert line.endswith("choose another hydra.run.dir")


def _existing_unwritable_dir(tmp_path) -> str:
    """A directory that exists and refuses new files: a chmod 555 one, except for root, whom
    permissions do not stop (sysfs refuses a new file to everyone)."""
    if os.geteuid() == 0:
        return "/sys/kernel"
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    return str(read_only)


def test_an_existing_read_only_run_dir_a_config_file_sets_is_one_line(tmp_path):
    """It exists, so Hydra makes nothing, and the first write there (Hydra's log file, or the
    run's lock once the log opens lazily) answered with a traceback of 20-32 lines."""
    run_dir = _existing_unwritable_dir(tmp_path)
    experiment = f"defaults:\n  - config\n  - _self_\nhydra:\n  run:\n    dir: {run_dir}\n"
    (tmp_path / "ro.yaml").write_text(experiment)
    proc = run_rlhf(
        ["-cd", str(tmp_path), "-cn", "ro", "step=sft"], check=False, extra_env=NO_TRACE
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line == (
        f"error: hydra.run.dir={run_dir}: the directory is not writable (Permission denied); "
        "choose another hydra.run.dir"
    )


def test_an_outputs_file_in_the_working_directory_is_one_line(tmp_path):
    (tmp_path / "outputs").write_text("not a directory")
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf", "step.max_steps=1"],
        cwd=tmp_path,
        env={**os.environ, **NO_TRACE, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line == (
        f"error: {tmp_path / 'outputs'} is a file: runs go under ./outputs/ by default; move it, "
        "or give hydra.run.dir=DIR (hydra.sweep.dir=DIR with -m)"
    )


STAGE_5 = "zero.stage=5: expected one of 0, 1, 2, 3"


def test_a_config_error_leaves_its_message_in_torchruns_error_file(tmp_path):
    """torchrun answers a rank's non-zero exit with its own traceback and failure report,
    whatever the rank does; the rank's error file (TORCHELASTIC_ERROR_FILE) is what that
    report shows as the failure's "traceback". Read back with torch's own reader."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    proc = run_rlhf(
        ["zero.stage=5"],
        run_dir=tmp_path / "run",
        check=False,
        extra_env={**NO_TRACE, "TORCHELASTIC_ERROR_FILE": str(error_file)},
    )
    assert proc.returncode == 2 and STAGE_5 in proc.stderr, proc.stderr[-2000:]
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    report = ChildFailedError("rlhf", {0: failure}).format_msg()
    root_cause = report[report.index("Root Cause") :]
    assert "traceback : error: invalid configuration:" in root_cause, report
    assert STAGE_5 in root_cause and "To enable traceback" not in report


@pytest.mark.slow
def test_a_config_error_under_torchrun_is_printed_once(tmp_path, cache_dir):
    """Rank 0 prints the one error line; torchrun's own report follows (its traceback cannot be
    avoided from a rank) and ends with the same message as the root cause."""
    proc = run_rlhf(
        ["zero.stage=5", f"cache_dir={cache_dir}"],
        run_dir=tmp_path / "run",
        nproc=2,
        check=False,
        timeout=600,
        extra_env=NO_TRACE,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: invalid configuration:"], proc.stderr
    root_cause = proc.stderr[proc.stderr.index("Root Cause (first observed failure):") :]
    assert "traceback : error: invalid configuration:" in root_cause, proc.stderr
    assert STAGE_5 in root_cause and "To enable traceback" not in proc.stderr

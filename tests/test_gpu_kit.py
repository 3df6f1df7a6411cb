"""The GPU kit (scripts/gpu_kit.sh): the wheels a bare device lacks, under the 64 MiB a device
call carries, installed offline by the kit's run.sh into a folder that the check then imports
from. Built here for this Python (a lent device's is 3.12); the full rehearsal, torch 2.11 and
transformers 5.17 with the check's --tiny rows, is in docs/ppo.md. Marker slow: it downloads
and builds the wheels (about 20 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON_VERSION = "{}.{}".format(*sys.version_info[:2])

pytestmark = pytest.mark.slow

# stands in for tests/gpu/check.py in a bare checkout: says where the kit's packages came from
WHERE = """
import sys, deepspeed, hydra, omegaconf, datasets, pydantic, rlhf
for module in (deepspeed, hydra, omegaconf, datasets, pydantic, rlhf):
    print(module.__name__, module.__file__)
print("args", *sys.argv[1:])
"""


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    kit = tmp_path_factory.mktemp("kit") / "kit"
    env = {**os.environ, "PYTHON": sys.executable, "RLHF_KIT_PYTHON": PYTHON_VERSION}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_kit.sh"), str(kit)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return kit


def run_kit(kit: Path, cwd: Path, target: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "RLHF_KIT_TARGET": str(target)}
    return subprocess.run(
        ["bash", str(kit / "run.sh"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_kit_carries_what_a_device_lacks_under_64_mib(kit):
    size = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file())
    assert size <= 64 * 2**20, f"{size / 2**20:.1f} MiB"
    pins = dict(line.split("==") for line in (kit / "requirements.txt").read_text().split())
    for name in ("deepspeed", "hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets"):
        assert name in pins
    assert pins["rlhf"] == "0.1.0"
    # what the device has is not carried: torch alone would be GBs
    assert not {"torch", "transformers", "numpy", "vllm", "wandb"} & set(pins)
    assert (kit / "python-version").read_text().strip() == PYTHON_VERSION
    assert os.access(kit / "run.sh", os.X_OK)


def test_run_installs_offline_into_its_folder_and_runs_the_check(kit, tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "tests" / "gpu").mkdir(parents=True)
    (checkout / "tests" / "gpu" / "check.py").write_text(WHERE)
    target = tmp_path / "site"
    proc = run_kit(kit, checkout, target, "--tiny", "--out", "x")
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    for module in ("deepspeed", "hydra", "omegaconf", "datasets", "pydantic", "rlhf"):
        assert where[module].startswith(str(target)), (module, where[module])
    assert where["args"] == "--tiny --out x"


def test_run_refuses_a_python_the_wheels_are_not_for(kit, tmp_path):
    other = tmp_path / "kit"
    subprocess.run(["cp", "-r", str(kit), str(other)], check=True)
    (other / "python-version").write_text("3.99\n")
    proc = run_kit(other, REPO, tmp_path / "site")
    assert proc.returncode == 2
    assert f"wheels for Python 3.99, {sys.executable} is {PYTHON_VERSION}" in proc.stderr
    assert not (tmp_path / "site").exists()


def test_run_refuses_outside_a_checkout(kit, tmp_path):
    proc = run_kit(kit, tmp_path, tmp_path / "site")
    assert proc.returncode == 2
    assert "no tests/gpu/check.py" in proc.stderr


def test_the_builder_never_empties_a_folder_that_is_not_a_kit(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_kit.sh"), str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "is not a GPU kit" in proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"

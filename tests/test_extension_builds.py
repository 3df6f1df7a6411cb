"""DeepSpeed's JIT-built ops (CPU Adam, the CPU collectives) go to a folder of each environment's
own: torch's default is one per Python version and device, so two virtual environments on one
machine (vLLM's and the plain one) rebuilt each other's ops, a minute each time they alternated.
A TORCH_EXTENSIONS_DIR the user set is kept."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from rlhf.runtime import engine


@pytest.fixture
def no_user_folder(tmp_path, monkeypatch) -> Path:
    """No TORCH_EXTENSIONS_DIR, and torch's default root under ``tmp_path`` (XDG_CACHE_HOME):
    what a user who never heard of either gets."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")  # restored (or removed) after the test
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "torch_extensions"


def test_two_environments_build_in_two_folders(no_user_folder, monkeypatch):
    here = engine.environment_build_root()
    assert here.parent == no_user_folder
    assert f"torch{torch.__version__.replace('+', '_')}" in here.name
    assert engine.environment_build_root() == here  # the same environment: the same folder
    monkeypatch.setattr(sys, "prefix", str(no_user_folder.parent / "venv-vllm"))
    other = engine.environment_build_root()
    assert other.parent == no_user_folder and other != here
    assert other.name.startswith("venv-vllm-")
    monkeypatch.setattr(torch, "__version__", "9.9.9+cpu")  # a new torch in that environment
    assert engine.environment_build_root() not in (here, other)


def test_the_build_folders_and_the_first_build_note_are_the_environments(no_user_folder, caplog):
    from deepspeed.git_version_info import installed_ops

    adam = engine.cpu_adam_build_dir()
    assert adam == engine.environment_build_root() / "cpu_adam"
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(adam.parent)  # torch's builds too
    collectives = engine.shm_comm_build_dir()
    assert collectives is None or collectives.parent == adam.parent
    if installed_ops.get(engine.CPU_ADAM):
        return  # built with DeepSpeed: no note to print
    with caplog.at_level(logging.INFO, logger="rlhf.runtime.engine"):
        engine.announce_cpu_adam_build()
    assert f"building DeepSpeed's CPU Adam, first time only (about a minute) in {adam}" in (
        caplog.text
    )


def test_a_folder_the_user_set_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert engine.cpu_adam_build_dir() == tmp_path / "mine" / "cpu_adam"
    engine.device_type("cpu")
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine")

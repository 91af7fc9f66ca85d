#!/usr/bin/env bash
# Runs the test suite with the GPU machine's releases (torch 2.11, fbgemm 1.6, torchrec 1.6.1) on
# this machine, in a second environment that setup_env.sh builds once (.venv-gpu-versions/ at the
# project root; EMBBENCH_VENV=DIR puts it elsewhere). Extra arguments go to pytest:
#     scripts/test_gpu_versions.sh [tests/test_freqcache.py -x ...]
# Run it before every submission that touches a GPU path: an API that the newer releases of .venv/
# have and the GPU machine's lack fails here, not in a lent GPU's quarter-hour.
# PyPI's torch 2.11 is a CUDA build (with its nvidia-* wheels, about 3 GB); it runs on a CPU, and
# setup_env.sh pairs it with fbgemm-gpu-cpu where no NVIDIA driver is present.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EMBBENCH_VENV:-$root/.venv-gpu-versions}"
EMBBENCH_VENV="$venv" EMBBENCH_TORCH=torch==2.11.0 "$root/scripts/setup_env.sh"
# torch 2.11's triton 3.6 runs the row-copy kernel on a CPU (tests/test_row_copy.py) only with
# numpy < 2.4 (triton-lang/triton#9171).
"$venv/bin/python" -m pip install -q "numpy<2.4" 2>&1 | { grep -v "is ignored" || true; } >&2
cd "$root"
"$venv/bin/python" -c "from importlib.metadata import version as v; import fbgemm_gpu
print(f'test_gpu_versions: torch {v(\"torch\")}, fbgemm_gpu {fbgemm_gpu.__version__}, torchrec {v(\"torchrec\")}')"
exec "$venv/bin/python" -m pytest -q "$@"

#!/usr/bin/env bash
# Creates (or refreshes) the project-local environment .venv/ at the project root
# (EMBBENCH_VENV=DIR builds it elsewhere, e.g. a second environment with other versions):
#   1. torch, installed first and never replaced (EMBBENCH_TORCH picks the spec);
#   2. the fbgemm release paired with that torch: fbgemm-gpu where an NVIDIA driver is present
#      (libnvidia-ml.so.1 loads, or nvidia-smi lists a GPU), fbgemm-gpu-cpu where none is. Not
#      torch's build: PyPI's torch 2.11 is a CUDA build, and the CUDA fbgemm it would pull
#      fails to import without the driver's libnvidia-ml.so.1;
#   3. torchrec of the same release, --no-deps so that it cannot pull the CUDA fbgemm;
#   4. embbench itself (editable) with its remaining dependencies and the test tools, and the
#      example strategy plugin examples/embbench-plugin-example (editable: the tests run it).
# Each step prints a line saying what it installs; pip's own download lines follow.
# Idempotent: a stamp skips the work when nothing that shapes the environment changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EMBBENCH_VENV:-$root/.venv}"
torch_spec="${EMBBENCH_TORCH:-torch==2.13.0}"
python="${PYTHON:-python3}"

has_nvidia_driver() {
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then return 0; fi
    "$python" -c "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')" >/dev/null 2>&1
}
if has_nvidia_driver; then fbgemm=fbgemm-gpu; driver="an NVIDIA driver"; else fbgemm=fbgemm-gpu-cpu; driver="no NVIDIA driver"; fi

stamp_file="$venv/.embbench-setup"
example_plugin="$root/examples/embbench-plugin-example"
stamp="$(cat "$root/pyproject.toml" "$example_plugin/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1) $torch_spec $fbgemm"
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ]; then
    exit 0
fi

steps=7  # tests/test_small_things.py checks that the steps below are 1..7, each once
step() { echo "setup_env: [$1/$steps] $2" >&2; }
# pip with its download lines (what it fetches, and how big), without the lines that say nothing.
pip_shown() {
    set +e
    "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar on "$@" 2>&1 \
        | grep --line-buffered -v -e "^Requirement already satisfied" -e "is ignored" -e "^  Using cached" \
              -e "dependency resolver does not" -e "torchrec .* requires fbgemm-gpu" >&2
    local status=${PIPESTATUS[0]}
    set -e
    return "$status"
}

step 1 "the virtual environment $venv ($driver found: $fbgemm)"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    step 2 "installing $torch_spec (the largest download: about 0.2 GB for a CPU build, 1 GB or more with CUDA)"
    pip_shown "$torch_spec"
else
    step 2 "torch is installed: kept"
fi
# A torch that installs but does not import (a missing system library, a wheel for another CPU) is said so.
if ! torch_info="$("$venv/bin/python" -c \
        "import torch; print(torch.__version__.split('+')[0], 'cuda' if torch.version.cuda else 'cpu')" 2>"$venv/torch-import.log")" \
        || [ -z "$torch_info" ]; then
    echo "setup_env: $torch_spec is installed in $venv but does not import; its error (also in $venv/torch-import.log):" >&2
    tail -n 5 "$venv/torch-import.log" >&2
    echo "setup_env: fix the cause, or set EMBBENCH_TORCH to another spec, or remove $venv, and run again" >&2
    exit 1
fi
read -r torch_version torch_flavour <<<"$torch_info"

# torch minor -> the fbgemm / torchrec release built against it.
case "${torch_version%.*}" in
    2.11) release=1.6 ;;
    2.12) release=1.7 ;;
    2.13) release=1.8 ;;
    2.14) release=1.9 ;;
    *) echo "setup_env: torch $torch_version is not supported; embbench pairs torch 2.11-2.14" \
            "with fbgemm 1.6-1.9. Set EMBBENCH_TORCH to a supported spec (e.g. torch==2.13.0)" \
            "or remove $venv and try again." >&2
       exit 2 ;;
esac

step 3 "installing $fbgemm $release.* for torch $torch_version ($torch_flavour build; $driver)"
pip_shown "$fbgemm==$release.*" "torch==$torch_version"
step 4 "installing torchrec $release.* (--no-deps: it cannot pull the CUDA fbgemm)"
pip_shown --no-deps "torchrec==$release.*"
# pip's resolver complains that torchrec wants fbgemm-gpu: fbgemm-gpu-cpu provides it on a CPU machine.
step 5 "installing embbench (editable) with its dependencies and the test tools"
pip_shown -e "$root[test]" "torch==$torch_version" "setuptools>=68"
# as a user installs a plugin; --no-deps --no-build-isolation: it needs nothing the step above did not bring
step 6 "installing the example plugin $example_plugin (editable)"
pip_shown --no-deps --no-build-isolation -e "$example_plugin"
# A CPU build of torch brings no triton: the tests run freqcache's Triton kernels in its interpreter.
if [ "$torch_flavour" = cpu ] && ! "$venv/bin/python" -c "import triton" 2>/dev/null; then
    step 7 "installing triton (about 0.3 GB): the tests run the Triton kernels in its interpreter"
    pip_shown "triton>=3.7" "torch==$torch_version"
else
    step 7 "triton is installed (a CUDA build of torch brings it): kept"
fi

"$venv/bin/python" -c "import torch, fbgemm_gpu, torchrec, embbench, hot_copy_example, rich, yaml, pydantic, pytest, hypothesis, pytest_benchmark, selenium" \
    || { echo "setup_env: the environment does not import; see the errors above" >&2; exit 1; }
echo "$stamp" > "$stamp_file"
echo "setup_env: done: $venv (torch $torch_version, $fbgemm $release.*, torchrec $release.*)" >&2

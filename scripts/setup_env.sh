#!/usr/bin/env bash
# Creates (or refreshes) the project-local environment .venv/ at the project root:
#   1. torch, installed first and never replaced (EMBBENCH_TORCH picks the spec);
#   2. the fbgemm release paired with that torch: fbgemm-gpu where torch has CUDA,
#      fbgemm-gpu-cpu where it has not;
#   3. torchrec of the same release, --no-deps so that it cannot pull the CUDA fbgemm;
#   4. embbench itself (editable) with its remaining dependencies and the test tools.
# Idempotent: a stamp skips the work when nothing that shapes the environment changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
torch_spec="${EMBBENCH_TORCH:-torch==2.13.0}"
python="${PYTHON:-python3}"

stamp_file="$venv/.embbench-setup"
stamp="$(cat "$root/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1) $torch_spec"
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ]; then
    exit 0
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip_checked() { "$venv/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "setup_env: installing $torch_spec" >&2
    pip_checked "$torch_spec" 2> >(grep -v "is ignored" >&2)
fi
read -r torch_version torch_flavour < <("$venv/bin/python" -c \
    "import torch; print(torch.__version__.split('+')[0], 'cuda' if torch.version.cuda else 'cpu')" 2>/dev/null)

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
if [ "$torch_flavour" = cuda ]; then fbgemm=fbgemm-gpu; else fbgemm=fbgemm-gpu-cpu; fi

echo "setup_env: torch $torch_version ($torch_flavour) -> $fbgemm $release.*, torchrec $release.*" >&2
pip_checked "$fbgemm==$release.*" "torch==$torch_version" 2> >(grep -v "is ignored" >&2)
pip_checked --no-deps "torchrec==$release.*" 2> >(grep -v "is ignored" >&2)
# pip's resolver complains that torchrec wants fbgemm-gpu: fbgemm-gpu-cpu provides it on a CPU machine.
pip_checked -e "$root[test]" "torch==$torch_version" 2>&1 \
    | grep -v -e "is ignored" -e "dependency resolver does not" -e "torchrec .* requires fbgemm-gpu" >&2 || true

"$venv/bin/python" -c "import torch, fbgemm_gpu, torchrec, embbench, rich, yaml, pydantic, pytest, hypothesis, pytest_benchmark, selenium" \
    || { echo "setup_env: the environment does not import; see the errors above" >&2; exit 1; }
echo "$stamp" > "$stamp_file"

#!/usr/bin/env bash
# A lent GPU's quarter-hour in two device calls (docs/gpu-matrix.md). On the GPU machine, from
# the project root, with the staged packages copied to /tmp/dw (../shared/device/README.md):
#     bash scripts/gpu_session.sh SECONDS --call 1    # at most 600 s: the headlines, the CUDA tests
#     bash scripts/gpu_session.sh SECONDS --call 2    # at once after it, on the warm machine
# It installs (the one sm_90 part, /tmp/dw/p0; the three parts, /tmp/dw/p2, as the fallback),
# then runs scripts/gpu_session.py: the call's items of the plan in order, each within its
# budget, each result archived into $OUT/session.tgz at once, never starting a cell whose
# estimate exceeds what is left; a ledger of seconds per phase ends it ($OUT/ledger-call<N>.txt).
#     bash scripts/gpu_session.sh --rehearse [SECONDS] --call all   # both calls on the CPU, tiny
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
started=$(date +%s)
# the project's environment where it exists (the rehearsal here); the GPU machine has none
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=${PYTHON:-python3}; fi
export OUT=${OUT:-/tmp/gpu_session_out}
# Compilation is paid once per shape on this machine: every cell's processes share inductor's cache.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/embbench-inductor}
mkdir -p "$OUT"

if [ "${1:-}" = "--rehearse" ]; then
    shift
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    exec "$python" scripts/gpu_session.py "${1:-100}" --rehearse --install-note "skipped (rehearsal)" "${@:2}"
fi
seconds=${1:?usage: bash scripts/gpu_session.sh SECONDS_LEFT | --rehearse [SECONDS]}
shift

install_note="failed: no staged part in /tmp/dw (../shared/device/README.md)"
if PYTHONPATH=/tmp/site "$python" -c "import fbgemm_gpu, torchrec" 2>/dev/null; then
    install_note="already installed in /tmp/site"
else
    for part in p0 p2; do  # the one sm_90 part, then the three parts
        [ -f /tmp/dw/$part/install.sh ] || continue
        if timeout 120 bash /tmp/dw/$part/install.sh > "$OUT/install-$part.txt" 2>&1 \
                && PYTHONPATH=/tmp/site "$python" -c "import fbgemm_gpu, torchrec" 2>/dev/null; then
            install_note="ok (/tmp/dw/$part): $(grep -h -e '^torch ' -e 'kernels ran' "$OUT/install-$part.txt" | tr '\n' ' ')"
            break
        fi
        install_note="failed (/tmp/dw/$part): $(tail -n 3 "$OUT/install-$part.txt" | tr '\n' ' ')"
    done
fi
echo "install: $install_note" >&2
# The checkout first (its code, as committed here), then what install.sh put in /tmp/site.
export PYTHONPATH="$PWD:/tmp/site" PATH="/tmp/site/bin:$PATH"
exec "$python" scripts/gpu_session.py "$seconds" --spent $(( $(date +%s) - started )) --install-note "$install_note" "$@"

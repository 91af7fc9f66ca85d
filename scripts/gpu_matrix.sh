#!/usr/bin/env bash
# Issue 25's GPU matrix, one scenario per shape (docs/gpu-matrix.md), on the GPU machine of
# ../shared/device/README.md after /tmp/dw/p0..p2 were copied there:
#     bash scripts/gpu_matrix.sh NAME [embbench run options]
# NAME is one of scenarios/gpu_matrix/*.yaml without .yaml (kaggle_alpha1.15, kaggle_alpha1.05,
# criteo_1tb_dim64, criteo_1tb_dim128). A scenario takes longer than one device call (10 min):
# run the same command again and it resumes. Records of earlier calls, unpacked into
# results/gpu-matrix/NAME/ of the checkout (which travels with every call), are put back into
# /tmp/runs/NAME first, so a fresh machine resumes too; scripts/device_run.sh archives the run
# into $OUT/NAME.tgz every 15 s, so a call cut off at its limit still returns every finished cell.
set -uo pipefail
name=${1:?usage: bash scripts/gpu_matrix.sh NAME [embbench run options]}; shift
scenario=scenarios/gpu_matrix/$name.yaml
if [ ! -f "$scenario" ]; then
  echo "error: $scenario: no such scenario (one of: $(cd scenarios/gpu_matrix && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' '))" >&2
  exit 2
fi
if [ -d "results/gpu-matrix/$name" ] && [ ! -d "/tmp/runs/$name" ]; then
  mkdir -p /tmp/runs && cp -r "results/gpu-matrix/$name" "/tmp/runs/$name"
fi
exec bash scripts/device_run.sh "$name" "$scenario" "$@"

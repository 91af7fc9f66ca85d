#!/usr/bin/env bash
# On the GPU machine (../shared/device/README.md), after /tmp/dw/p0..p2 were copied there:
#     bash scripts/device_run.sh RUNDIR SCENARIO [embbench run options]
# Installs fbgemm/torchrec/this checkout into /tmp/site once (again when the checkout changed),
# runs the scenario into /tmp/runs/RUNDIR and archives that directory into $OUT every 15 s,
# so a call that times out still returns every finished cell.
set -uo pipefail
name=$1; shift
if [ ! -d /tmp/site/fbgemm_gpu ]; then bash /tmp/dw/p2/install.sh; else
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site --upgrade . 2>&1 | grep -v WARNING; fi
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
mkdir -p /tmp/runs/$name
archive() { tar -C /tmp/runs --exclude=weights -czf "$OUT/$name.tgz" "$name" 2>/dev/null; }
( while sleep 15; do archive; done ) & ticker=$!
python3 -m embbench.cli run "$@" --out /tmp/runs/$name --resume 2>&1 | grep -v -e 'Could not load' -e '^\s*$' > /tmp/runs/$name/console.txt
rc=${PIPESTATUS[0]}
python3 -m embbench.cli show /tmp/runs/$name --wide > /tmp/runs/$name/show.txt 2>&1
kill $ticker; archive; tail -c 3000 /tmp/runs/$name/console.txt; cat /tmp/runs/$name/show.txt; exit $rc

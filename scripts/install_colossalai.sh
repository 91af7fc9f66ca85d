#!/usr/bin/env bash
# The published ColossalAI 0.5.0 cache (CachedParamMgr) for tests/test_colossalai_published.py,
# installed into a side directory so that its torch <= 2.5.1 pin never touches the project's
# environment (docs/colossalai-reference.md):
#     bash scripts/install_colossalai.sh [DIR] [PYTHON]      (default /tmp/colossalai-side, .venv/bin/python)
#     PYTHONPATH=$PWD:DIR .venv/bin/python -m pytest tests/test_colossalai_published.py
# Everything goes in with --no-deps at the versions colossalai 0.5.0 declares (the pyproject
# extra `colossalai` lists the same imports); about 400 MB.
set -euo pipefail
dir=${1:-/tmp/colossalai-side}
python=${2:-.venv/bin/python}
"$python" -m pip install -q --no-deps --target "$dir" colossalai==0.5.0 psutil contexttimer einops safetensors \
  "transformers==4.51.3" "huggingface-hub==0.30.2" "tokenizers>=0.21,<0.22" regex "peft==0.13.2" \
  "accelerate==1.0.1" galore-torch "bitsandbytes==0.45.5" requests urllib3 idna certifi charset-normalizer
PYTHONPATH="$dir" "$python" -c "from colossalai.legacy.nn.parallel.layers.cache_embedding.cache_mgr import CachedParamMgr; print('colossalai', CachedParamMgr.__module__, 'imports')"

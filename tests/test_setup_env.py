"""scripts/setup_env.sh chooses fbgemm's flavour by whether an NVIDIA driver is present, not by
torch's build, and says what each step installs (a stand-in venv python records the pip calls:
nothing is downloaded)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_FAKE_PYTHON = """#!/bin/bash
if [ "$1" = "-c" ]; then
  case "$2" in *"import torch;"*) echo "2.11.0 cuda";; esac
  exit 0
fi
echo "$*" >> "$(dirname "$0")/../pip-calls"
echo "Requirement already satisfied: something"
echo "Downloading a-wheel.whl (10 MB)"
"""


def _setup(tmp_path: Path, driver: bool) -> tuple[str, list[str]]:
    venv, tools = tmp_path / "venv", tmp_path / "tools"
    (venv / "bin").mkdir(parents=True)
    tools.mkdir()
    (venv / "bin" / "python").write_text(_FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    if driver:
        (tools / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n")
        (tools / "nvidia-smi").chmod(0o755)
    path = f"{tools}:/usr/bin:/bin"  # no real nvidia-smi; python3 for the libnvidia-ml check
    env = {**os.environ, "PATH": path, "EMBBENCH_VENV": str(venv), "EMBBENCH_TORCH": "torch==2.11.0"}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stderr, (venv / "pip-calls").read_text().splitlines()


def _has_libnvidia_ml() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_a_cuda_torch_without_a_driver_gets_the_cpu_fbgemm(tmp_path):
    if _has_libnvidia_ml():
        import pytest

        pytest.skip("this machine has an NVIDIA driver")
    log, calls = _setup(tmp_path, driver=False)
    assert any("fbgemm-gpu-cpu==1.6.*" in c for c in calls), calls
    assert "no NVIDIA driver" in log


def test_a_driver_gets_the_cuda_fbgemm_and_each_step_says_what_it_installs(tmp_path):
    log, calls = _setup(tmp_path, driver=True)
    assert any("fbgemm-gpu==1.6.*" in c for c in calls) and not any("fbgemm-gpu-cpu" in c for c in calls), calls
    for step in ("[1/7]", "[2/7] torch is installed", "[3/7] installing fbgemm-gpu 1.6.*", "[4/7] installing torchrec 1.6.*",
                 "[5/7] installing embbench", "[7/7] triton is installed"):
        assert step in log, log
    assert "Downloading a-wheel.whl (10 MB)" in log and "Requirement already satisfied" not in log


def test_the_example_plugin_is_installed_editable_as_a_user_installs_one(tmp_path):
    log, calls = _setup(tmp_path, driver=False)
    example = ROOT / "examples" / "embbench-plugin-example"
    assert any(c.endswith(f"--no-deps --no-build-isolation -e {example}") for c in calls), calls
    assert f"[6/7] installing the example plugin {example}" in log

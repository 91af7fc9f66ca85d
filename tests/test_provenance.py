"""Provenance: the commit even from an installed copy, the toolchain and devices from torch's
collect_env, the packages a result depends on."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embbench import buildinfo
from embbench.provenance import code_version, provenance

ROOT = Path(__file__).resolve().parent.parent
needs_git = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


@needs_git
def test_a_record_names_the_commit_toolchain_devices_and_packages():
    p = provenance()
    assert p["git"]["commit"] == _head() and p["git"]["source"] == "checkout"
    assert set(p["versions"]) >= {"python", "torch", "cuda", "nvidia_driver", "torchrec", "fbgemm_gpu", "embbench"}
    assert p["versions"]["torch"] == torch.__version__ and p["versions"]["cuda"] == torch.version.cuda
    # PyPI's CUDA wheels leave torch's local tag (+cu130) out of the metadata that packages reads.
    assert p["packages"]["torch"].split("+")[0] == torch.__version__.split("+")[0] and "embbench" in p["packages"]
    assert all(name.startswith(("torch", "fbgemm", "triton", "numpy", "pydantic", "tensordict", "embbench", "nvidia-"))
               for name in p["packages"])
    assert isinstance(p["devices"]["cpu"], str) and p["devices"]["cpu"]
    assert p["devices"]["gpus"] == [] if not torch.cuda.is_available() else p["devices"]["gpus"][0]["memory_bytes"] > 0
    json.dumps(p)  # it goes into a JSON record


@needs_git
def test_a_built_package_carries_the_commit_it_was_built_from(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "lib")], cwd=ROOT, check=True,
                   capture_output=True)
    package = tmp_path / "lib" / "embbench"
    assert (package / "results.py").is_file()
    found = code_version(package, {"url": f"file://{ROOT}", "dir_info": {}})  # as `pip install .` leaves it
    assert found["commit"] == _head() and found["source"] == "recorded at build"


def test_without_a_checkout_or_a_record_the_commit_is_unknown_with_the_reason(tmp_path):
    package = tmp_path / "site" / "embbench"
    package.mkdir(parents=True)
    none = code_version(package, None)
    assert none["commit"] is None and "neither a git checkout nor a package built" in none["reason"]
    local = code_version(package, {"url": "file:///src/embbench", "dir_info": {}})
    assert local["commit"] is None and "file:///src/embbench" in local["reason"]
    vcs = code_version(package, {"url": "https://example.org/embbench.git",
                                 "vcs_info": {"vcs": "git", "commit_id": "ab" * 20, "requested_revision": "main"}})
    assert vcs["commit"] == "ab" * 20 and vcs["branch"] == "main" and "git install" in vcs["source"]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_package_inside_another_repository_does_not_take_its_commit(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "venv" / "site").mkdir(parents=True)
    assert buildinfo.from_checkout(tmp_path / "venv" / "site") is None
    assert buildinfo.from_checkout(tmp_path) is not None


def test_a_copy_without_git_records_the_commit_its_builder_names(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBBENCH_GIT_COMMIT", "cd" * 20)
    assert buildinfo.at_build(tmp_path)["commit"] == "cd" * 20
    monkeypatch.delenv("EMBBENCH_GIT_COMMIT")
    assert buildinfo.at_build(tmp_path) is None

"""``ssd_tbe``, fbgemm's SSD TBE: where fbgemm's SSD operators are missing (its public wheels) a
cell is recorded ``unsupported`` naming them and why; its parameters are validated; it is listed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from baselines.ssd_tbe import SSD_CLASSES, SSD_OPERATORS, SsdTbeStrategy, missing_ssd_operators
from baselines.torchrec_tables import fbgemm_package
from embbench.launch import outcome_without_launch
from embbench.scenario import Cell, ScenarioError, load_scenario, parse_scenario
from embbench.strategy import RuntimeEnv
from tests.conftest import tiny_scenario

ROOT = Path(__file__).resolve().parent.parent


def _registered() -> list[str]:
    """The SSD operators and classes this fbgemm_gpu registers, found without baselines.ssd_tbe."""
    import fbgemm_gpu.tbe.ssd  # noqa: F401

    found = [f"torch.ops.fbgemm.{op}" for op in SSD_OPERATORS if hasattr(torch.ops.fbgemm, op)]
    for name in SSD_CLASSES:
        try:
            getattr(torch.classes.fbgemm, name)
            found.append(f"torch.classes.fbgemm.{name}")
        except RuntimeError:
            pass
    return found


@pytest.fixture
def public_wheel():
    """fbgemm_gpu as PyPI ships it: none of the SSD operators registered."""
    if _registered():
        pytest.skip(f"this fbgemm_gpu registers SSD operators ({', '.join(_registered())}): not a public wheel")


def test_on_a_public_wheel_the_cell_is_unsupported_naming_the_missing_operators(public_wheel):
    expected = (f"{fbgemm_package()} has no SSD TBE operators ("
                + ", ".join([f"torch.ops.fbgemm.{op}" for op in SSD_OPERATORS]
                            + [f"torch.classes.fbgemm.{name}" for name in SSD_CLASSES])
                + "): fbgemm's public wheels are built without them (FBGEMM #5666); it runs on a build of "
                  "fbgemm_gpu with them, on CUDA")
    assert len(missing_ssd_operators()) == len(SSD_OPERATORS) + len(SSD_CLASSES)
    for device in ("cpu", "cuda"):  # missing operators are the reason on a GPU machine as well
        assert SsdTbeStrategy().unsupported_reason(RuntimeEnv(torch.device(device))) == expected
    scenario, _ = parse_scenario(tiny_scenario(strategies=[{"name": "device"}, {"name": "ssd_tbe"}]), "test")
    outcome = outcome_without_launch(scenario, Cell("ssd_tbe", {}))
    assert (outcome.status, outcome.message) == ("unsupported", expected)


def test_with_the_operators_but_no_cuda_it_says_cuda(monkeypatch):
    import baselines.ssd_tbe as ssd_tbe

    monkeypatch.setattr(ssd_tbe, "missing_ssd_operators", lambda: ())
    assert SsdTbeStrategy().unsupported_reason(RuntimeEnv(torch.device("cpu"))) == \
        "needs CUDA (fbgemm's SSD TBE has no CPU kernels)"
    assert SsdTbeStrategy().unsupported_reason(RuntimeEnv(torch.device("cuda"))) is None


def _load_with(tmp_path: Path, params: dict):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tiny_scenario(strategies=[{"name": "device"}, {"name": "ssd_tbe", "params": params}])))
    return path, load_scenario(path)


@pytest.mark.parametrize("params, message", [
    ({"store_dir": "/no/such/folder"}, "strategies[1].params.store_dir: /no/such/folder: no such folder"),
    ({"cache_ratio": 0}, "strategies[1].params.cache_ratio"),
    ({"cache_ratio": 1.5}, "strategies[1].params.cache_ratio"),
    ({"rocksdb_shards": 0}, "strategies[1].params.rocksdb_shards"),
    ({"store": "file"}, "strategies[1].params.store: unknown parameter of ssd_tbe"),
])
def test_bad_parameters_name_the_file_and_the_key(tmp_path, params, message):
    with pytest.raises(ScenarioError) as err:
        _load_with(tmp_path, params)
    assert str(tmp_path / "s.yaml") in str(err.value) and message in str(err.value)


def test_a_store_dir_that_is_a_file_is_refused_and_a_folder_is_kept(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ScenarioError, match="a-file: no such folder"):
        _load_with(tmp_path, {"store_dir": str(tmp_path / "a-file")})
    _, (_, cells) = _load_with(tmp_path, {"store_dir": str(tmp_path), "cache_ratio": [0.01, 0.05]})
    assert [c.params for c in cells if c.strategy == "ssd_tbe"] == [
        {"store_dir": str(tmp_path), "cache_ratio": 0.01}, {"store_dir": str(tmp_path), "cache_ratio": 0.05}]


def test_the_dry_run_estimate_counts_the_cache_and_the_adagrad_state():
    from embbench.data.presets import TableSpec
    from embbench.optim import EmbeddingOptimizer

    tables = [TableSpec("t0", 6400, 16, 1, 1.1), TableSpec("t1", 3200, 16, 1, 1.1)]
    estimate = SsdTbeStrategy(SsdTbeStrategy.Params(cache_ratio=0.01)).estimate_memory(
        tables, EmbeddingOptimizer(type="rowwise_adagrad"), 1)
    assert estimate.device_bytes == 96 * 16 * 4 + 9600 * 4  # 96 rows: 3 whole sets of 32; one float a row
    assert estimate.host_bytes == 0


@pytest.mark.slow
def test_strategies_lists_it_with_why_it_does_not_run_here(public_wheel):
    env = {**os.environ, "COLUMNS": "300"}
    proc = subprocess.run([sys.executable, "-m", "embbench.cli", "strategies"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if "ssd_tbe" in line]
    assert "fbgemm's SSD TBE" in line and "no: " in line and "has no SSD TBE operators" in line
    assert "cache_ratio: float = 0.015" in proc.stdout and "store_dir: str | None = None" in proc.stdout

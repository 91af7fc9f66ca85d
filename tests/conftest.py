"""Shared helpers: tiny scenarios, an in-process training run, a plugin installed on the fly."""

from __future__ import annotations

import copy
import ctypes
import os
import textwrap
from pathlib import Path


def _has_cuda_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


# Without a GPU, Triton runs only in its interpreter; it must be chosen before triton is first
# imported (its library functions, tl.sum among them, are built then), so before torch.
if not _has_cuda_driver():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from embbench.runner import run_cell
from embbench.scenario import Cell, parse_scenario
from embbench.strategy import RuntimeEnv, load_strategies

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _the_fast_tier_compiles_nothing(request):
    """A graph compiled from a cold cache takes tens of seconds on 2 cores (inductor): a test that
    compiles one belongs to the slow tier, and is told so here rather than found by its time."""
    from torch._dynamo.utils import counters
    before = counters["stats"]["unique_graphs"]
    yield
    compiled = counters["stats"]["unique_graphs"] - before
    if compiled and request.node.get_closest_marker("slow") is None:
        pytest.fail(f"{request.node.nodeid} compiled {compiled} graph(s) with torch.compile but is not marked "
                    "slow: the fast tier compiles nothing (mark it @pytest.mark.slow)", pytrace=False)

TINY = {
    "name": "tiny",
    "data": {"preset": "criteo_kaggle", "scale": 0.0002, "embedding_dim": 8, "batch_size": 64},
    "model": {"bottom_mlp": [16, 8], "top_mlp": [16, 1]},
    "optimizer": {"embedding": {"type": "rowwise_adagrad", "lr": 0.1}, "dense": {"type": "sgd", "lr": 0.1}},
    # warm-up: exactly warmup_steps (fast; a test about warm-up sets its own bound)
    "run": {"device": "cpu", "warmup_steps": 1, "warmup_max_steps": None, "steps": 3, "repeats": 2, "eval_batches": 1,
            "time_limit_s": 600},
    "baseline": "device",
    "strategies": [{"name": "device"}, {"name": "cpu"}],
}


def tiny_scenario(**overrides) -> dict:
    """TINY with nested overrides: ``tiny_scenario(run={"steps": 5})``."""
    raw = copy.deepcopy(TINY)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key].update(value)
        else:
            raw[key] = value
    return raw


def train_and_flush(raw: dict, strategy: str, params: dict | None = None, tmp_path: Path | None = None,
                    world_size: int = 1, row_precision: str = "fp32") -> tuple[list[torch.Tensor], dict]:
    """Run one cell in this process; return its flushed tables and its metrics."""
    scenario, _ = parse_scenario(raw, "test")
    weights = (tmp_path or Path("/tmp")) / f"w-{strategy}-{row_precision}-{abs(hash(str(params)))}.pt"
    cell = Cell(strategy, params or {}, world_size, row_precision)
    metrics = run_cell(scenario, cell, RuntimeEnv(torch.device("cpu")), weights)
    return torch.load(weights), metrics


def _install_plugin(site: Path, name: str, entry_points: dict[str, str], source: str, monkeypatch) -> None:
    """A package with ``embbench.strategies`` entry points (a dist-info on the path), as a
    third party installs one, visible to this process and the ones it starts."""
    import os

    info = site / f"{name}-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[embbench.strategies]\n{lines}")
    (site / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    load_strategies.cache_clear()


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """Test-only strategies that fail: one raises while building, one never finishes."""
    _install_plugin(tmp_path / "site", "faulty_plugin",
                    {"raises": "faulty_plugin:Raises", "sleeps": "faulty_plugin:Sleeps"}, """
        import time
        from embbench.strategy import Strategy

        class Raises(Strategy):
            name = "raises"
            summary = "raises while building"
            def build(self, ctx):
                raise RuntimeError("boom from the faulty plugin")

        class Sleeps(Strategy):
            name = "sleeps"
            summary = "never finishes building"
            def build(self, ctx):
                time.sleep(3600)
        """, monkeypatch)
    yield
    load_strategies.cache_clear()


@pytest.fixture
def rank_plugin(tmp_path, monkeypatch):
    """Strategies that fail on rank 1 only, while the other ranks wait in a collective: one
    raises, one's process ends abruptly."""
    _install_plugin(tmp_path / "ranksite", "rank_plugin",
                    {"rank1_raises": "rank_plugin:Rank1Raises", "rank1_dies": "rank_plugin:Rank1Dies"}, """
        import os
        from baselines.tables import DeviceStrategy

        class Rank1Raises(DeviceStrategy):
            name = "rank1_raises"
            summary = "fails on rank 1 while the others wait in a collective"
            def build(self, ctx):
                if ctx.env.rank == 1:
                    raise RuntimeError("rank 1 gives up")
                return super().build(ctx)

        class Rank1Dies(DeviceStrategy):
            name = "rank1_dies"
            summary = "rank 1's process ends abruptly while building"
            def build(self, ctx):
                if ctx.env.rank == 1:
                    os._exit(9)
                return super().build(ctx)
        """, monkeypatch)
    yield
    load_strategies.cache_clear()

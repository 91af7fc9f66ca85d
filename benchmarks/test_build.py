"""Build time of a placement's tables at a tenth of the Criteo-Kaggle shape (3.38M rows, dim
128, rowwise Adagrad): nearly all of it filling the initial weights.

    .venv/bin/python -m pytest benchmarks/test_build.py -s --benchmark-columns=median

Each build runs once (``-s`` prints wall and CPU seconds). ``freqcache`` is built without a
profile (``profile_batches: 0``) so that only its tables are timed. On a GPU machine the
device placements build on the GPU; the CUDA-only ones are skipped on a CPU. Not part of the
test suite: speed is measured here, never asserted.
"""

import time

import pytest
import torch

from embbench.data import make_tables
from embbench.data.weights import initial_weights
from embbench.optim import EmbeddingOptimizer
from embbench.scenario import Cell
from embbench.strategy import BuildContext, RuntimeEnv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SCALE = 0.1


@pytest.mark.parametrize("strategy,params", [("device", {}), ("cpu", {}), ("freqcache", {"profile_batches": 0}),
                                             ("gpu_sharded", {}), ("uvm", {}), ("uvm_cache", {})],
                         ids=["device", "cpu", "freqcache", "gpu_sharded", "uvm", "uvm_cache"])
def test_build(benchmark, strategy, params):
    tables = make_tables("criteo_kaggle", dim=128, scale=SCALE)
    env = RuntimeEnv(DEVICE)
    made = Cell(strategy, params).make_strategy()
    reason = made.unsupported_reason(env)
    if reason:
        pytest.skip(reason)
    ctx = BuildContext(tables=tables, env=env, optimizer=EmbeddingOptimizer(), local_batch_size=16384,
                       init_weights=lambda t, a, b: initial_weights(tables[t], t, 0, a, b),
                       train_batches=lambda n: iter(()), warmup_steps=0)
    if strategy in ("gpu_sharded", "uvm", "uvm_cache") and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    module = benchmark.pedantic(lambda: made.build(ctx), rounds=1, iterations=1)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    rows = sum(t.num_rows for t in tables)
    benchmark.extra_info.update(rows=rows, wall_s=wall, cpu_s=cpu)
    print(f"\n{strategy}: {rows / 1e6:.2f}M rows built in {wall:.1f} s ({cpu:.1f} CPU-s, "
          f"{cpu / (rows / 1e6):.2f} CPU-s per million rows)")
    del module

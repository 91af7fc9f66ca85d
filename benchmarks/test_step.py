"""Micro-benchmarks of one training step of the sparse part (lookup, backward, update).

    .venv/bin/python -m pytest benchmarks --benchmark-columns=median,iqr,ops

Not part of the test suite (``testpaths`` is tests/): speed is measured here, never asserted.
Criteo-Kaggle-shaped tables scaled to fit a small machine; the ids are Zipf(1.15) like the
scenarios'. On a GPU machine the same code measures the device path.
"""

import pytest
import torch

from embbench.data import Stream, SyntheticCriteo, make_tables
from embbench.optim import EmbeddingOptimizer
from embbench.data.weights import initial_weights
from embbench.strategy import BuildContext, RuntimeEnv, get_strategy

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TABLES = make_tables("criteo_kaggle", dim=64, scale=0.01)  # 337k rows
BATCH = 4096
CASES = [("device", {}), ("cpu", {})] + [
    ("freqcache", {"cache_ratio": r, "prefetch": p}) for r in (0.005, 0.015, 0.05) for p in (False, True)
]


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("name, params", CASES, ids=[f"{n}-{p}" if p else n for n, p in CASES])
def test_sparse_step(benchmark, name, params):
    data = SyntheticCriteo(TABLES, seed=0, device=DEVICE)
    batches = [data.batch(Stream.TRAIN, i, BATCH).sparse for i in range(64)]
    ctx = BuildContext(
        tables=TABLES, env=RuntimeEnv(DEVICE), optimizer=EmbeddingOptimizer(), local_batch_size=BATCH,
        init_weights=lambda t, a, b: initial_weights(TABLES[t], t, 0, a, b),
        train_batches=lambda n: (data.batch(Stream.TRAIN, i, BATCH) for i in range(n)),
    )
    strategy = get_strategy(name)
    module = strategy(strategy.Params(**params)).build(ctx)
    grad = torch.randn(BATCH, len(TABLES) * TABLES[0].dim, device=DEVICE)
    state = {"i": 0}

    def step():
        i = state["i"]
        state["i"] += 1
        out = module(batches[i % 64])
        module.prefetch(batches[(i + 1) % 64])
        (out * grad).sum().backward()
        _sync()

    for _ in range(5):  # warm-up, not measured
        step()
    benchmark.pedantic(step, rounds=30, iterations=1)
    counters = module.counters()
    if counters.get("accesses") and "hits" in counters:
        benchmark.extra_info["hit_rate"] = counters["hits"] / counters["accesses"]

"""Micro-benchmark of the synthetic data generator: one Criteo-Kaggle batch of 16384.

    .venv/bin/python -m pytest benchmarks/test_generator.py --benchmark-columns=median,iqr,ops

Samples per second are ``16384 * ops``. On a GPU machine it generates on the device, as a run
does. Not part of the test suite: speed is measured here, never asserted.
"""

import pytest
import torch

from embbench.data import Stream, SyntheticCriteo, make_tables

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BATCH = 16384


@pytest.mark.parametrize("drift", [{}, {"drift_every": 10, "drift_fraction": 0.1}], ids=["plain", "drift"])
def test_generator_batch(benchmark, drift):
    data = SyntheticCriteo(make_tables("criteo_kaggle", 128), seed=0, device=DEVICE, **drift)
    state = {"i": 0}

    def batch():
        data.batch(Stream.TRAIN, state["i"], BATCH)
        state["i"] += 1
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):  # warm-up, not measured
        batch()
    benchmark.pedantic(batch, rounds=20, iterations=1)
    benchmark.extra_info["samples_per_s"] = BATCH / benchmark.stats.stats.median

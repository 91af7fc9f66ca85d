"""The ecosystem baselines: torchrec's sharded tables on CPU against the device reference
(several processes: test_multiprocess.py), and fbgemm's UVM strategies' mapping without CUDA."""

import pytest
import torch
from pydantic import ValidationError

from baselines.torchrec_tables import (FBGEMM_CACHE_ASSOC, UvmCacheParams, UvmCacheStrategy, UvmStrategy,
                                       counters_from_uvm_cache_stats, fbgemm_cache_rows)
from embbench.strategy import COUNTERS, RuntimeEnv
from tests.conftest import tiny_scenario, train_and_flush

CPU = RuntimeEnv(torch.device("cpu"))


@pytest.mark.parametrize("opt_type", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_gpu_sharded_one_process_equals_device(tmp_path, opt_type, sharding):
    raw = tiny_scenario(optimizer={"embedding": {"type": opt_type, "lr": 0.1}})
    reference, ref_metrics = train_and_flush(raw, "device", tmp_path=tmp_path)
    weights, metrics = train_and_flush(raw, "gpu_sharded", {"sharding": sharding}, tmp_path=tmp_path)
    for a, b in zip(weights, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert metrics["accuracy"]["logloss"] == pytest.approx(ref_metrics["accuracy"]["logloss"], rel=1e-4)
    assert metrics["memory"]["static_device_bytes"] >= sum(w.numel() * 4 for w in weights)


def test_uvm_strategies_say_why_they_cannot_run_without_cuda():
    assert UvmStrategy().unsupported_reason(CPU) == "needs CUDA (fbgemm's unified-memory kernels)"
    assert "needs CUDA" in UvmCacheStrategy().unsupported_reason(CPU)
    assert "TrainPipelinePrefetch" in UvmCacheStrategy(UvmCacheParams(prefetch_pipeline=True)).unsupported_reason(CPU)


@pytest.mark.parametrize("bad", [{"cache_ratio": 0}, {"cache_ratio": 1.01}, {"algorithm": "fifo"}, {"ratio": 0.1}])
def test_uvm_cache_rejects_bad_parameters(bad):
    with pytest.raises(ValidationError):
        UvmCacheParams(**bad)


def test_fbgemm_cache_holds_whole_sets():
    assert fbgemm_cache_rows(0.015, 1_000_000) == 15_008  # 469 sets of 32, rounded up from 15,000
    assert fbgemm_cache_rows(1e-9, 10) == FBGEMM_CACHE_ASSOC
    assert fbgemm_cache_rows(0.5, 64) % FBGEMM_CACHE_ASSOC == 0


def test_fbgemm_uvm_cache_stats_map_onto_embbench_counters():
    # calls, requested, unique, unique misses, conflict unique misses, conflict misses
    counters = counters_from_uvm_cache_stats([3, 1000, 400, 50, 10, 12], row_bytes=516)
    assert set(counters) <= set(COUNTERS)
    assert counters == {"accesses": 1000, "unique_accesses": 400, "unique_misses": 50, "rows_admitted": 40,
                        "bytes_h2d": 50 * 516}

"""freqcache's row moves with the Triton kernel that skips padded entries
(embbench/cache/row_copy.py) against its torch moves, padded to spare rows: the same tables
after training, in every row precision. On a CPU the kernel runs in Triton's interpreter
(TRITON_INTERPRET=1), where triton is installed; on CUDA, compiled (the GPU session's tests)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from importlib import metadata

import numpy as np
import pytest
import torch
from packaging.version import Version

from embbench.cache import FreqCache, FreqCacheParams, row_copy
from embbench.data import SparseFeatures, TableSpec
from embbench.optim import EmbeddingOptimizer
from embbench.strategy import RuntimeEnv
from tests.test_freqcache import _context, _train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (it comes with torch's CUDA builds)")


@pytest.fixture(params=["cpu", "cuda"])
def device(request, monkeypatch):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if request.param == "cpu" and Version(metadata.version("triton")) < Version("3.7") and Version(np.__version__) >= Version("2.4"):
        pytest.skip("Triton's interpreter before 3.7 reads a loop bound given as a kernel argument with int() of a 1-element "
                    "array, which numpy >= 2.4 refuses (triton-lang/triton#9171); with numpy < 2.4 it runs")
    if request.param == "cpu":  # the kernel in Triton's interpreter, built afresh under it
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(row_copy, "_kernel", None)
        monkeypatch.setattr(row_copy, "triton_problem", lambda device: None)
    yield torch.device(request.param)
    monkeypatch.setattr(row_copy, "_kernel", None)


def test_copy_rows_skips_padded_entries_and_copies_the_rest(device):
    host = torch.randn(50, 11, device=device)
    weights, extras = torch.zeros(20, 8, device=device), torch.full((20, 3), 7.0, device=device)
    rows = torch.tensor([3, -1, 7, 49, -1, 0, 12], device=device)
    slots = torch.tensor([0, 4, 5, 19, -1, 2, -1], device=device)  # -1 on either side: nothing moves
    row_copy.copy_rows(row_copy.words(weights), slots, row_copy.words(host), rows, width=8)
    row_copy.copy_rows(row_copy.words(extras), slots, row_copy.words(host), rows, src_col=8)
    moved = {0: 3, 5: 7, 19: 49, 2: 0}
    for slot in range(20):
        if slot in moved:
            assert torch.equal(weights[slot], host[moved[slot], :8]) and torch.equal(extras[slot], host[moved[slot], 8:])
        else:
            assert not weights[slot].any() and (extras[slot] == 7).all(), slot


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "fp8"])
def test_freqcache_with_the_kernel_s_moves_trains_like_with_torch_s(device, precision, monkeypatch):
    tables = [TableSpec("t0", 300, 8, 2, 1.1), TableSpec("t1", 40, 8, 1, 1.1)]
    g = torch.Generator().manual_seed(3)
    batches = [SparseFeatures(torch.cat([torch.randint(0, 300, (16,), generator=g), torch.randint(0, 40, (8,), generator=g)]),
                              torch.tensor([2] * 8 + [1] * 8), 2) for _ in range(12)]
    opt = EmbeddingOptimizer(type="rowwise_adagrad", lr=0.2)
    params = FreqCacheParams(cache_ratio=0.05, lookahead=2, profile_batches=2, cuda_graph=False, compile=False)

    def trained(kernel: bool):
        ctx = replace(_context(tables, opt, batches), env=RuntimeEnv(device), row_precision=precision)
        cache = FreqCache(ctx, params)
        cache._triton_moves = kernel
        outputs = _train(cache, [b.to(device) for b in batches], prefetch=True, lookahead=cache.lookahead)
        return outputs, cache.flush(), cache

    got, got_tables, cache = trained(True)
    expected, expected_tables, _ = trained(False)
    assert cache.extra_metrics()["cache_moves"].startswith("triton")
    assert cache.counters()["bytes_h2d"] > 0 and cache.counters()["bytes_d2h"] > 0  # rows went both ways
    for a, b in zip(got + got_tables, expected + expected_tables):
        assert torch.equal(a, b)

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


@pytest.mark.parametrize("late_part", [False, True])
def test_a_move_copies_only_the_live_entries_of_its_part_in_both_directions(device, late_part):
    """Entries past ``live``, of the other part, or padded (sink slot, dummy row) move nothing;
    the rest copy a packed host row (weights' words, then extras') to or from a slot."""
    sink, pad = 19, 49
    host = torch.randn(50, 11, device=device)
    weights, extras = torch.zeros(20, 8, device=device), torch.full((20, 3), 7.0, device=device)
    slots = torch.tensor([0, 4, 5, sink, 3, 2, 6, 8, 9], device=device)
    rows = torch.tensor([3, pad, 7, 40, 1, 0, 12, 13, 14], device=device)
    late = torch.tensor([False, False, True, False, False, True, False, True, False], device=device)
    live = torch.tensor(7, device=device)  # entries 7 and 8: past the plan's candidates
    words = row_copy.words
    row_copy.move_rows(words(host), words(weights), words(extras), slots, rows, late, live, sink=sink, pad=pad,
                       late_part=late_part, to_host=False)
    moved = {5: 7, 2: 0} if late_part else {0: 3, 3: 1, 6: 12}
    for slot in range(20):
        if slot in moved:
            assert torch.equal(weights[slot], host[moved[slot], :8]) and torch.equal(extras[slot], host[moved[slot], 8:])
        else:
            assert not weights[slot].any() and (extras[slot] == 7).all(), slot
    before = host.clone()
    weights.fill_(3.0)
    row_copy.move_rows(words(host), words(weights), words(extras), slots, rows, late, live, sink=sink, pad=pad,
                       late_part=late_part, to_host=True)
    for row in range(50):
        slot = next((s for s, r in moved.items() if r == row), None)
        if slot is None:
            assert torch.equal(host[row], before[row]), row
        else:
            assert (host[row, :8] == 3.0).all() and torch.equal(host[row, 8:], extras[slot])


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "fp8"])
@pytest.mark.slow
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


def test_a_step_launches_one_move_per_direction_and_part_sized_by_its_live_rows(device, monkeypatch):
    """Issue 42, item 7: the early and the late moves launch once per direction each (4 a step,
    not 8), on a grid bounded by _PROGRAMS whatever the padding; each program loops over the
    live entries, so three programs train what torch's padded copies train."""
    tables = [TableSpec("t0", 3000, 8, 2, 1.1)]
    g = torch.Generator().manual_seed(5)
    batches = [SparseFeatures(torch.randint(0, 3000, (512,), generator=g), torch.full((256,), 2), 1).to(device)
               for _ in range(6)]
    ctx = replace(_context(tables, EmbeddingOptimizer(type="sgd", lr=0.1), batches), env=RuntimeEnv(device))
    params = FreqCacheParams(cache_ratio=0.05, lookahead=2, profile_batches=1, cuda_graph=False, compile=False,
                             belady_steps=0)
    monkeypatch.setattr(row_copy, "_PROGRAMS", 3)
    kernel = row_copy._triton_kernel()
    grids = []

    class Counting:
        def __getitem__(self, grid):
            grids.append(grid[0])
            return kernel[grid]

    def trained(triton: bool):
        cache = FreqCache(ctx, params)
        cache._triton_moves = triton
        return _train(cache, batches, prefetch=True, lookahead=2), cache.flush(), cache.counters()

    monkeypatch.setattr(row_copy, "_kernel", Counting())
    got = trained(True)
    expected = trained(False)
    steps = len(batches)
    assert set(grids) == {3} and steps * 2 <= len(grids) <= steps * 4, grids  # <= 2 parts x 2 directions a step
    assert got[2]["unique_misses"] > steps * 3 * row_copy._ROWS  # a plan loads more rows than one sweep of the grid
    for a, b in zip(got[0] + got[1], expected[0] + expected[1], strict=True):
        assert torch.equal(a, b)

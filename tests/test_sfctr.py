"""sfctr: the host-planned MixCache trains exactly what ``device`` trains at every pipeline
depth, evicts only slots no batch in flight uses, and says clearly when a batch cannot fit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from baselines.sfctr import MixCache, SfctrParams
from baselines.tables import WholeTables
from embbench.data.batch import SparseFeatures
from embbench.data.presets import TableSpec
from embbench.optim import EmbeddingOptimizer
from embbench.runner import run_cell
from embbench.scenario import Cell, parse_scenario
from embbench.strategy import BuildContext, RuntimeEnv
from tests.conftest import tiny_scenario

CPU = RuntimeEnv(torch.device("cpu"))
ROWS = 30


def _context(tables: int = 2) -> BuildContext:
    specs = [TableSpec(f"t{i}", ROWS, 4, 2, 1.0) for i in range(tables)]
    weights = torch.randn(tables, ROWS, 4, generator=torch.Generator().manual_seed(0))
    return BuildContext(tables=specs, env=CPU, optimizer=EmbeddingOptimizer(type="rowwise_adagrad", lr=0.3),
                        local_batch_size=2, init_weights=lambda t, a, b: weights[t, a:b].clone(),
                        train_batches=lambda n: iter(()))


def _features(bags: list[list[list[int]]]) -> SparseFeatures:
    """bags[t][b]: the ids of sample b in table t."""
    values = [i for table in bags for bag in table for i in bag]
    lengths = [len(bag) for table in bags for bag in table]
    return SparseFeatures(torch.tensor(values, dtype=torch.long), torch.tensor(lengths, dtype=torch.long), len(bags))


def _drive(module, batches: list[SparseFeatures]) -> list[torch.Tensor]:
    """Train the batches as the runner does: lookahead, forward, prefetch of the next, backward."""
    outputs = []
    for i, features in enumerate(batches):
        ahead = batches[i + 1 : i + 1 + module.lookahead]
        if ahead:
            module.look_ahead(ahead)
        out = module(features)
        if i + 1 < len(batches):
            module.prefetch(batches[i + 1])
        scale = torch.arange(1, out.numel() + 1, dtype=out.dtype).view_as(out) / out.numel()
        (out * scale).sum().backward()
        module.after_backward()
        outputs.append(out.detach())
    return outputs


def _distinct(f: SparseFeatures, tables: int) -> int:
    return int(torch.unique(f.values + ROWS * f.table_of_each_id()).numel())


bags = st.lists(st.lists(st.integers(0, ROWS - 1), min_size=0, max_size=2), min_size=2, max_size=2)
streams = st.lists(st.lists(bags, min_size=2, max_size=2).map(_features), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(stream=streams, depth=st.integers(0, 4), policy=st.sampled_from(["lru", "lfu"]), slack=st.integers(0, 3))
def test_every_depth_trains_the_weights_device_trains(stream, depth, policy, slack):
    # A cache just large enough for the batches in flight (the training one and those planned
    # ahead): rows are evicted and re-admitted within the pipeline window all the time.
    widest = max(1, max(_distinct(f, 2) for f in stream))
    capacity = min(2 * ROWS, (depth + 1) * widest + slack)
    cache = MixCache(_context(), SfctrParams(cache_ratio=capacity / (2 * ROWS), pipeline_depth=depth, policy=policy))
    reference = WholeTables(_context())
    for got, want in zip(_drive(cache, stream), _drive(reference, stream)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for got, want in zip(cache.flush(), reference.flush()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    c = cache.counters()
    assert c["hits"] + c["misses"] == c["accesses"] == sum(f.values.numel() for f in stream)
    assert c["rows_admitted"] - c["rows_evicted"] <= cache.capacity
    assert (cache.pins == 0).all()  # flush released every batch


def test_golden_lru_and_lfu_traces():
    def one_hot(*rows):
        return [_features([[[r]], [[]]]) for r in rows]

    # capacity 2, planned inline: a b a c -> c evicts b under lru (a was used after b)
    lru = MixCache(_context(), SfctrParams(cache_ratio=2 / 60, pipeline_depth=0, policy="lru"))
    _drive(lru, one_hot(0, 1, 0, 2, 1))
    c = lru.counters()
    assert (c["hits"], c["misses"], c["rows_evicted"]) == (1, 4, 2)  # 1 evicted by 2, then 0 by 1
    assert sorted(lru.row_of_slot.tolist()) == [1, 2] and c["pipeline_stalls"] == 5
    # lfu: a a b c -> c evicts b (counted once) rather than a (twice), then b evicts c
    lfu = MixCache(_context(), SfctrParams(cache_ratio=2 / 60, pipeline_depth=0, policy="lfu"))
    _drive(lfu, one_hot(0, 0, 1, 2, 1))
    c = lfu.counters()
    assert (c["hits"], c["misses"], c["rows_evicted"]) == (1, 4, 2)
    assert sorted(lfu.row_of_slot.tolist()) == [0, 1]


def test_a_batch_larger_than_the_cache_names_both_numbers():
    cache = MixCache(_context(), SfctrParams(cache_ratio=3 / 60, pipeline_depth=0))
    with pytest.raises(ValueError, match="needs 4 distinct rows but the cache holds 3 rows"):
        _drive(cache, [_features([[[0, 1], [2]], [[3], []]])])
    piped = MixCache(_context(), SfctrParams(cache_ratio=4 / 60, pipeline_depth=2))
    with pytest.raises(ValueError, match="not in use by the batches in flight"):
        _drive(piped, [_features([[[0, 1], [2]], [[b], []]]) for b in range(3, 6)])


@pytest.mark.parametrize("depth", [0, 3])
def test_sfctr_in_a_run_equals_device_and_reports_its_pipeline(tmp_path, depth):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "sfctr"}])
    scenario, _ = parse_scenario(raw, "t")
    params = {"cache_ratio": 0.3, "pipeline_depth": depth}
    metrics = run_cell(scenario, Cell("sfctr", params), CPU, tmp_path / "sfctr.pt")
    run_cell(scenario, Cell("device"), CPU, tmp_path / "device.pt")
    for a, b in zip(torch.load(tmp_path / "sfctr.pt"), torch.load(tmp_path / "device.pt")):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    c = metrics["counters"]["total"]
    assert c["host_plan_us"] > 0 and c["rows_admitted"] > 0
    if depth == 0:
        first, end = metrics["counters"]["steps"]  # the counted steps
        assert c["pipeline_stalls"] == end - first
    assert metrics["extra"]["pipeline_depth"] == depth

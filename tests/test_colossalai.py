"""The published ColossalAI cache as a reference: golden traces worked out by hand for both
eviction policies, exact training with ``optimizer_state: row``, the slot-bound optimizer
state's effect, host synchronisations per batch, and a too-small cache failing its cell."""

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from baselines.colossalai import CacheTooSmall, ColossalAICache, ColossalAIParams, ColossalAIStrategy
from baselines.tables import WholeTables
from embbench.data import Batch, SparseFeatures, TableSpec
from embbench.embedding import RowSpace
from embbench.launch import run_cells
from embbench.optim import EmbeddingOptimizer
from embbench.data.weights import initial_weights
from embbench.scenario import parse_scenario
from embbench.strategy import BuildContext, RuntimeEnv
from tests.conftest import tiny_scenario, train_and_flush
from tests.test_freqcache import _train, streams  # the random id streams and training loop freqcache is tested with

SGD = EmbeddingOptimizer(type="sgd", lr=0.1)
TRACED = ("hits", "misses", "unique_misses", "rows_evicted", "rows_written_back", "host_syncs")


def _ids(*values: int) -> SparseFeatures:
    """One table, one id per sample."""
    return SparseFeatures(torch.tensor(values), torch.ones(len(values), dtype=torch.long), 1)


def _context(tables, opt, profile: list[SparseFeatures]) -> BuildContext:
    def train_batches(n):
        for f in profile[:n]:
            yield Batch(torch.zeros(f.batch_size, 13), f, torch.zeros(f.batch_size))

    return BuildContext(tables=tables, env=RuntimeEnv(torch.device("cpu")), optimizer=opt,
                        local_batch_size=1, init_weights=lambda t, a, b: initial_weights(tables[t], t, 0, a, b),
                        train_batches=train_batches)


def _cache(rows: int, opt=SGD, profile=(), **params) -> ColossalAICache:
    tables = [TableSpec("t0", rows, 4, 1, 1.0)]
    return ColossalAICache(_context(tables, opt, list(profile)), ColossalAIParams(profile_batches=len(profile), **params))


def _resident(cache: ColossalAICache) -> list[int | None]:
    """The id in each slot (None: free)."""
    id_of_host_row = torch.empty_like(cache.idx_map)
    id_of_host_row[cache.idx_map] = torch.arange(cache.num_rows)
    return [int(id_of_host_row[r]) if r >= 0 else None for r in cache.slot_row.tolist()]


def _trace(cache: ColossalAICache, batches) -> list[tuple]:
    """Train on each batch; per step, the change of the traced counters and the slots after it."""
    steps, before = [], cache.counters()
    for features in batches:
        cache(features).sum().backward()
        after = cache.counters()
        steps.append((tuple(after[k] - before[k] for k in TRACED), _resident(cache)))
        before = after
    return steps


# Profile: id 5 four times, id 2 three times, id 7 twice, id 0 once; ranks 5, 2, 7, 0, 1, 3, 4, 6.
PROFILE = [_ids(5, 5, 5, 5, 2, 2, 2, 7, 7, 0)]
STREAM = [_ids(5, 7, 7), _ids(0, 1, 3), _ids(5, 3, 6), _ids(2, 2, 2)]


def test_dataset_policy_golden_trace():
    """8 rows, 4 slots, warm-up ceil(4 x 0.5) = 2 rows: ids 5 and 2 (ranks 0 and 1)."""
    cache = _cache(8, profile=PROFILE, cache_ratio=0.5, warmup_ratio=0.5, evict_policy="dataset")
    assert _resident(cache) == [5, 2, None, None]
    #  (hits, misses, unique misses, evicted, written back, host syncs), slots after the step
    assert _trace(cache, STREAM) == [
        # 7 (rank 2) into the first free slot: sync, unique, mask, ids to host, free slots, one copy
        ((1, 2, 1, 0, 0, 6), [5, 2, 7, None]),
        # ranks 3, 4, 5 missing, one free slot: the two highest cached ranks (7: 2, 2: 1) go,
        # written back; the three admitted fill slots 1..3 in rank order (0, 1, 3);
        # + protected slots, their values (a mask), victims' rows to host, victims' data
        ((0, 3, 3, 2, 2, 10), [5, 0, 1, 3]),
        # 6 (rank 7) missing; 5 and 3 are this batch's, so 1 (rank 4) beats 0 (rank 3) as victim
        ((2, 1, 1, 1, 1, 10), [5, 0, 6, 3]),
        # 2 (rank 1) back: the highest rank now cached is 6 (rank 7)
        ((0, 3, 1, 1, 1, 10), [5, 0, 2, 3]),
    ]


def test_lfu_policy_golden_trace_counts_restart_on_admission():
    """Same stream, LFU: warm-up preloads the two highest counts with those counts (5: 4, 2: 3);
    an admitted row starts from its accesses in the batch; ties go to the lowest slot."""
    cache = _cache(8, profile=PROFILE, cache_ratio=0.5, warmup_ratio=0.5, evict_policy="lfu")
    assert _resident(cache) == [5, 2, None, None]
    assert cache.slot_count[:2].tolist() == [4, 3]
    assert _trace(cache, STREAM) == [
        ((1, 2, 1, 0, 0, 6), [5, 2, 7, None]),  # counts 5, 3, 2
        # evict the two lowest counts: 7 (2) and 2 (3), though 2 was preloaded as hot
        ((0, 3, 3, 2, 2, 9), [5, 0, 1, 3]),  # counts 5, 1, 1, 1 (no mask read: one sync less)
        # 5 and 3 protected; 0 and 1 tie at 1: the lower slot (0) goes
        ((2, 1, 1, 1, 1, 9), [5, 6, 1, 3]),  # counts 6, 1, 1, 2
        ((0, 3, 1, 1, 1, 9), [5, 2, 1, 3]),  # 6 and 1 tie: slot 1 goes; 2 comes back with 3, not 3 + 3
    ]
    assert cache.slot_count.tolist() == [6, 3, 1, 2]


def test_a_batch_without_misses_waits_four_times_and_a_staging_buffer_adds_a_wait_per_piece():
    cache = _cache(8, profile=PROFILE, cache_ratio=0.5, warmup_ratio=0.5)
    assert _trace(cache, [_ids(5, 2, 5)])[0][0] == (3, 0, 0, 0, 0, 4)
    staged = _cache(8, profile=PROFILE, cache_ratio=0.5, warmup_ratio=0.5, buffer_size=1)
    # the second step of the dataset trace: 2 evicted rows and 3 admitted rows, one copy each
    assert [step[0][-1] for step in _trace(staged, STREAM[:2])] == [6, 10 - 2 + 2 + 3]  # 1 + 1 copies -> 2 + 3


def test_every_evicted_row_is_written_back_even_unchanged():
    """Forward only (evaluation): nothing is updated, yet every victim is copied back; eval
    batches admit rows like training batches."""
    cache = _cache(8, profile=PROFILE, cache_ratio=0.25, warmup_ratio=1.0)
    with torch.no_grad():
        for features in ([_ids(0, 1), _ids(3, 4), _ids(0, 1)]):
            cache(features)
    counters = cache.counters()
    assert counters["rows_admitted"] == 6 and counters["rows_evicted"] == counters["rows_written_back"] == 6
    assert counters["bytes_d2h"] == 6 * 4 * 4 + (6 + 6) * 8  # rows, and the row indices read on the host


def test_a_batch_with_more_distinct_rows_than_the_cache_names_both_numbers():
    cache = _cache(10, cache_ratio=0.4)
    with pytest.raises(CacheTooSmall, match="needs 5 distinct rows but the cache holds 4"):
        cache(_ids(0, 1, 2, 3, 4, 4))
    cache(_ids(0, 1, 2, 3, 3))  # 4 distinct fit


def test_slot_bound_adagrad_state_is_inherited_by_the_next_occupant():
    """One slot. Step 1 trains id 0 (gradient 2: accumulator 4); step 2 admits id 1 into the
    same slot, which keeps the accumulator, so id 1 steps by lr * 1 / sqrt(4 + 1) instead of
    lr * 1 / sqrt(1); step 3 brings id 0 back onto 4 + 1 + 9 instead of its own 4 + 9."""
    opt = EmbeddingOptimizer(type="rowwise_adagrad", lr=0.5, eps=1e-8)
    grads = [2.0, 1.0, 3.0]
    batches = [_ids(0), _ids(1), _ids(0)]
    start = _cache(4, opt, cache_ratio=0.25, warmup_ratio=0.0).flush()[0]

    def run(optimizer_state):
        cache = _cache(4, opt, cache_ratio=0.25, warmup_ratio=0.0, optimizer_state=optimizer_state)
        for features, g in zip(batches, grads):
            (cache(features) * g).sum().backward()
        return cache, cache.flush()[0]

    slot, slot_weights = run("slot")
    row, row_weights = run("row")
    step = lambda g, acc: 0.5 * g / (acc**0.5 + 1e-8)  # noqa: E731
    expected_slot = start.clone()
    expected_slot[0] -= step(2, 4) + step(3, 4 + 1 + 9)
    expected_slot[1] -= step(1, 4 + 1)
    expected_row = start.clone()
    expected_row[0] -= step(2, 4) + step(3, 4 + 9)
    expected_row[1] -= step(1, 1)
    torch.testing.assert_close(slot_weights, expected_slot)
    torch.testing.assert_close(row_weights, expected_row)
    assert slot.extra_metrics()["admissions_inheriting_state"] == 2
    assert row.counters()["bytes_h2d"] == 3 * (4 + 1) * 4  # the state travels with the row


def _check_maps(cache: ColossalAICache) -> None:
    occupied = cache.slot_row >= 0
    rows = cache.slot_row[occupied]
    assert torch.equal(cache.row_slot[rows], torch.arange(cache.capacity)[occupied])
    assert int((cache.row_slot >= 0).sum()) == int(occupied.sum()) == cache.capacity - cache.free_slots


@settings(max_examples=80, deadline=None)
@given(stream=streams(), opt_type=st.sampled_from(["sgd", "rowwise_adagrad"]),
       policy=st.sampled_from(["dataset", "lfu"]), spare=st.sampled_from([0, 1, 3, 1000]),
       warmup=st.sampled_from([0.0, 0.7, 1.0]), buffer=st.sampled_from([0, 1, 3]), profile=st.integers(0, 2))
@pytest.mark.slow
def test_row_state_trains_exactly_like_whole_tables(stream, opt_type, policy, spare, warmup, buffer, profile):
    tables, batches = stream
    space = RowSpace(tables)
    needed = max(int(torch.unique(space.global_rows(b)).numel()) for b in batches)
    ratio = min(1.0, (needed + spare + 0.5) / space.num_rows)  # the cache holds the largest batch
    opt = EmbeddingOptimizer(type=opt_type, lr=0.2)
    reference = WholeTables(_context(tables, opt, batches))
    params = ColossalAIParams(cache_ratio=ratio, evict_policy=policy, optimizer_state="row", warmup_ratio=warmup,
                              buffer_size=buffer, profile_batches=profile)
    cache = ColossalAICache(_context(tables, opt, batches), params)
    for a, b in zip(_train(cache, batches, prefetch=True), _train(reference, batches, prefetch=False)):
        torch.testing.assert_close(a, b)
    _check_maps(cache)
    c = cache.counters()
    assert c["hits"] + c["misses"] == c["accesses"] == sum(b.values.numel() for b in batches)
    assert c["rows_evicted"] == c["rows_written_back"]
    assert c["rows_admitted"] - c["rows_evicted"] == cache.capacity - cache.free_slots - cache.preloaded
    for a, b in zip(cache.flush(), reference.flush()):
        torch.testing.assert_close(a, b)
    assert cache.free_slots == cache.capacity  # flushing empties the cache, as published


@pytest.mark.parametrize("opt_type", ["sgd", "rowwise_adagrad"])
def test_in_the_runner_row_state_matches_device_and_slot_state_does_not_under_adagrad(tmp_path, opt_type):
    raw = tiny_scenario(optimizer={"embedding": {"type": opt_type, "lr": 0.1}},
                        run={"warmup_steps": 2, "steps": 4, "repeats": 2})
    reference, _ = train_and_flush(raw, "device", tmp_path=tmp_path)
    params = {"cache_ratio": 0.1, "profile_batches": 2}
    row, metrics = train_and_flush(raw, "colossalai", {**params, "optimizer_state": "row"}, tmp_path=tmp_path)
    slot, _ = train_and_flush(raw, "colossalai", {**params, "optimizer_state": "slot"}, tmp_path=tmp_path)
    diff = lambda ws: max(float((a - b).abs().max()) for a, b in zip(ws, reference))  # noqa: E731
    assert diff(row) < 1e-6
    if opt_type == "sgd":
        assert diff(slot) < 1e-6  # no state: nothing to inherit
    else:
        assert diff(slot) > 1e-3
    per_step = metrics["counters"]["per_step"]
    assert per_step["rows_evicted"] > 0 and per_step["rows_written_back"] == per_step["rows_evicted"]
    assert 6 <= per_step["host_syncs"] <= 10  # every step misses; some evict


def test_estimate_equals_the_built_footprint():
    tables = [TableSpec("t0", 30, 4, 1, 1.0), TableSpec("t1", 70, 4, 1, 1.0)]
    opt = EmbeddingOptimizer(type="rowwise_adagrad")
    for params in (ColossalAIParams(cache_ratio=0.2), ColossalAIParams(evict_policy="lfu", optimizer_state="row")):
        built = ColossalAICache(_context(tables, opt, []), params).memory()
        assert ColossalAIStrategy(params).estimate_memory(tables, opt, 1) == built


@pytest.mark.parametrize("bad", [{"cache_ratio": 0}, {"cache_ratio": 1.5}, {"evict_policy": "lru"},
                                 {"optimizer_state": "moved"}, {"warmup_ratio": 1.2}, {"buffer_size": -1}])
def test_invalid_parameters_are_rejected(bad):
    with pytest.raises(ValidationError):
        ColossalAIParams(**bad)


@pytest.mark.slow
def test_a_too_small_cache_fails_its_cell_and_the_run_goes_on(tmp_path):
    """Through the launcher: the error is that cell's record; the next cell (on two ranks,
    table-wise) still runs and, with the state moving with its rows, trains like device."""
    raw = tiny_scenario(run={"world_size": [1, 2], "time_limit_s": 120}, strategies=[
        {"name": "device"}, {"name": "colossalai", "params": {"cache_ratio": [0.001, 0.3], "optimizer_state": "row"}}])
    scenario, cells = parse_scenario(raw, "reference.yaml")
    wanted = ["device@w1", "colossalai[cache_ratio=0.001,optimizer_state=row]@w1",
              "colossalai[cache_ratio=0.3,optimizer_state=row]@w2"]
    records = run_cells(scenario, "reference.yaml", [c for c in cells if c.id in wanted], tmp_path)
    status = {r.cell_id: r for r in records}
    small = status[wanted[1]]
    assert small.status == "error"
    assert re.search(r"CacheTooSmall: colossalai: a batch needs \d+ distinct rows but the cache holds 6 ", small.message)
    two = status[wanted[2]]
    assert two.status == "ok", two.message
    assert two.metrics["max_weight_diff_vs_baseline"] < 1e-5
    assert len(two.metrics["per_rank"]) == 2


def _published():
    for path in ("colossalai.legacy.nn.parallel.layers.cache_embedding", "colossalai.nn.parallel.layers.cache_embedding"):
        try:
            module = __import__(path, fromlist=["CachedParamMgr"])
            return module.CachedParamMgr, module.EvictionStrategy
        except ImportError:
            continue
    return None


@pytest.mark.skipif(_published() is None or not torch.cuda.is_available(), reason="needs the colossalai package and CUDA")
def test_the_reference_follows_the_published_manager():
    """Same stream, profile without ties, dataset policy: the same misses and the same rows
    in the same slots after every batch."""
    CachedParamMgr, EvictionStrategy = _published()
    g = torch.Generator().manual_seed(0)
    rows, capacity = 200, 40
    counts = torch.randperm(rows, generator=g) + 1  # no two rows equally frequent
    profile_ids = torch.repeat_interleave(torch.arange(rows), counts)
    batches = [torch.randint(0, rows, (30,), generator=g) for _ in range(20)]
    mgr = CachedParamMgr(torch.randn(rows, 4), capacity, buffer_size=0, pin_weight=False,
                         evict_strategy=EvictionStrategy.DATASET)
    mgr.reorder(counts.tolist(), warmup_ratio=0.7)
    ours = _cache(rows, profile=[_ids(*profile_ids.tolist())], cache_ratio=capacity / rows, warmup_ratio=0.7)
    with torch.no_grad():
        for ids in batches:
            before = ours.counters()["unique_misses"]
            mgr.prepare_ids(ids.cuda())
            ours(SparseFeatures(ids, torch.ones(len(ids), dtype=torch.long), 1))
            assert mgr.num_miss_history[-1] == ours.counters()["unique_misses"] - before
            assert mgr.cached_idx_map.cpu().tolist() == ours.slot_row.tolist()

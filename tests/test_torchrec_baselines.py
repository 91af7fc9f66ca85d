"""The ecosystem baselines: torchrec's sharded tables on CPU against the device reference
(several processes: test_multiprocess.py), and fbgemm's UVM strategies' mapping without CUDA."""

from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode

from hypothesis import given, settings, strategies as st

from baselines.torchrec_tables import (CACHE_FIELDS, FBGEMM_CACHE_ASSOC, CacheObserver, UvmCacheParams,
                                       UvmCacheStrategy, UvmStrategy, cache_counters, cache_step_counts,
                                       _UvmCacheTables, fbgemm_cache_rows, linear_cache_indices, table_bounds)
from embbench.metrics import OpCounter
from embbench.strategy import COUNTERS, RuntimeEnv
from tests.conftest import requires_cuda, tiny_scenario, train_and_flush

CPU = RuntimeEnv(torch.device("cpu"))


@pytest.mark.parametrize("opt_type", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
@pytest.mark.slow
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
    assert "needs CUDA" in UvmCacheStrategy(UvmCacheParams(prefetch_pipeline=True)).unsupported_reason(CPU)


@pytest.mark.parametrize("bad", [{"cache_ratio": 0}, {"cache_ratio": 1.01}, {"algorithm": "fifo"}, {"ratio": 0.1}])
def test_uvm_cache_rejects_bad_parameters(bad):
    with pytest.raises(ValidationError):
        UvmCacheParams(**bad)


def test_fbgemm_cache_holds_whole_sets():
    assert fbgemm_cache_rows(0.015, 1_000_000) == 15_008  # 469 sets of 32, rounded up from 15,000
    assert fbgemm_cache_rows(1e-9, 10) == FBGEMM_CACHE_ASSOC
    assert fbgemm_cache_rows(0.5, 64) % FBGEMM_CACHE_ASSOC == 0


@st.composite
def cache_steps(draw):
    """Tables, a cache state, a batch of linear indices and the state a prefetch left."""
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3))
    total = sum(sizes)
    slots = draw(st.integers(1, 12))
    resident = draw(st.lists(st.integers(0, total - 1), max_size=slots, unique=True))
    before = resident + [-1] * (slots - len(resident))
    before = draw(st.permutations(before))
    after = list(before)
    newcomers = [r for r in range(total) if r not in before]
    for slot in draw(st.lists(st.integers(0, slots - 1), unique=True, max_size=len(newcomers))):
        after[slot] = newcomers.pop()
    linear = draw(st.lists(st.integers(0, total), max_size=30))  # ``total``: an id of an uncached table
    return sizes, before, after, linear


@settings(max_examples=100, deadline=None)
@given(step=cache_steps())
def test_cache_step_counts_match_a_set_based_reference(step):
    sizes, before, after, linear = step
    total = sum(sizes)
    table_of = [t for t, n in enumerate(sizes) for _ in range(n)]
    bounds = table_bounds(torch.tensor(table_of, dtype=torch.int32), len(sizes))
    counts = cache_step_counts(torch.tensor(linear, dtype=torch.long), torch.tensor(before).view(-1, 1),
                               torch.tensor(after).view(-1, 1), bounds)
    resident = set(before) - {-1}
    for t in range(len(sizes)):
        ids = [x for x in linear if x < total and table_of[x] == t]
        changed = [(b, a) for b, a in zip(before, after) if b != a]
        expected = {
            "accesses": len(ids), "unique_accesses": len(set(ids)),
            "hits": sum(x in resident for x in ids), "misses": sum(x not in resident for x in ids),
            "unique_misses": len(set(ids) - resident),
            "rows_admitted": sum(a >= 0 and table_of[a] == t for _, a in changed),
            "rows_evicted": sum(b >= 0 and table_of[b] == t for b, _ in changed),
        }
        assert dict(zip(CACHE_FIELDS, counts[t].tolist())) == expected


def test_linear_cache_indices_offset_each_feature_and_mark_uncached_ones():
    # 3 features x 2 samples; feature 1's table is not cached (-1); 10 cached rows in all
    lengths = torch.tensor([1, 2, 0, 1, 2, 1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    indices = torch.tensor([0, 3, 4, 9, 1, 2, 5])
    linear = linear_cache_indices(indices, offsets, torch.tensor([0, -1, 6, 10]), 10)
    assert linear.tolist() == [0, 3, 4, 10, 6 + 1, 6 + 2, 6 + 5]


def test_cache_counters_write_back_every_evicted_row_and_update_unadmitted_misses_in_place():
    counts = torch.zeros(2, len(CACHE_FIELDS), dtype=torch.long)
    field = CACHE_FIELDS.index
    counts[0, [field("accesses"), field("unique_misses"), field("rows_admitted"), field("rows_evicted")]] = \
        torch.tensor([100, 10, 8, 5])
    counts[1, [field("accesses"), field("unique_misses"), field("rows_admitted")]] = torch.tensor([50, 4, 4])
    counters = cache_counters(counts, row_bytes=[64, 32])
    assert set(counters) <= set(COUNTERS)
    assert counters["accesses"] == 150 and counters["rows_written_back"] == counters["rows_evicted"] == 5
    assert counters["bytes_h2d"] == 10 * 64 + 4 * 32
    assert counters["bytes_d2h"] == (5 + 2) * 64  # evicted, and 2 misses that found no slot


class _TinyCachedTbe(torch.nn.Module):
    """The attributes CacheObserver reads of an fbgemm TBE, and a forward that fills free
    slots with the batch's missing rows (a stand-in for fbgemm's CUDA prefetch)."""

    def __init__(self, rows: list[int], slots: int):
        super().__init__()
        self.cache_hash_size_cumsum = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
        self.cache_index_table_map = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32),
                                                             torch.tensor(rows))
        self.lxu_cache_state = torch.full((slots, 1), -1)
        self.lxu_cache_weights = torch.zeros(slots, 4)
        self.D_offsets = torch.tensor([0, 4, 8][: len(rows) + 1], dtype=torch.int32)

    def forward(self, indices, offsets):
        linear = linear_cache_indices(indices, offsets, self.cache_hash_size_cumsum, self.cache_index_table_map.numel())
        for row in dict.fromkeys(linear.tolist()):
            state = self.lxu_cache_state.view(-1)
            free = (state == -1).nonzero()
            if row not in state.tolist() and free.numel():
                state[free[0]] = row
        return torch.zeros(offsets.numel() - 1, 4)


def test_cache_observer_counts_training_forwards_only():
    tbe = _TinyCachedTbe(rows=[5, 5], slots=3)
    observer = CacheObserver(tbe)
    # 2 features x 2 samples: feature 0 ids [1], [1, 2]; feature 1 ids [0], [4]
    tbe(indices=torch.tensor([1, 1, 2, 0, 4]), offsets=torch.tensor([0, 1, 3, 4, 5]))
    with torch.no_grad():
        tbe(torch.tensor([3, 3]), torch.tensor([0, 1, 1, 2, 2]))  # evaluation: not counted
    tbe(torch.tensor([1, 0, 0]), torch.tensor([0, 1, 1, 2, 3]))
    c = {f: observer.counts[:, i].tolist() for i, f in enumerate(CACHE_FIELDS)}
    assert c["accesses"] == [4, 4] and c["unique_accesses"] == [3, 3]
    # step 1: nothing cached; rows 1, 2 (table 0) and 5 (table 1, id 0) fill the 3 slots, 9 finds none
    # step 2: id 1 of table 0 hits once, id 0 of table 1 twice
    assert c["hits"] == [1, 2] and c["misses"] == [3, 2] and c["unique_misses"] == [2, 2]
    assert c["rows_admitted"] == [2, 1] and c["rows_evicted"] == [0, 0]
    assert observer.row_bytes == [16, 16]


class _ScatterFanIn(TorchDispatchMode):
    """The most entries an accumulating scatter (index_add, scatter_add, index_put with
    accumulate) aims at one address, over the operators issued inside it."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        index = None
        if name in ("index_add", "index_add_", "scatter_add", "scatter_add_"):
            index = args[2]
        elif name in ("index_put", "index_put_") and (args[3] if len(args) > 3 else kwargs.get("accumulate")):
            index = args[1][0]
        if index is not None and index.numel():
            self.most = max(self.most, int(torch.unique(index.flatten(), return_counts=True)[1].max()))
        return func(*args, **kwargs)


def test_cache_counts_aim_no_more_entries_at_one_address_than_the_hottest_row_has_ids():
    """Counting per table by a scatter onto a cell per table put every id of a table on one
    address (seven index_add_ of ~0.45M entries onto 26 cells a step on the H100: 2.0 ms of
    uvm_cache's 10.66 ms, issue 47); the counts are read at the tables' boundaries instead."""
    g = torch.Generator().manual_seed(0)
    sizes = [300, 200, 100]
    index_table = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor(sizes))
    linear = torch.randint(0, 600, (3000,), generator=g)
    before = torch.randperm(600, generator=g)[:64]
    after = before.clone()
    after[:10] = torch.arange(600)[~torch.isin(torch.arange(600), before)][:10]
    hottest = int(torch.unique(linear, return_counts=True)[1].max())
    with _ScatterFanIn() as watch:
        counts = cache_step_counts(linear, before, after, table_bounds(index_table, 3))
    assert watch.most <= hottest
    assert counts[:, CACHE_FIELDS.index("accesses")].tolist() == [int(((linear >= a) & (linear < a + n)).sum())
                                                                  for a, n in zip([0, 300, 500], sizes)]


def test_table_bounds_are_each_cached_table_s_range_of_linear_indices():
    # fbgemm's map: table 2 is not cached (no range), table 1's rows come first in the cached space
    bounds = table_bounds(torch.tensor([1, 1, 0, 0, 0, 3], dtype=torch.int32), 4)
    assert bounds.tolist() == [[2, 5], [0, 2], [0, 0], [5, 6]]
    with pytest.raises(ValueError, match="table 0 two ranges"):
        table_bounds(torch.tensor([0, 1, 0], dtype=torch.int32), 2)


def test_an_inactive_cache_observer_issues_none_of_its_operators():
    """The timed steps (``set_counting("off")``) run the TBE alone: a forward with an inactive
    observer issues exactly the operators of one with no observer (by name), and counts nothing;
    an active one adds its own (a clone, sorts, searches)."""
    batch = (torch.tensor([1, 1, 2, 0, 4]), torch.tensor([0, 1, 3, 4, 5]))

    def ops(tbe) -> dict[str, int]:
        with OpCounter(torch.device("cpu")) as counter:
            tbe(*batch)
        return dict(counter.by_name)

    plain = ops(_TinyCachedTbe(rows=[5, 5], slots=3))
    observed = _TinyCachedTbe(rows=[5, 5], slots=3)
    observer = CacheObserver(observed)
    observer.active = False
    assert ops(observed) == plain and not observer.counts.any()
    observer.active = True
    counted = ops(observed)
    assert counted["sort"] > plain.get("sort", 0) and counted["clone"] > plain.get("clone", 0)
    assert observer.counts.any()


def test_uvm_cache_switches_its_observers_with_the_runner_s_counting():
    observer = CacheObserver(_TinyCachedTbe(rows=[5], slots=2))
    tables = SimpleNamespace(_observers=[(None, observer)])
    assert _UvmCacheTables.instruments(tables) == {"fbgemm_cache_counts": CacheObserver.WHAT}
    for mode, active in (("off", False), ("warmup", True), ("off", False), ("counted", True)):
        _UvmCacheTables.set_counting(tables, mode)
        assert observer.active is active


@requires_cuda
@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_cache_counts_agree_with_fbgemm_on_cuda(algorithm):
    """On a real fbgemm cache: LRU's own uvm_cache_stats give the same unique counts; for
    both algorithms the counts add up and the slots in use equal admitted minus evicted."""
    from baselines import _fbgemm as fb

    rows, dim, batch = [3000, 500], 8, 256
    tbe = fb.SplitTableBatchedEmbeddingBagsCodegen(
        [(n, dim, fb.EmbeddingLocation.MANAGED_CACHING, fb.ComputeDevice.CUDA) for n in rows],
        cache_algorithm={"lru": fb.CacheAlgorithm.LRU, "lfu": fb.CacheAlgorithm.LFU}[algorithm],
        cache_load_factor=0.1, gather_uvm_cache_stats=True, optimizer=fb.EmbOptimType.EXACT_SGD, learning_rate=0.1)
    observer = CacheObserver(tbe)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = [(torch.rand(batch, generator=g) ** 3 * n).long() for n in rows]  # skewed
        offsets = torch.arange(len(rows) * batch + 1)
        tbe(indices=torch.cat(ids).cuda(), offsets=offsets.cuda()).sum().backward()
    c = {f: observer.counts[:, i].sum().item() for i, f in enumerate(CACHE_FIELDS)}
    assert c["accesses"] == 20 * batch * len(rows) == c["hits"] + c["misses"]
    assert 0 < c["rows_admitted"] <= c["unique_misses"] <= c["unique_accesses"]
    assert c["rows_admitted"] - c["rows_evicted"] == int((tbe.lxu_cache_state >= 0).sum())
    if algorithm == "lru":
        stats = tbe.get_uvm_cache_stats().tolist()  # calls, requested, unique, unique misses, conflict unique misses, ...
        assert c["accesses"] == stats[1] and c["unique_accesses"] == stats[2] and c["unique_misses"] == stats[3]
        assert c["rows_admitted"] == stats[3] - stats[4]


def test_gpu_sharded_draws_each_table_at_random_at_most_once_before_its_initial_weights(monkeypatch):
    """torchrec initialises a sharded table at random twice (its kernel's init_parameters, then
    the collection's init_fn), and embbench writes its own initial weights after: measured at a
    twentieth of the Kaggle shape, 2.0 s of a 4.7 s build. The init_fn pass is skipped; the
    kernel's own draw is not embbench's to skip (issue 42)."""
    from baselines.torchrec_tables import GpuShardedStrategy
    from embbench.data.weights import initial_weights
    from embbench.scenario import parse_scenario
    from embbench.strategy import BuildContext

    scenario, _ = parse_scenario(tiny_scenario(), "t")
    tables = scenario.tables()
    draws = []
    uniform = torch.Tensor.uniform_
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: (draws.append(self.numel()), uniform(self, *a, **k))[1])
    ctx = BuildContext(tables=tables, env=CPU, optimizer=scenario.optimizer.embedding, local_batch_size=64,
                       init_weights=lambda t, a, b: initial_weights(tables[t], t, 0, a, b), train_batches=lambda n: iter(()))
    module = GpuShardedStrategy().build(ctx)
    assert sum(draws) <= sum(t.num_rows * t.dim for t in tables), "a table was drawn at random twice"
    for got, table, index in zip(module.flush(), tables, range(len(tables))):
        assert torch.equal(got, initial_weights(table, index, 0, 0, table.num_rows))

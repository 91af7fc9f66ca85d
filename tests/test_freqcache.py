"""freqcache against the whole-table reference: same outputs and weights, under any id
stream, cache size, policy and prefetch setting; consistent counters and maps."""

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from baselines.tables import WholeTables
from embbench.cache import FreqCache, FreqCacheParams
from embbench.cache.policy import _HISTOGRAM, _UPCOMING, FrequencySketch, SlotPlanner, _kth_lowest, _lowest
from embbench.data import SparseFeatures, TableSpec
from embbench.metrics import belady_hit_rate, belady_hit_rates
from embbench.optim import EmbeddingOptimizer
from embbench.data.weights import initial_weights
from embbench.strategy import BuildContext, RuntimeEnv
from tests.conftest import tiny_scenario, train_and_flush


def _context(tables, opt, batches, warmup=0) -> BuildContext:
    from embbench.data import Batch

    def train_batches(n):
        for f in batches[:n]:
            yield Batch(torch.zeros(f.batch_size, 13), f, torch.zeros(f.batch_size))

    return BuildContext(tables=tables, env=RuntimeEnv(torch.device("cpu")), optimizer=opt,
                        local_batch_size=batches[0].batch_size,
                        init_weights=lambda t, a, b: initial_weights(tables[t], t, 0, a, b),
                        train_batches=train_batches, warmup_steps=warmup)


def _train(module, batches, prefetch: bool, lookahead: int = 0, counting: dict[int, str] | None = None) -> list[torch.Tensor]:
    """Train as the runner does: look ahead, forward, prefetch the next batch, backward (on the
    batches' device); ``counting``: the instruments' mode set before the steps it names."""
    device = batches[0].values.device
    g = torch.Generator(device=device).manual_seed(7)
    outputs = []
    for i, features in enumerate(batches):
        if i in (counting or {}):
            module.set_counting(counting[i])
        if lookahead and i + 1 < len(batches):
            module.look_ahead(batches[i + 1 : i + 1 + lookahead])
        out = module(features)
        if prefetch and i + 1 < len(batches):
            module.prefetch(batches[i + 1])
        grad = torch.randn(out.shape, generator=g, device=device)
        (out * grad).sum().backward()
        outputs.append(out.detach())
    return outputs


@st.composite
def streams(draw):
    num_tables = draw(st.integers(1, 3))
    rows = [draw(st.integers(1, 30)) for _ in range(num_tables)]
    bags = [draw(st.integers(1, 3)) for _ in range(num_tables)]
    batch = draw(st.integers(1, 6))
    steps = draw(st.integers(1, 8))
    hot = draw(st.integers(1, 4))  # a small pool of ids: heavy duplication
    batches = []
    for _ in range(steps):
        values = []
        for r, bag in zip(rows, bags):
            values += [draw(st.integers(0, min(r, hot) - 1)) if draw(st.booleans()) else draw(st.integers(0, r - 1))
                       for _ in range(batch * bag)]
        lengths = torch.tensor([bag for bag in bags for _ in range(batch)])
        batches.append(SparseFeatures(torch.tensor(values, dtype=torch.long), lengths, num_tables))
    tables = [TableSpec(f"t{i}", r, 4, b, 1.0) for i, (r, b) in enumerate(zip(rows, bags))]
    return tables, batches


def _check_maps(cache: FreqCache) -> None:
    p = cache.planner
    S = p.num_slots
    rows, cached = p.slot_row[:S], p.slot_cached[:S]
    occupied = rows[rows < p.pad_row]
    assert len(occupied.unique()) == len(occupied), "a row sits in two slots"
    assert torch.equal(p.map_rows, rows.sort().values), "the sorted map is not the slot map's"
    assert torch.equal(rows[p.map_slots], p.map_rows)
    assert int(cached.sum()) == int(p.num_cached) <= cache.capacity
    assert not (cached & (rows >= p.pad_row)).any(), "an empty slot counts as cached"


@settings(max_examples=100, deadline=None)
@given(stream=streams(), opt_type=st.sampled_from(["sgd", "rowwise_adagrad"]),
       ratio=st.sampled_from([1e-6, 0.1, 0.3, 1.0]), policy=st.sampled_from(["static", "lfu"]),
       admission=st.sampled_from(["all", "tinylfu"]), prefetch=st.booleans(), lookahead=st.integers(0, 3),
       decay=st.sampled_from([0, 1, 3]), profile=st.integers(0, 2))
@pytest.mark.slow
def test_freqcache_trains_exactly_like_whole_tables(stream, opt_type, ratio, policy, admission, prefetch, lookahead,
                                                     decay, profile):
    tables, batches = stream
    opt = EmbeddingOptimizer(type=opt_type, lr=0.2)
    reference = WholeTables(_context(tables, opt, batches))
    params = FreqCacheParams(cache_ratio=ratio, policy=policy, admission=admission, prefetch=prefetch,
                             lookahead=lookahead, decay_every=decay, profile_batches=profile, belady_steps=3)
    cache = FreqCache(_context(tables, opt, batches), params)
    preloaded = int(cache.planner.num_cached)
    expected = _train(reference, batches, prefetch=False)
    got = _train(cache, batches, prefetch=prefetch, lookahead=cache.lookahead)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    _check_maps(cache)
    counters = cache.counters()
    assert counters["hits"] + counters["misses"] == counters["accesses"] == sum(b.values.numel() for b in batches)
    assert counters["rows_admitted"] - counters["rows_evicted"] == int(cache.planner.num_cached) - preloaded
    for a, b in zip(cache.flush(), reference.flush()):
        torch.testing.assert_close(a, b)
    assert not cache.planner.slot_dirty.any(), "flush left dirty rows"


def test_a_batch_larger_than_the_cache_trains_through_the_bypass():
    tables = [TableSpec("t0", 50, 4, 1, 1.0)]
    batches = [SparseFeatures(torch.arange(40) % 50, torch.ones(40, dtype=torch.long), 1) for _ in range(3)]
    opt = EmbeddingOptimizer(type="rowwise_adagrad", lr=0.2)
    cache = FreqCache(_context(tables, opt, batches), FreqCacheParams(cache_ratio=0.1, profile_batches=1))
    reference = WholeTables(_context(tables, opt, batches))
    for a, b in zip(_train(cache, batches, True), _train(reference, batches, False)):
        torch.testing.assert_close(a, b)
    for a, b in zip(cache.flush(), reference.flush()):
        torch.testing.assert_close(a, b)
    assert cache.counters()["accesses"] == 120 and cache.counters()["rows_admitted"] == 0


def test_optimizer_state_travels_with_evicted_rows():
    """Rows evicted and re-admitted keep their Adagrad accumulators (the published cache loses them)."""
    tables = [TableSpec("t0", 8, 4, 1, 1.0)]
    ids = [[0, 1], [2, 3], [0, 1], [4, 5], [0, 2]]
    batches = [SparseFeatures(torch.tensor(i), torch.ones(2, dtype=torch.long), 1) for i in ids]
    opt = EmbeddingOptimizer(type="rowwise_adagrad", lr=0.5)
    cache = FreqCache(_context(tables, opt, batches),
                      FreqCacheParams(cache_ratio=0.25, profile_batches=0, policy="static", admission="all"))
    reference = WholeTables(_context(tables, opt, batches))
    _train(cache, batches, False)
    _train(reference, batches, False)
    assert cache.counters()["rows_evicted"] > 0 and cache.counters()["rows_written_back"] > 0
    for a, b in zip(cache.flush(), reference.flush()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(cache.host[:-1, 4], reference.store.state[:, 0])


def test_prefetch_never_evicts_the_rows_the_current_step_uses():
    """Static policy, rows ranked 0..9, 4 slots: batch 0 brings rows 8 and 9 in as the coldest
    cached rows; prefetching batch 1 must evict other rows, not 8 and 9 before their update."""
    tables = [TableSpec("t0", 10, 4, 1, 1.0)]
    batches = [SparseFeatures(torch.tensor(ids), torch.ones(2, dtype=torch.long), 1) for ids in ([8, 9], [6, 7], [8, 9])]
    opt = EmbeddingOptimizer(type="rowwise_adagrad", lr=0.5)
    cache = FreqCache(_context(tables, opt, batches), FreqCacheParams(cache_ratio=0.4, profile_batches=0, policy="static"))
    reference = WholeTables(_context(tables, opt, batches))
    for a, b in zip(_train(cache, batches, True), _train(reference, batches, False)):
        torch.testing.assert_close(a, b)
    for a, b in zip(cache.flush(), reference.flush()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("bad", [{"cache_ratio": 0}, {"cache_ratio": 1.5}, {"policy": "lru"}, {"profile_batches": -1}])
def test_invalid_parameters_are_rejected(bad):
    with pytest.raises(ValidationError):
        FreqCacheParams(**bad)


def test_belady_bound_on_a_known_stream():
    steps = [torch.tensor(s) for s in ([1, 2], [3, 1], [2, 3], [1, 1])]
    # capacity 2: step 0 misses 1, 2; step 1 hits 1, misses 3, which replaces 1 (used later);
    # step 2 hits 2 and 3; step 3 misses 1 twice (not worth keeping): 3 hits of 8.
    assert belady_hit_rate(steps, capacity=2) == pytest.approx(3 / 8)
    # capacity 3: only the three compulsory misses.
    assert belady_hit_rate(steps, capacity=3) == pytest.approx(5 / 8)
    assert belady_hit_rate(steps, capacity=2, skip=2) == pytest.approx(2 / 4)
    # capacity 1: keeps 1 (hit at step 1), then 3 (hit at step 2), bypasses the rest.
    assert belady_hit_rate(steps, capacity=1) == pytest.approx(2 / 8)
    # prefilled (as after a warm-up preload): 1 and 2 were there already: 5 hits of 8.
    assert belady_hit_rate(steps, capacity=2, prefilled=True) == pytest.approx(5 / 8)


def test_belady_keeps_the_row_with_more_ids_of_two_next_used_together():
    """Rows 0 (one id a step) and 1 (three) recur in every step; one slot: MIN keeps row 1,
    so 9 of 16 accesses hit (3 of 8 distinct rows either way)."""
    steps = [torch.tensor([0, 1, 1, 1])] * 4
    assert belady_hit_rates(steps, capacity=1) == pytest.approx((9 / 16, 3 / 8))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=5), min_size=1, max_size=8), st.integers(1, 7))
def test_no_simple_policy_beats_the_belady_bound(steps, capacity):
    """A fixed set of resident rows, loaded on first use, is a policy too: the best such
    set (found by brute force) may not beat MIN per distinct row."""
    import itertools

    stream = [torch.tensor(s) for s in steps]
    unique_steps = [set(s) for s in steps]
    total = sum(len(s) for s in unique_steps)
    bound = belady_hit_rate([torch.tensor(sorted(s)) for s in unique_steps], capacity)
    rows = sorted(set().union(*unique_steps))
    best_static = max(sum(len(s & set(keep)) for s in unique_steps) - len(keep)  # first uses miss
                      for keep in itertools.combinations(rows, min(capacity, len(rows))))
    assert best_static / total <= bound + 1e-12
    assert belady_hit_rate(stream, capacity) <= 1.0


def test_freqcache_in_the_runner_matches_device_and_reports_its_bound(tmp_path):
    raw = tiny_scenario(run={"warmup_steps": 2, "steps": 4, "repeats": 2})
    reference, _ = train_and_flush(raw, "device", tmp_path=tmp_path)
    weights, metrics = train_and_flush(raw, "freqcache", {"cache_ratio": 0.05, "belady_steps": 6}, tmp_path=tmp_path)
    for a, b in zip(weights, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    extra = metrics["extra"]
    # MIN is the optimum per distinct row; per access (weighted by repeats) it is only close.
    assert 0 < extra["window_unique_hit_rate"] <= extra["belady_unique_hit_rate"] + 1e-9 <= 1.0 + 1e-9
    assert 0 < extra["window_hit_rate"] <= 1 and abs(extra["window_hit_rate"] - extra["belady_hit_rate"]) < 0.1
    counters = metrics["counters"]["total"]
    assert counters["hits"] + counters["misses"] == counters["accesses"]
    assert metrics["counters"]["per_step"]["bytes_h2d"] > 0


def test_a_prefetched_batch_that_is_never_used_does_not_stand_in_for_another():
    """Training ends with the next batch prefetched; evaluation then sends other batches,
    which must be looked up themselves (even if the dropped batch's memory is reused)."""
    tables = [TableSpec("t0", 20, 4, 1, 1.0)]
    opt = EmbeddingOptimizer(type="sgd", lr=0.1)
    batches = [SparseFeatures(torch.tensor([i, i + 1]), torch.ones(2, dtype=torch.long), 1) for i in range(4)]
    cache = FreqCache(_context(tables, opt, batches), FreqCacheParams(cache_ratio=0.5, profile_batches=0))
    reference = WholeTables(_context(tables, opt, batches))
    cache.prefetch(SparseFeatures(torch.tensor([5, 6]), torch.ones(2, dtype=torch.long), 1))
    with torch.no_grad():
        for features in batches:
            torch.testing.assert_close(cache(features), reference(features))


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.lists(st.integers(0, 19), min_size=1, max_size=6), min_size=2, max_size=10),
       capacity=st.integers(1, 8), admission=st.sampled_from(["all", "tinylfu"]), ahead=st.integers(0, 3))
def test_the_planner_moves_a_running_batch_s_slots_only_after_it_ends(steps, capacity, admission, ahead):
    """Plan each batch while the previous one runs (as prefetch does): a copy out of or into
    a slot of the running batch is in the plan's late part (done once that step has ended),
    and only such a slot of it changes its row; every row gets a slot that holds it, and the
    maps stay inverse."""
    planner = SlotPlanner(num_rows=20, capacity=capacity, max_ids=6, admission=admission, decay_every=2)
    planner.preload(np.arange(capacity))
    batches = [np.array(s, dtype=np.int64) for s in steps]
    for b in batches[1 : 1 + ahead]:
        planner.expect(np.unique(b), +1)
    running = None
    for i, rows in enumerate(batches):
        if 1 + i + ahead < len(batches):
            planner.expect(np.unique(batches[1 + i + ahead]), +1)
        if i:
            planner.expect(np.unique(rows), -1)
        plan = planner.plan(rows, train=True, running=None if running is None else running.id)
        assert np.array_equal(planner.slot_row[plan.slots], np.unique(rows)), "a row's slot does not hold it"
        late_out = plan.write_back_slots[len(plan.write_back_slots) - plan.late_write_backs :]
        late_in = plan.load_slots[len(plan.load_slots) - plan.late_loads :]
        early = np.concatenate([plan.write_back_slots[: len(plan.write_back_slots) - plan.late_write_backs],
                                plan.load_slots[: len(plan.load_slots) - plan.late_loads]])
        if running is None:
            assert plan.late_write_backs == plan.late_loads == 0
        else:
            assert not np.isin(early, running.slots).any(), "a running batch's slot is moved before it ends"
            assert np.isin(np.concatenate([late_out, late_in]), running.slots).all(), "a late move of another slot"
            moved = np.isin(running.slots, np.concatenate([late_out, late_in]))
            stays = planner.slot_row[running.slots[~moved]]
            assert np.array_equal(stays, np.unique(batches[i - 1])[~moved]), "a running batch's row moved"
            assert not np.isin(planner.slot_row[running.slots[moved]], np.unique(batches[i - 1])).any()
        kept = plan.slots[np.isin(np.unique(rows), plan.load_rows, invert=True)]
        assert not np.isin(plan.write_back_slots, kept).any(), "a slot the batch reads was written back"
        assert planner.slot_dirty[plan.slots].all() and len(plan.load_slots) == len(plan.load_rows)
        occupied = np.flatnonzero(planner.slot_row >= 0)
        assert np.array_equal(planner.row_slot[planner.slot_row[occupied]], occupied)
        assert np.array_equal(planner.slot_next_use[occupied], planner.next_use[planner.slot_row[occupied]])
        assert int(planner.slot_cached.sum()) == planner.num_cached <= capacity
        for row in range(20):  # the nearest window batch that uses it (0: none)
            assert planner.next_use[row] == min((n for n, _, r in planner._window if row in r), default=0)
        running = plan


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.one_of(st.lists(st.integers(0, 11), min_size=1, max_size=5, unique=True),
                              st.integers(0, 7)), max_size=30))
def test_next_use_is_the_nearest_window_batch_whatever_order_batches_leave_in(ops):
    """Batches (lists of rows) enter the window; an integer makes the window's batch at that
    index leave (not only the oldest: a look-ahead copy may finish late). Every row the
    window uses keeps the number of the first entered window batch that has it."""
    planner = SlotPlanner(num_rows=12, capacity=2, max_ids=5)
    window = []  # (number, rows) in entry order: the reference
    for op in ops:
        if isinstance(op, list):
            rows = np.unique(op)
            planner.expect(rows, +1)
            window.append((planner._entered, rows))
        elif window:
            _, rows = window.pop(op % len(window))
            planner.expect(rows, -1)
        for row in range(12):
            assert planner.next_use[row] == min((n for n, r in window if row in r), default=0)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.lists(st.integers(0, 29), min_size=1, max_size=6), min_size=2, max_size=10),
       ahead=st.integers(0, 3), data=st.data())
def test_victims_are_the_lowest_priority_cached_slots_not_kept(steps, ahead, data):
    """The planner's victim search (masks over whole slot arrays, rows the window does not
    use first) against the definition: the cached slots not kept, by (frequency + look-ahead
    bonus, slot), below the limit."""
    planner = SlotPlanner(num_rows=30, capacity=8, max_ids=6, decay_every=3)
    planner.preload(np.arange(8))
    batches = [np.unique(s) for s in steps]
    for b in batches[1 : 1 + ahead]:
        planner.expect(b, +1)
    for i, rows in enumerate(batches):
        if 1 + i + ahead < len(batches):
            planner.expect(batches[1 + i + ahead], +1)
        if i and ahead:
            planner.expect(rows, -1)
        kept = data.draw(st.lists(st.integers(0, planner.num_slots - 1), unique=True, max_size=4))
        kept = np.array(kept, dtype=np.int64)
        wanted = data.draw(st.integers(1, 10))
        limit = data.draw(st.sampled_from([None, 1, 3, _UPCOMING, 3 * _UPCOMING]))
        pool = np.flatnonzero(planner.slot_cached)
        pool = pool[~np.isin(pool, kept)]
        next_use = planner.next_use[planner.slot_row[pool]].astype(np.int64)
        priority = planner.slot_freq[pool] + np.where(next_use > 0, _UPCOMING * (planner._entered + 1 - next_use), 0)
        if limit is not None:
            pool, priority = pool[priority < limit], priority[priority < limit]
        order = np.lexsort((pool, priority))[:wanted]
        victims, victim_priority = planner._victims(wanted, limit, kept)
        assert np.array_equal(victims, pool[order]) and np.array_equal(victim_priority, priority[order])
        planner.plan(rows, train=True, running=planner.plans - 1 if planner.plans else None)


def test_a_batch_that_never_entered_the_window_cannot_leave_it():
    planner = SlotPlanner(num_rows=10, capacity=2, max_ids=2)
    planner.expect(np.array([1, 2]), +1)
    with pytest.raises(ValueError, match="never entered"):
        planner.expect(np.array([1, 3]), -1)


def test_of_rows_the_window_uses_the_one_needed_last_is_evicted_first():
    """Belady's order inside the look-ahead window: row 1 is next used in the first window
    batch, row 0 only after it (though twice): row 0 gives its slot to the missing row 5."""
    planner = SlotPlanner(num_rows=10, capacity=2, max_ids=2, admission="all", learn=False)
    planner.preload(np.array([0, 1]))
    for rows in ([5], [1], [0], [0]):  # the batch planned next, then the window behind it
        planner.expect(np.array(rows), +1)
    planner.expect(np.array([5]), -1)
    planner.plan(np.array([5]), train=True)
    assert planner.row_slot[0] == -1 and planner.row_slot[1] >= 0 and planner.slot_cached[planner.row_slot[5]]
    planner.expect(np.array([0]), -1)  # the first batch with row 0 is planned: its next use is the other one
    assert planner.next_use[0] == 4


def test_tinylfu_keeps_a_hot_row_that_admit_all_would_evict():
    """One cached slot: a hot row (every other batch) against a stream of one-off rows."""
    stream = [np.array([0]) if i % 2 == 0 else np.array([1 + i]) for i in range(12)]
    rates = {}
    for admission in ("all", "tinylfu"):
        planner = SlotPlanner(num_rows=20, capacity=1, max_ids=2, admission=admission)
        for rows in stream:
            planner.plan(rows, train=True)
        rates[admission] = planner.counters["hits"] / planner.counters["accesses"]
    assert rates["tinylfu"] > rates["all"]
    assert rates["all"] == 0 and rates["tinylfu"] == 5 / 12  # row 0 hits from its second batch on


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.sampled_from([0, 1, 2, 7, _HISTOGRAM - 1, _HISTOGRAM, _HISTOGRAM + 3, 1 << 40, (1 << 40) + 1,
                                        3 << 40, (3 << 40) + 2, (5 << 40) + _HISTOGRAM + 1, (1 << 62) + 5]),
                       min_size=1, max_size=60),
       data=st.data())
def test_the_lowest_priorities_are_found_with_ties_in_slot_order(values, data):
    """Victim selection against a full sort by (priority, index), also beyond the histogram,
    whatever the guess of the k-th lowest (right, wrong, or none)."""
    values = np.array(values, dtype=np.int64)
    k = data.draw(st.integers(1, len(values) + 2))
    guess = data.draw(st.one_of(st.none(), st.sampled_from(values.tolist() + [3, 1 << 41])))
    expected = np.lexsort((np.arange(len(values)), values))[:k]
    assert np.array_equal(_lowest(values, k, guess), expected)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.one_of(st.integers(0, 9), st.integers(0, 1 << 62)), min_size=1, max_size=40), data=st.data())
def test_the_radix_select_finds_the_kth_lowest(values, data):
    k = data.draw(st.integers(1, len(values)))
    assert _kth_lowest(np.array(values, dtype=np.int64), k) == sorted(values)[k - 1]


def test_the_sketch_counts_never_undercount_and_decay_halves_them():
    sketch = FrequencySketch(width=64)
    rows = np.arange(100)
    for _ in range(3):
        sketch.add(rows)
    assert (sketch.estimate(rows) >= 3).all()
    sketch.halve()
    assert (sketch.estimate(rows) >= 1).all() and sketch.estimate(np.array([5]))[0] < 3 + 100


def test_the_policy_sweep_compares_the_planner_with_belady(tmp_path, capsys):
    from embbench.cache.sweep import Workload, main, simulate

    r = simulate(Workload(alpha=1.1, rows=3000, cache_ratio=0.05, batch_ids=256, lookahead=4),
                 profile_batches=4, warmup_steps=4, steps=8)
    assert 0 < r["unique_hit_rate"] <= r["belady_unique_hit_rate"] + 1e-12 <= 1 + 1e-12
    assert 0 < r["hit_rate"] <= 1 and r["capacity"] == 150
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("name: s\nalpha: [1.1]\nrows: [2000]\ncache_ratio: [0.05]\nbatch_ids: [128, 256]\n"
                     "lookahead: [0, 4]\nprofile_batches: 2\nwarmup_steps: 2\nsteps: 4\n")
    assert main([str(sweep), "--out", str(tmp_path / "out.json")]) == 0
    import json

    assert len(json.loads((tmp_path / "out.json").read_text())["results"]) == 4
    sweep.write_text("name: s\nalpha: [1.1]\nrows: [2000]\ncache_ratio: [0.05]\nbatch_id: [128]\n")
    assert main([str(sweep)]) == 2
    assert str(sweep) in capsys.readouterr().err


def test_initial_weights_filled_by_threads_equal_the_tables_made_in_one_go():
    from embbench.embedding import RowSpace

    tables = [TableSpec("t0", 70_000, 4, 1, 1.0), TableSpec("t1", 3, 4, 1, 1.0), TableSpec("t2", 140_000, 4, 1, 1.0)]
    space = RowSpace(tables)
    init = lambda t, a, b: initial_weights(tables[t], t, 5, a, b)  # noqa: E731
    serial, threaded = torch.empty(space.num_rows, 4), torch.empty(space.num_rows, 4)
    space.fill_initial(serial, init, chunk=50_000, workers=1)
    space.fill_initial(threaded, init, chunk=30_000, workers=3)
    whole = torch.cat([init(t, 0, table.num_rows) for t, table in enumerate(tables)])
    assert torch.equal(serial, whole) and torch.equal(threaded, whole)
    reverse = torch.arange(space.num_rows - 1, -1, -1)
    placed = torch.empty(space.num_rows, 4)
    space.fill_initial(placed, init, position=lambda rows: reverse[rows], chunk=30_000, workers=3)
    assert torch.equal(placed, whole.flip(0))


def _steady_counted(compile_: bool, batch: int, steps: int = 14, counted: range = range(9, 12)):
    """freqcache trained on full batches (every step from the third is steady), beside whole
    tables; returns its outputs, the reference's, both flushed tables, the ATen ops per counted
    step, and the record's extra metrics."""
    from embbench.data import Stream, SyntheticCriteo
    from embbench.metrics import OpCounter

    tables = [TableSpec("t0", 3000, 8, 2, 1.05), TableSpec("t1", 500, 8, 1, 1.1)]
    data = SyntheticCriteo(tables, 0)
    batches = [data.batch(Stream.TRAIN, i, batch).sparse for i in range(steps)]
    opt = EmbeddingOptimizer(type="rowwise_adagrad", lr=0.2)
    cache = FreqCache(_context(tables, opt, batches),
                      FreqCacheParams(cache_ratio=0.02, lookahead=4, profile_batches=2, compile=compile_))
    reference = WholeTables(_context(tables, opt, batches))
    counter = OpCounter(torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    got = []
    for i, features in enumerate(batches):
        with counter if i in counted else contextlib.nullcontext():
            if i + 1 < len(batches):
                cache.look_ahead(batches[i + 1 : i + 1 + cache.lookahead])
            out = cache(features)
            if i + 1 < len(batches):
                cache.prefetch(batches[i + 1])
            (out * torch.randn(out.shape, generator=g)).sum().backward()
            cache.end_step()
        got.append(out.detach())
    return (got, _train(reference, batches, prefetch=False), cache.flush(), reference.flush(),
            counter.ops / len(counted), cache.extra_metrics())


@pytest.mark.slow
def test_compiled_steps_train_exactly_like_eager_ones_with_fewer_operators_the_same_at_any_batch():
    """compile: true fuses the steady-state steps (window entry, plan with its early moves, late
    moves): the same outputs and tables as whole tables, fewer ATen operators a step than
    eagerly, and the same count at two batch sizes."""
    ops = {}
    for compile_, batch in ((False, 16), (True, 16), (True, 48)):
        got, expected, tables, reference, ops[compile_, batch], extra = _steady_counted(compile_, batch)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
        for a, b in zip(tables, reference):
            torch.testing.assert_close(a, b)
        if compile_:
            assert extra["cache_compiled"] == ["enter", "late", "plan"], extra["cache_compile"]
            assert sorted(extra["cache_compile_seconds"]) == ["enter", "late", "plan"]
        else:
            assert extra["cache_compiled"] == [] and extra["cache_compile"] == "off: compile is false"
    assert ops[True, 16] == ops[True, 48] < ops[False, 16] - 100, ops


def test_compile_auto_is_on_only_on_cuda():
    tables, batches = [TableSpec("t0", 50, 4, 1, 1.0)], [SparseFeatures(torch.arange(4), torch.ones(4, dtype=torch.long), 1)]
    cache = FreqCache(_context(tables, EmbeddingOptimizer(type="sgd", lr=0.1), batches), FreqCacheParams())
    assert cache.extra_metrics()["cache_compile"] == "off: not on CUDA (compile: auto)"


def test_a_step_that_fails_to_compile_runs_eagerly_and_the_record_says_why(monkeypatch):
    def broken_compile(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("no C++ compiler here")
        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    got, expected, tables, reference, _, extra = _steady_counted(True, 16, steps=8, counted=range(5, 6))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    for a, b in zip(tables, reference):
        torch.testing.assert_close(a, b)
    assert extra["cache_compiled"] == []
    assert extra["cache_compile"].startswith("compiling ") and "no C++ compiler here" in extra["cache_compile"]


def test_the_belady_window_is_recorded_into_one_buffer_made_at_build():
    """The recorded stream lands in one buffer allocated when the cache is built (pinned on
    CUDA): a step allocates nothing for it (a fresh pinned buffer a step cost ~2.8 ms of an
    H100 step, issue 42 item 4). It is recorded in counted steps only (issue 47: never in a
    timed one): the batches planned in them (each step plans the next batch: prefetch), and MIN
    is computed on exactly those."""
    tables = [TableSpec("t0", 40, 4, 2, 1.0), TableSpec("t1", 9, 4, 1, 1.0)]
    g = torch.Generator().manual_seed(3)
    batches = [SparseFeatures(torch.cat([torch.randint(0, 40, (6,), generator=g), torch.randint(0, 9, (3,), generator=g)]),
                              torch.tensor([2, 2, 2, 1, 1, 1]), 2) for _ in range(9)]
    opt = EmbeddingOptimizer(type="sgd", lr=0.1)
    cache = FreqCache(_context(tables, opt, batches, warmup=2), FreqCacheParams(cache_ratio=0.1, belady_steps=4))
    buffer = cache._recorder.buffer
    assert buffer.shape == (4, cache.max_ids)
    _train(cache, batches, prefetch=True, lookahead=cache.lookahead, counting={0: "off", 2: "counted", 7: "off"})
    assert cache._recorder.buffer is buffer and len(cache._recorder.lengths) == 4
    expected = [cache.space.global_rows(f) for f in batches[3:7]]  # planned in steps 2-5, the first 4
    for got, want in zip(cache._recorder.stream(), expected, strict=True):
        assert torch.equal(got, want)
    extra = cache.extra_metrics()
    assert extra["belady_window"] == [3, 7]
    assert (extra["belady_hit_rate"], extra["belady_unique_hit_rate"]) == belady_hit_rates(expected, cache.capacity,
                                                                                           prefilled=True)


def test_a_compiled_plan_whose_moves_fail_plans_its_batch_once_and_says_why(monkeypatch):
    """The fallback to eager steps covers the compiler only: an error in the moves after the
    compiled plan ran is raised, not answered by planning the same batch again (issue 42, item 8)."""
    import embbench.cache.freqcache as freqcache_module

    tables = [TableSpec("t0", 30, 4, 1, 1.0)]
    batches = [SparseFeatures(torch.arange(i, i + 4) % 30, torch.ones(4, dtype=torch.long), 1) for i in range(4)]
    cache = FreqCache(_context(tables, EmbeddingOptimizer(type="sgd", lr=0.1), batches),
                      FreqCacheParams(cache_ratio=0.2, compile=False, belady_steps=0))
    monkeypatch.setattr(freqcache_module.torch, "compile", lambda fn, **kwargs: fn)  # "compiled": the function itself
    cache._compiling, cache._triton_moves = True, True

    def failing_moves(out):
        raise RuntimeError("the moves failed")

    monkeypatch.setattr(cache, "_early_moves", failing_moves)
    rows = cache.space.global_rows(batches[0])
    pid = int(cache.planner._pid)
    with pytest.raises(RuntimeError, match="the moves failed"):
        cache._device_step("plan", rows, eligible=True)
    assert int(cache.planner._pid) == pid + 1, "the batch was planned twice"
    assert "failed" not in cache._compile_note


def _runner_training(raw: dict, params: dict):
    """A cell built as the runner builds it (on the CPU), ready for its training steps."""
    from embbench import runner
    from embbench.scenario import Cell, parse_scenario

    scenario, _ = parse_scenario(raw, "test")
    return runner._build(scenario, Cell("freqcache", params, 1, "fp32"), RuntimeEnv(torch.device("cpu")), None,
                         None, False, runner._Progress(None, 0))


def test_the_host_launches_the_lookup_before_any_side_stream_work_and_the_plan_after_the_dense_forward(monkeypatch):
    """The host's launch order in a steady training step (the runner's, look-ahead to end): the
    lookup comes before any of the side stream's work (the late moves it needs were queued
    after the step before's backward; the window's entries after it), the next batch's plan
    after the dense forward, the late moves of that plan after this step's backward
    (issue 47, item 5: 16 launches, a graph launch among them, delayed the dense forward)."""
    import embbench.cache.freqcache as freqcache_module

    training = _runner_training(tiny_scenario(run={"warmup_steps": 0, "steps": 8, "repeats": 1}),
                                {"cache_ratio": 0.05, "lookahead": 3, "belady_steps": 0})
    cache = training.sparse
    log: list[str] = []
    lookup, on_side, device_step = freqcache_module.pooled_lookup, cache._on_side, cache._device_step
    monkeypatch.setattr(freqcache_module, "pooled_lookup", lambda *a, **k: (log.append("lookup"), lookup(*a, **k))[1])
    monkeypatch.setattr(cache, "_on_side", lambda: (log.append("side"), on_side())[1])
    monkeypatch.setattr(cache, "_device_step", lambda name, *a, **k: (log.append(name), device_step(name, *a, **k))[1])
    training.model.register_forward_hook(lambda *_: log.append("dense"))
    training.model.register_full_backward_hook(lambda *_: log.append("backward"))
    for _ in range(4):
        training.prepare()
        training.train_step()
        training.step_index += 1
    log.clear()
    training.prepare()
    training.train_step()
    assert log.index("lookup") < log.index("side"), log
    assert log.index("lookup") < log.index("enter") < log.index("dense") < log.index("plan") < log.index("late"), log
    assert log.index("backward") < log.index("late"), log
    assert log.count("lookup") == 1 and log.count("plan") == 1 and log.count("late") == 1, log


@pytest.mark.slow
def test_with_a_warm_up_bound_timing_starts_once_the_cache_has_no_empty_slot_to_fill(tmp_path):
    """Until its empty slots are full a cache loads without evicting or writing back: cheaper
    than its steady state (issue 42, item 5). The warm-up goes on until none is left (or its
    bound) and the record says how many were left when timing started."""
    raw = tiny_scenario(run={"warmup_steps": 2, "warmup_max_steps": 60, "steps": 2, "repeats": 1})
    _, metrics = train_and_flush(raw, "freqcache", {"cache_ratio": 0.01}, tmp_path=tmp_path)
    _, unbounded = train_and_flush(tiny_scenario(run={"warmup_steps": 2, "steps": 2, "repeats": 1}), "freqcache",
                                   {"cache_ratio": 0.01}, tmp_path=tmp_path)
    assert unbounded["warmup_steps_run"] == 2 and unbounded["empty_slots_at_timing"] > 0  # said, not hidden
    assert metrics["warmup_steps_run"] > 2  # (here the Zipf tail fills a few slots a step up to the bound)
    assert metrics["empty_slots_at_timing"] < unbounded["empty_slots_at_timing"]


def test_captured_late_moves_read_the_captured_plan_s_lists_in_place_with_no_input_copy(monkeypatch):
    """With the steps captured (CUDA graphs, emulated here: a replay runs the step on the static
    inputs and leaves its outputs in the same tensors every time), the late moves' graph is
    captured on the plan graph's own move lists: its replays copy no input, and the plan's
    outputs are copied only for the slots (issue 47, item 5: six input copies and seven clones a
    step). Training still equals whole tables, so no list was overwritten before its moves."""
    import embbench.cache.freqcache as freqcache_module
    from embbench.data import Stream, SyntheticCriteo

    class EmulatedGraph(freqcache_module.CapturedStep):
        def _capture(self, step):
            self._step = step
            return None

        def _replay(self):
            out = self._step(*self.inputs)
            if self.output is None:
                self.output = out
            elif out is not None:
                for kept, new in zip(self.output, out, strict=True):
                    kept.copy_(new)

    monkeypatch.setattr(freqcache_module, "CapturedStep", EmulatedGraph)
    clones = []
    clone = torch.Tensor.clone
    tables = [TableSpec("t0", 3000, 8, 2, 1.05), TableSpec("t1", 500, 8, 1, 1.1)]
    data = SyntheticCriteo(tables, 0)
    batches = [data.batch(Stream.TRAIN, i, 16).sparse for i in range(14)]
    opt = EmbeddingOptimizer(type="rowwise_adagrad", lr=0.2)
    cache = FreqCache(_context(tables, opt, batches),
                      FreqCacheParams(cache_ratio=0.02, lookahead=4, profile_batches=2, belady_steps=0))
    cache._graphs_on = True  # as on CUDA
    reference = WholeTables(_context(tables, opt, batches))
    g = torch.Generator().manual_seed(7)
    got = []
    for i, features in enumerate(batches):
        cache.look_ahead(batches[i + 1 : i + 1 + cache.lookahead])
        out = cache(features)
        if i + 1 < len(batches):
            if i == 10:  # a steady step's clones of the plan's outputs
                monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: (clones.append(t), clone(t, *a, **k))[1])
            cache.prefetch(batches[i + 1])
            monkeypatch.setattr(torch.Tensor, "clone", clone)
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        cache.after_backward()
        cache.end_step()
        got.append(out.detach())
    for a, b in zip(got, _train(reference, batches, prefetch=False), strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(cache.flush(), reference.flush(), strict=True):
        torch.testing.assert_close(a, b)
    plan, late = cache._captured["plan"], cache._captured["late"]
    assert all(a is b for a, b in zip(late.inputs, plan.output[1:], strict=True))
    assert late.input_copies == 0 and plan.input_copies > 0
    assert [t is plan.output[0] for t in clones] == [True], "the plan's outputs but its slots were copied"

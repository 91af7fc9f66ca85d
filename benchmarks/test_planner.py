"""Micro-benchmark of freqcache's planners at the Criteo-Kaggle shape (batch 16384, 1.5 % cache): the host
reference (SlotPlanner) and the device planner of freqcache v3 (DevicePlanner, here on CPU tensors).

    .venv/bin/python -m pytest benchmarks/test_planner.py --benchmark-columns=median,iqr,max

One round is the host's bookkeeping of one step, as freqcache does it: a batch enters the
look-ahead window, the next one leaves it and is planned while the running one may still compute
(:class:`~embbench.cache.policy.SlotPlanner`'s ``expect`` and ``plan``). The batches' ids are
made and reduced to distinct rows before (on a GPU that is device work). The window holds 8
batches (freqcache's default ``lookahead``) or 32. At scale 1.0 the
planner holds the full 33.8M-row maps (about 0.5 GB), not the tables. Not part of the test
suite: speed is measured here, never asserted.
"""

import math

import numpy as np
import pytest

from embbench.cache.policy import SlotPlanner
from embbench.data import Stream, SyntheticCriteo, make_tables
from embbench.embedding import RowSpace

BATCH, CACHE_RATIO, PROFILE, ROUNDS = 16384, 0.015, 32, 30


@pytest.mark.parametrize("lookahead", [8, 32])
@pytest.mark.parametrize("scale", [0.1, 1.0])
def test_plan_one_batch(benchmark, scale, lookahead):
    tables = make_tables("criteo_kaggle", dim=128, scale=scale)
    space = RowSpace(tables)
    data = SyntheticCriteo(tables, seed=0)
    rows = [space.global_rows(data.batch(Stream.TRAIN, i, BATCH).sparse).numpy()
            for i in range(PROFILE + ROUNDS + 5 + lookahead + 1)]
    planner = SlotPlanner(space.num_rows, math.ceil(CACHE_RATIO * space.num_rows), len(rows[0]), "tinylfu",
                          decay_every=256)
    planner.profile(rows[:PROFILE])
    batches = [np.unique(r, return_counts=True) for r in rows[PROFILE:]]
    for unique, _ in batches[1 : 1 + lookahead]:
        planner.expect(unique, +1)
    state = {"i": 0, "running": planner.plan(batches[0], train=True).id}

    def step():
        i = state["i"] = state["i"] + 1
        planner.expect(batches[i + lookahead][0], +1)
        planner.expect(batches[i][0], -1)
        state["running"] = planner.plan(batches[i], train=True, running=state["running"]).id

    for _ in range(5):  # warm-up, not measured
        step()
    benchmark.pedantic(step, rounds=ROUNDS, iterations=1)
    c = planner.counters
    benchmark.extra_info.update(rows=space.num_rows, capacity=planner.capacity,
                                distinct_per_batch=c["unique_accesses"] / planner.plans,
                                hit_rate=c["hits"] / c["accesses"])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("lookahead", [8, 64])
@pytest.mark.parametrize("scale", [0.1, 1.0])
def test_device_plan_one_batch(benchmark, scale, lookahead, compiled):
    """freqcache v3's device planner, run on the CPU here (on a GPU the same ops run there):
    one round is one step's decisions, a batch entering the window and the next one planned;
    eager operations, or the steady-state steps compiled (torch.compile, as freqcache's
    ``compile`` does)."""
    import torch

    from embbench.cache.device_planner import DevicePlanner, StepKind

    tables = make_tables("criteo_kaggle", dim=128, scale=scale)
    space = RowSpace(tables)
    data = SyntheticCriteo(tables, seed=0)
    rows = [space.global_rows(data.batch(Stream.TRAIN, i, BATCH).sparse) for i in range(PROFILE + ROUNDS + 5 + lookahead + 1)]
    planner = DevicePlanner(space.num_rows, math.ceil(CACHE_RATIO * space.num_rows), len(rows[0]), lookahead,
                            torch.device("cpu"), decay_every=256)
    planner.profile(rows[:PROFILE])
    batches = rows[PROFILE:]
    numbers = {i: planner.enter(batches[i]) for i in range(1, 1 + lookahead)}
    state = {"i": 0, "running": planner.plan(batches[0], train=True).id}
    steady = StepKind(keeps_running=True, number="next")

    def plan(rows):
        return planner.device_step(rows, True, steady)

    enter_step, plan_step = ((torch.compile(planner.device_enter, dynamic=False), torch.compile(plan, dynamic=False))
                             if compiled else (planner.device_enter, plan))

    def step():
        i = state["i"] = state["i"] + 1
        numbers[i + lookahead] = planner.advance_entered()
        enter_step(batches[i + lookahead])
        pid, kind = planner.advance(True, state["running"], numbers.pop(i))
        assert kind == steady
        plan_step(batches[i])
        state["running"] = pid

    for _ in range(5):  # warm-up, not measured
        step()
    benchmark.pedantic(step, rounds=ROUNDS, iterations=1)
    c = planner.counters()
    benchmark.extra_info.update(rows=space.num_rows, capacity=planner.capacity, planner_device_bytes=planner.nbytes,
                                hit_rate=c["hits"] / c["accesses"])


@pytest.mark.parametrize("lookahead", [8, 64, "auto"])
@pytest.mark.parametrize("preset,dim", [("criteo_kaggle", 128), ("criteo_1tb_freq3", 64)])
def test_device_planner_bytes(benchmark, preset, dim, lookahead):
    """The device planner's metadata at full size (batch 16384, 1.5 %), built on meta tensors
    (no memory is allocated), against the cache's row bytes: the cached rows' and all slot
    tensors' (staging slots included), rows with rowwise-Adagrad state. The window is sized as
    freqcache sizes it, from the distinct rows of 8 profiled batches. Printed with ``-s``; also
    in the benchmark's extra_info."""
    import torch

    from embbench.cache.device_planner import DevicePlanner
    from embbench.cache.freqcache import cache_window

    tables = make_tables(preset, dim=dim, scale=1.0)
    space, data = RowSpace(tables), SyntheticCriteo(tables, seed=0)
    rows, ids = space.num_rows, BATCH * sum(t.bag_size for t in tables)
    capacity, row_bytes = math.ceil(CACHE_RATIO * rows), (dim + 1) * 4
    distinct = [len(space.global_rows(data.batch(Stream.TRAIN, i, BATCH).sparse).unique()) for i in range(8)]
    ahead, window_rows = cache_window(distinct, rows, capacity, ids, row_bytes, lookahead)
    meta = torch.device("meta")

    def build():
        with meta:
            return DevicePlanner(rows, capacity, ids, ahead, meta, decay_every=256, window_rows=window_rows)

    planner = benchmark.pedantic(build, rounds=1, iterations=1)
    slot_bytes, cached_bytes = (planner.num_slots + 1) * row_bytes, capacity * row_bytes
    benchmark.extra_info.update(planner_bytes=planner.nbytes, slot_tensor_bytes=slot_bytes, cached_row_bytes=cached_bytes,
                                window_bytes=planner.window.nbytes, sketch_bytes=planner.sketch.nbytes,
                                lookahead=ahead, window_rows=window_rows)
    print(f"\n{preset} dim {dim} look-ahead {lookahead} ({ahead} batches, {window_rows} rows each): planner "
          f"{planner.nbytes / 2**20:.0f} MiB (window {planner.window.nbytes / 2**20:.0f}, sketch "
          f"{planner.sketch.nbytes / 2**20:.0f}); {100 * planner.nbytes / cached_bytes:.0f} % of the cached rows' "
          f"{cached_bytes / 2**20:.0f} MiB, {100 * planner.nbytes / slot_bytes:.0f} % of the slot tensors' "
          f"{slot_bytes / 2**20:.0f} MiB")

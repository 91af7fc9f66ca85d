"""The tier model (embbench.cache.tiers): the caches run row by row against direct
simulations one row at a time, the host page cache against a direct page cache, the
invariants between the tiers, and `embbench curve --tiers`."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from embbench.cache.curve import min_hits, min_trace, stack_trace, step_rows
from embbench.cache.tiers import TierSizes, dram_tier, hbm_moves, read_tiers, tier_model
from embbench.disk.layout import PageLayout
from tests.test_curve import _cli  # `embbench ARGS` in this process

POOL = 12  # rows of the small streams


@st.composite
def streams(draw, max_steps: int = 9):
    """Steps of ids from a small pool (rows recur, often with several ids in a step)."""
    pool = draw(st.integers(1, POOL))
    return [np.array(draw(st.lists(st.integers(0, pool - 1), max_size=7)), dtype=np.int64)
            for _ in range(draw(st.integers(1, max_steps)))]


def direct_stack(steps, capacity: int, policy: str, tie: dict) -> list[tuple[set, set]]:
    """LRU or LFU one row at a time: the cache holds the ``capacity`` rows ranked first by
    (uses so far for LFU, last use, ``tie[(step, row)]``); each step's missed rows and the
    rows that leave after it."""
    key: dict[int, tuple] = {}
    cached: set[int] = set()
    out = []
    for t, ids in enumerate(steps):
        rows = set(ids.tolist())
        for row in rows:
            key[row] = (key[row][0] + 1 if row in key and policy == "lfu" else 0, t, tie[(t, row)])
        kept = set(sorted(key, key=key.__getitem__, reverse=True)[:capacity])
        out.append((rows - cached, (cached | rows) - kept))
        cached = kept
    return out


def direct_min(steps, capacity: int) -> list[tuple[set, set]]:
    """Belady's MIN with bypass one row at a time: after a step the cache keeps the rows used
    soonest, then with more ids then, then (rows with the same future) those that joined
    later, then the higher row."""
    uses = [dict(zip(*np.unique(ids, return_counts=True))) for ids in steps]
    upcoming, following = {}, [{} for _ in steps]
    for t in range(len(steps) - 1, -1, -1):
        for row, count in uses[t].items():
            following[t][row] = upcoming.get(row, (len(steps), 0))
            upcoming[row] = (t, -count)
    cached: dict[int, tuple] = {}
    out = []
    for t, rows in enumerate(uses):
        missed = set(rows) - set(cached)
        for row in rows:
            cached[row] = (*following[t][row], -t, -row)
        kept = sorted(cached, key=cached.__getitem__)[:capacity]
        out.append((missed, set(cached) - set(kept)))
        cached = {row: cached[row] for row in kept}
    return out


def traced(s, trace) -> list[tuple[set, set]]:
    out = []
    for t in range(s.num_steps):
        here = s.step(t)
        assert len(set(trace.evicted[t].tolist())) == len(trace.evicted[t])  # a row leaves once
        out.append((set(s.rows[here][trace.missed[here]].tolist()), set(trace.evicted[t].tolist())))
    return out


@settings(max_examples=200, deadline=None)
@given(streams(), st.integers(0, POOL), st.sampled_from(["lru", "lfu"]), st.randoms(use_true_random=False))
def test_stack_trace_equals_a_direct_simulation(steps, capacity, policy, rnd):
    s = step_rows(steps)
    tie = np.array(rnd.sample(range(len(s.rows)), len(s.rows)), dtype=np.int64)  # distinct: a strict order
    ties = {(int(t), int(r)): v for t, r, v in zip(s.step_of(), s.rows, tie)}
    assert traced(s, stack_trace(s, capacity, policy, tie=tie)) == direct_stack(steps, capacity, policy, ties)


@settings(max_examples=200, deadline=None)
@given(streams(), st.integers(0, POOL))
def test_min_trace_equals_a_direct_simulation_and_min_hits(steps, capacity):
    s = step_rows(steps)
    trace = min_trace(s, capacity)
    assert traced(s, trace) == direct_min(steps, capacity)
    hits, accesses, distinct_hits, distinct = min_hits(s, capacity)
    assert (accesses - int(s.counts[trace.missed].sum()), distinct - int(trace.missed.sum())) == (hits, distinct_hits)


def test_a_stack_trace_averages_to_the_curve():
    """Random ties: the hits of many seeds average to stack_hits' exact expectation."""
    from embbench.cache.curve import stack_hits

    rng = np.random.default_rng(3)
    steps = [rng.integers(0, 40, 30) for _ in range(12)]
    s = step_rows(steps)
    for policy in ("lru", "lfu"):
        expected = stack_hits(s, [10], policy)[1][0]
        seen = [len(s.rows) - stack_trace(s, 10, policy, seed=seed).missed.sum() for seed in range(300)]
        assert np.mean(seen) == pytest.approx(expected, rel=0.03)


# -- the host page cache -------------------------------------------------------------------


def direct_dram(steps, moves, rows_per_page: int, capacity: int, policy: str, seed: int) -> dict:
    """The host cache one page at a time (rows that share pages: ``rows_per_page`` > 1, a
    write to a page not held reads it first): pages read and written, and the ids and rows
    the device loads that the cache holds. LRU's ties are the draws of ``seed``, one per
    (step, page) in step order as :func:`stack_trace` draws them."""
    batches = []
    for ids, (loaded, written) in zip(steps, moves):
        weight = {int(r): int((ids == r).sum()) for r in loaded}
        pages: dict[int, list[int]] = {}  # page -> [ids loaded from it, rows written to it]
        for r in loaded:
            pages.setdefault(int(r) // rows_per_page, [0, 0])[0] += max(1, weight[int(r)])
        for r in written:
            pages.setdefault(int(r) // rows_per_page, [0, 0])[1] += 1
        batches.append((pages, weight))
    draws = iter(np.random.default_rng(seed).random(sum(len(p) for p, _ in batches)))
    ties = {(t, page): next(draws) for t, (pages, _) in enumerate(batches) for page in sorted(pages)}
    following: list[dict] = [{} for _ in batches]
    upcoming: dict[int, tuple] = {}
    for t in range(len(batches) - 1, -1, -1):
        for page, (ids, rows) in batches[t][0].items():
            following[t][page] = upcoming.get(page, (len(batches), 0))
            upcoming[page] = (t, -(ids + rows))
    key: dict[int, tuple] = {}
    cached: set[int] = set()
    dirty: set[int] = set()
    c = dict(pages_read=0, pages_written=0, dram_hit_ids=0, dram_hit_rows=0, page_hits=0)
    for t, (pages, weight) in enumerate(batches):
        for page, (ids, rows) in pages.items():
            hit = page in cached
            c["page_hits"] += hit
            c["pages_read"] += not hit and (ids > 0 or rows_per_page > 1)
            key[page] = (t, ties[(t, page)]) if policy == "lru" else (*following[t][page], -t, -page)
        for r, w in weight.items():
            if r // rows_per_page in cached:
                c["dram_hit_ids"] += w
                c["dram_hit_rows"] += w > 0
        held = cached | set(pages)
        kept = set(sorted(held, key=key.__getitem__, reverse=policy == "lru")[:capacity])
        dirty |= {page for page, (_, rows) in pages.items() if rows}
        c["pages_written"] += len((held - kept) & dirty)
        dirty -= held - kept
        cached = kept
    return c


@settings(max_examples=150, deadline=None)
@given(streams(), st.integers(1, POOL), st.integers(1, 6), st.sampled_from(["lru", "lfu", "min"]),
       st.sampled_from(["lru", "min"]), st.integers(1, 3), st.integers(0, 3))
def test_the_host_cache_equals_a_direct_page_cache(steps, hbm, dram, hbm_policy, policy, rows_per_page, seed):
    s = step_rows(steps)
    moves = hbm_moves(s, hbm, hbm_policy, seed)
    layout = PageLayout(POOL, 4096 // rows_per_page)
    c = dram_tier(s, moves, layout, dram, policy, seed=seed)
    expected = direct_dram(steps, moves, rows_per_page, dram, policy, seed)
    assert {k: getattr(c, k) for k in expected} == expected


def test_rows_larger_than_a_page_move_their_pages_together():
    """A row of 2.5 pages takes 3: each one the cache misses is 3 pages read; the cache holds
    whole rows (its pages over 3)."""
    steps = [np.array([0, 1]), np.array([2]), np.array([0])]
    s = step_rows(steps)
    moves = [(np.array([0, 1]), np.empty(0, np.int64)), (np.array([2]), np.array([0, 1])), (np.array([0]), np.array([2]))]
    c = dram_tier(s, moves, PageLayout(3, 10240), capacity_pages=7, policy="lru")  # 2 rows' pages
    # step 0 reads rows 0, 1; step 1 reads row 2 and writes 0, 1 (held: no read); row 0 or 1 leaves
    assert c.pages_read in (9, 12) and c.pages_read % 3 == 0 and c.pages_written % 3 == 0


@settings(max_examples=100, deadline=None)
@given(streams(), st.integers(1, POOL), st.integers(1, 6), st.sampled_from(["lru", "lfu", "min"]), st.integers(1, 3))
def test_min_hits_at_least_as_many_pages_as_lru_and_writes_only_what_was_made_dirty(steps, hbm, dram, hbm_policy, rows_per_page):
    s = step_rows(steps)
    moves = hbm_moves(s, hbm, hbm_policy)
    layout = PageLayout(POOL, 4096 // rows_per_page)
    lru, best = (dram_tier(s, moves, layout, dram, p) for p in ("lru", "min"))
    assert best.page_hits >= lru.page_hits
    made_dirty = sum(len(np.unique(written // rows_per_page)) for _, written in moves)
    assert lru.pages_written <= made_dirty and best.pages_written <= made_dirty


# -- the whole model -----------------------------------------------------------------------


def _freqcache(steps, num_rows: int, profile: int, warmup: int):
    from embbench.cache.sweep import freqcache_policy

    counted = len(steps) - profile - warmup
    return freqcache_policy(lambda i: steps[min(i, len(steps) - 1)], num_rows, max(len(b) for b in steps), profile, warmup,
                            counted)


def _section(steps, num_rows, sizes, skip, freqcache=None, **kw) -> dict:
    policies = ("lru", "lfu", "min") + (("freqcache",) if freqcache else ())
    return tier_model(steps, num_rows, 68, sizes, policies, skip, freqcache=freqcache, **kw)


def test_overall_rates_are_the_hbm_miss_share_times_the_conditional_ones():
    rng = np.random.default_rng(0)
    steps = [np.minimum(rng.zipf(1.3, 300) - 1, 2999) for _ in range(24)]
    section = _section(steps, 3000, TierSizes(0.25, 0.05), 8, _freqcache(steps, 3000, 4, 4), iops=1000.0, step_ms=2.0,
                       profile=4)
    assert len(section["entries"]) == 24  # 4 device policies, 2 host policies, 3 layouts
    for e in section["entries"]:
        hbm, dram, nvme = e["hbm"], e["dram"], e["nvme"]
        assert dram["hit_rate"] == pytest.approx((1 - hbm["hit_rate"]) * dram["conditional_hit_rate"])
        assert dram["unique_hit_rate"] == pytest.approx((1 - hbm["unique_hit_rate"]) * dram["unique_conditional_hit_rate"])
        assert nvme["bytes_read_per_step"] == 4096 * nvme["pages_read_per_step"]
        assert nvme["read_ms_per_step"] == pytest.approx(nvme["pages_read_per_step"] / 1000 * 1000)
        assert nvme["step_ratio"] == pytest.approx(nvme["read_ms_per_step"] / 2.0)
    by = {(e["hbm_policy"], e["dram_policy"]): e for e in section["entries"] if e["layout"] == "id"}
    assert by[("min", "min")]["hbm"]["unique_hit_rate"] >= by[("lru", "min")]["hbm"]["unique_hit_rate"]


def test_a_stream_that_fits_the_device_cache_reads_nothing_from_the_drive():
    rng = np.random.default_rng(1)
    steps = [rng.integers(0, 50, 80) for _ in range(12)]  # 50 rows, all used in every step
    section = _section(steps, 1000, TierSizes(0.3, 0.1), 4, _freqcache(steps, 1000, 2, 2), iops=5000.0)
    assert {e["hbm_policy"] for e in section["entries"]} == {"lru", "lfu", "min", "freqcache"}
    for e in section["entries"]:
        assert e["hbm"]["hit_rate"] == 1 and e["nvme"]["pages_read_per_step"] == 0, e["hbm_policy"]
        assert e["nvme"]["pages_written_per_step"] == 0 and e["nvme"]["read_ms_per_step"] == 0


@pytest.mark.parametrize("planner", ["device", "host"])
def test_freqcache_tells_the_moves_its_counters_count(planner):
    """The rows the planner says it loads and writes back are as many as its counters count."""
    from embbench.cache.sweep import Workload, _drive_device, _drive_host

    rng = np.random.default_rng(2)
    w = Workload(alpha=1.05, rows=3000, cache_ratio=0.02, batch_ids=256, planner=planner)
    batches = [np.minimum(rng.zipf(1.2, 256) - 1, 2999) for _ in range(16)]
    told: dict[int, tuple] = {}

    def moves(i, loaded, written):
        assert i not in told and len(np.unique(loaded)) == len(loaded) and len(np.unique(written)) == len(written)
        told[i] = (len(loaded), len(written))

    if planner == "device":
        c = _drive_device(w, batches, 60, 2, 256, 4, 14, 0, 0, moves)
    else:
        c = _drive_host(w, batches, 60, 2, 4, 14, 0, 0, moves)
    assert told[3] == (60, 0)  # the preload, as the last profiled batch's
    assert sum(told[i][0] for i in range(4, 14)) == c["rows_loaded"]
    assert sum(told[i][1] for i in range(4, 14)) == c["rows_written_back"] > 0


# -- the command ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, says", [
    ("hbm=150%,dram=10%", "hbm=150%: a share must be above 0 and at most 100%"),
    ("hbm=1.5%,dram=abc", "dram=abc: not a share"),
    ("dram=10%", "lacks hbm"),
    ("hbm=1%,dram=0", "dram=0: a share must be above 0"),
    ("hbm=1%,dram=2%,hbm=3%", "hbm given twice"),
    ("hbm=1%,disk=5%", "'disk=5%'"),
])
def test_tiers_flag_errors_name_the_flag_and_the_value(capsys, value, says):
    code, _, stderr = _cli(capsys, "curve", "scenarios/smoke.yaml", "--tiers", value)
    assert code == 2 and "--tiers" in stderr and says in stderr, stderr


def test_iops_and_step_flags_are_checked(capsys, tmp_path):
    code, _, stderr = _cli(capsys, "curve", "scenarios/smoke.yaml", "--tiers", "hbm=1%,dram=5%", "--iops",
                           f"measured:{tmp_path / 'nope'}")
    assert code == 2 and "--iops" in stderr and f"measured:{tmp_path / 'nope'}: " in stderr and "no such folder" in stderr
    for bad in ("-3", "1e-300", "nan", "inf", "1e300"):  # a tiny rate overflowed the model (issue 50, 8)
        code, _, stderr = _cli(capsys, "curve", "scenarios/smoke.yaml", "--tiers", "hbm=1%,dram=5%", "--iops", bad)
        assert code == 2 and "--iops" in stderr and "must be 1 to 1e+09 reads a second" in stderr, stderr
    code, _, stderr = _cli(capsys, "curve", "scenarios/smoke.yaml", "--tiers", "hbm=1%,dram=5%", "--iops", "measured:")
    assert code == 2 and "measured:: names no folder" in stderr  # not the working directory, without a word
    code, _, stderr = _cli(capsys, "curve", "scenarios/smoke.yaml", "--iops", "1000")
    assert code == 2 and "give --tiers too" in stderr
    code, _, stderr = _cli(capsys, "curve", "scenarios/smoke.yaml", "--tiers", "hbm=1%,dram=5%", "--out", str(tmp_path / "c.csv"))
    assert code == 2 and "not a .csv" in stderr


def test_curve_tiers_prints_the_table_and_writes_the_section(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    out = tmp_path / "curve.json"
    code, stdout, stderr = _cli(capsys, "curve", "scenarios/smoke.yaml", "--warmup", "6", "--steps", "4", "--sizes", "0.05",
                                "--tiers", "hbm=60%,dram=10%", "--iops", "37000", "--step-ms", "3", "--out", str(out))
    assert code == 0, stderr
    assert "smoke: tiers, HBM 60% of rows" in stdout and ("keeps up" in stdout or "too slow" in stdout)
    section = read_tiers(out)
    assert section["format"] == "embbench-tiers-1" and section["iops"] == 37000 and section["step_ms"] == 3
    assert [(e["hbm_policy"], e["layout"], e["dram_policy"]) for e in section["entries"]] == [
        (p, f, d) for p in ("lru", "lfu", "freqcache", "min") for f in ("id", "frequency", "table_frequency", "coaccess")
        for d in ("lru", "min")]
    assert section["row_bytes"] == 68 and section["rows_per_page"] == 60 and section["counted_steps"] == 4
    damaged = json.loads(out.read_text())
    damaged["tiers"]["entries"][0]["dram"]["hit_rate"] = 1.5
    out.write_text(json.dumps(damaged))
    with pytest.raises(ValueError, match=r"entries\.0\.dram\.hit_rate"):
        read_tiers(out)


def test_the_table_s_numbers_have_two_significant_digits_and_units_that_scale():
    from embbench.cache.tiers import _duration, _number, _percent

    assert [_percent(r) for r in (0.973, 0.0052, 0.9996, 0.99999, 1e-9, 1.0, 0.0)] == [
        "97%", "0.52%", "99.96%", "99.999%", "0.00000010%", "100%", "0%"]  # near 100% the misses show
    assert [_number(n) for n in (0, 0.5, 9.94, 440, 37000, 1.26e6, 2.04e9)] == ["0", "0.50", "9.9", "440", "37k", "1.3M", "2.0G"]
    assert [_duration(ms) for ms in (0.0341, 12.3, 2500)] == ["34 µs", "12 ms", "2.5 s"]


def test_freqcache_is_simulated_once_a_size_for_the_curve_and_the_tiers(monkeypatch):
    from embbench.cache import sweep

    calls = []
    real = sweep.simulate
    monkeypatch.setattr(sweep, "simulate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = np.random.default_rng(4)
    steps = [np.minimum(rng.zipf(1.2, 200) - 1, 999) for _ in range(12)]
    point = _freqcache(steps, 1000, 4, 2)
    first, again = [], []
    assert point(0.05, lambda *m: first.append(m)) == point(0.05, lambda *m: again.append(m))
    assert len(calls) == 1 and len(first) == len(again) > 0


def test_iops_measured_on_a_folder_is_the_drive_s_rate_at_32_in_flight(tmp_path, monkeypatch):
    from embbench.cache import tiers
    from embbench.disk import probe

    calls = []

    def fake(path, seconds, depths, file_bytes, **kw):
        calls.append((path, depths))
        return probe.DriveProbe(str(path), "ext4", "/dev/x", "r", file_bytes, None,
                                [probe.DepthRate(32, 74_000, 2.0)], [probe.DepthRate(32, 300_000, 1.0)], (0, 0), 2)

    monkeypatch.setattr(probe, "measure_drive", fake)
    assert tiers.parse_iops(f"measured:{tmp_path}") == 37_000 and calls == [(str(tmp_path), (32,))]


@pytest.mark.slow  # a fresh interpreter importing embbench (over 3 s on 2 cores)
def test_sigterm_while_iops_are_measured_leaves_no_scratch_file(tmp_path):
    """Issue 50, 8: `--iops measured:PATH` measures while the arguments are parsed; SIGTERM then
    (before, the handler came after the parsing) unwinds and removes the probe's scratch file."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from embbench.disk.pagefile import MEMORY_FILESYSTEMS, mount_of

    if mount_of(tmp_path).filesystem in MEMORY_FILESYSTEMS:
        pytest.skip("the temporary folder is in memory: no drive to measure there")
    root, folder = Path(__file__).parents[1], tmp_path
    command = subprocess.Popen([sys.executable, "-m", "embbench", "curve", "scenarios/smoke.yaml", "--tiers",
                                "hbm=1%,dram=5%", "--iops", f"measured:{folder}"], cwd=root,
                               env=dict(os.environ, PYTHONPATH=str(root)), stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if list(folder.glob(".embbench-disk-probe-*.pages")):
                break
            time.sleep(0.02)
        assert list(folder.glob(".embbench-disk-probe-*.pages")), "the probe never started"
        command.send_signal(signal.SIGTERM)
        command.wait(timeout=60)
    finally:
        command.kill()
    assert command.returncode == 130
    assert not list(folder.glob(".embbench-disk-probe-*"))


def test_freqcache_gets_the_hbm_share_less_its_staging_slots_and_none_where_they_fill_it():
    """Issue 48, item 5: freqcache holds two batches' rows in staging slots beside its cache; the
    model's hbm share holds both, so its cache is the share less the staging."""
    rng = np.random.default_rng(3)
    steps = [np.minimum(rng.zipf(1.3, 100) - 1, 1999) for _ in range(16)]
    asked = []
    real = _freqcache(steps, 2000, 4, 4)

    def freqcache(ratio, moves):
        asked.append(ratio)
        return real(ratio, moves)

    section = _section(steps, 2000, TierSizes(0.2, 0.1), 8, freqcache)
    assert section["hbm_rows"] == 400 and section["freqcache_cache_rows"] == 400 - 2 * 100
    assert section["freqcache_slots"] == 400 and asked == [200 / 2000]
    small = _section(steps, 2000, TierSizes(0.05, 0.1), 8, freqcache)  # 100 rows: less than 200 staging slots
    assert "freqcache" not in {e["hbm_policy"] for e in small["entries"]} and small["freqcache_cache_rows"] == 0
    with pytest.raises(ValueError, match="fewer than freqcache's 200 staging slots"):
        tier_model(steps, 2000, 68, TierSizes(0.05, 0.1), ("freqcache",), 8, freqcache=freqcache)


def test_the_frequency_layout_reads_fewer_pages_and_amplifies_less_than_id_order():
    """Hot rows spread over the ids (a hashed id space): in id order each sits in a page of
    cold rows; the frequency layout packs the profile's hot rows together."""
    rng = np.random.default_rng(5)
    spread = rng.permutation(30_000)
    steps = [spread[np.minimum(rng.zipf(1.05, 600) - 1, 29_999)] for _ in range(40)]
    section = _section(steps, 30_000, TierSizes(0.01, 0.05), 16, profile=16)
    by = {(e["hbm_policy"], e["dram_policy"], e["layout"]): e["nvme"] for e in section["entries"]}
    for policy in ("lru", "lfu", "min"):
        for host in ("lru", "min"):
            ids, frequency = by[(policy, host, "id")], by[(policy, host, "frequency")]
            assert frequency["pages_read_per_step"] < ids["pages_read_per_step"]
            assert max(frequency["read_amplification"], ids["read_amplification"]) <= 4096 / 68
        # under LRU, the store's host policy, a page read also brings more of the rows needed with it
        assert by[(policy, "lru", "frequency")]["read_amplification"] < by[(policy, "lru", "id")]["read_amplification"]

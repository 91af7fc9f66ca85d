"""Cache curves (embbench.cache.curve): each policy's vectorised pass against a direct
simulation of the same policy, one row at a time."""

import heapq

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from embbench.cache.curve import measure, min_hits, stack_hits, step_rows, to_csv
from embbench.cache.sweep import freqcache_policy
from embbench.metrics import belady_hit_rates


def reference_belady(steps: list[torch.Tensor], capacity: int, skip: int = 0,
                     prefilled: bool = False) -> tuple[float | None, float | None]:
    """embbench.metrics.belady_hit_rates as it was written first: a heap of ranked rows,
    one row at a time (the reference of the vectorised one)."""
    unique_counts = []
    for ids in steps:
        rows, counts = torch.unique(ids, return_counts=True)
        unique_counts.append(dict(zip(rows.tolist(), counts.tolist())))
    # A row's rank after each step: (when it is next used, minus its ids then); lower is kept.
    never = (len(steps), 0)
    next_use: list[dict[int, tuple[int, int]]] = [{} for _ in steps]
    upcoming: dict[int, tuple[int, int]] = {}
    for t in range(len(steps) - 1, -1, -1):
        for row, count in unique_counts[t].items():
            next_use[t][row] = upcoming.get(row, never)
            upcoming[row] = (t, -count)
    cached: dict[int, tuple[int, int]] = {}  # row -> its rank
    heap: list[tuple[int, int, int]] = []  # (minus the rank, row): the worst on top; stale entries are skipped
    hits = accesses = distinct_hits = distinct = 0
    for t, rows in enumerate(unique_counts):
        counted = t >= skip
        distinct += len(rows) if counted else 0
        missing: list[int] = []
        for row, count in rows.items():
            accesses += count if counted else 0
            if row in cached:
                hits += count if counted else 0
                distinct_hits += counted
                when, more = cached[row] = next_use[t][row]
                heapq.heappush(heap, (-when, -more, row))
            else:
                missing.append(row)
        # After the step the cache keeps the best-ranked rows: admit a missing row only in
        # place of a cached one ranked worse (or into a free slot).
        for row in sorted(missing, key=lambda r: next_use[t][r]):
            if len(cached) < capacity and prefilled and counted:
                hits += rows[row]
                distinct_hits += 1
            if len(cached) >= capacity:
                while cached.get(heap[0][2]) != (-heap[0][0], -heap[0][1]):
                    heapq.heappop(heap)  # stale
                if (-heap[0][0], -heap[0][1]) <= next_use[t][row]:
                    continue
                del cached[heapq.heappop(heap)[2]]
            when, more = cached[row] = next_use[t][row]
            heapq.heappush(heap, (-when, -more, row))
    if not accesses:
        return None, None
    return hits / accesses, distinct_hits / distinct


@st.composite
def id_streams(draw, max_steps: int = 10):
    """Steps of ids from a small pool (rows recur, often with several ids in a step)."""
    pool = draw(st.integers(1, 12))
    return [draw(st.lists(st.integers(0, pool - 1), min_size=0, max_size=8)) for _ in range(draw(st.integers(1, max_steps)))]


@settings(max_examples=300, deadline=None)
@given(id_streams(), st.integers(1, 10), st.integers(0, 4), st.booleans())
def test_belady_equals_the_reference(steps, capacity, skip, prefilled):
    stream = [torch.tensor(s, dtype=torch.long) for s in steps]
    assert belady_hit_rates(stream, capacity, skip, prefilled) == reference_belady(stream, capacity, skip, prefilled)


def test_belady_counts_on_a_known_stream():
    s = step_rows([np.array([1, 2]), np.array([3, 1]), np.array([2, 3]), np.array([1, 1])])
    assert min_hits(s, 2) == (3, 8, 3, 7)
    assert min_hits(s, 0) == (0, 8, 0, 7)  # a cache of nothing hits nothing


def direct_stack_policy(steps: list[list[int]], capacity: int, policy: str, order: dict[int, int]) -> tuple[int, int]:
    """LRU (an ordered cache: a step's rows move to the end, ``order`` ascending, the front
    is evicted) or LFU (after each step the cache keeps the best of itself and the step's
    rows by uses so far, last use, ``order``), one row at a time: (hits, distinct hits)."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    uses: dict[int, int] = {}
    last: dict[int, int] = {}
    hits = distinct_hits = 0
    for t, ids in enumerate(steps):
        rows = sorted(set(ids), key=order.__getitem__)
        for row in rows:
            if row in cache:
                hits += ids.count(row)
                distinct_hits += 1
        for row in rows:
            uses[row] = uses.get(row, 0) + 1
            last[row] = t
        if policy == "lru":
            for row in rows:
                cache.pop(row, None)
                cache[row] = None
            while len(cache) > capacity:
                cache.popitem(last=False)
        else:
            best = sorted(set(cache) | set(rows), key=lambda r: (uses[r], last[r], order[r]), reverse=True)
            cache = OrderedDict.fromkeys(best[:capacity])
    return hits, distinct_hits


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), max_size=5), min_size=1, max_size=6), st.sampled_from(["lru", "lfu"]))
def test_stack_distances_equal_a_direct_simulation(steps, policy):
    """The one-pass curve is the exact mean over every order of tied rows of the direct
    simulation with that order, at every capacity."""
    import itertools
    from fractions import Fraction

    rows = sorted(set().union(*map(set, steps)))
    capacities = list(range(0, len(rows) + 2))
    hits, distinct_hits = stack_hits(step_rows([np.array(s, dtype=np.int64) for s in steps]), capacities, policy)
    orders = list(itertools.permutations(range(len(rows))))
    for i, capacity in enumerate(capacities):
        runs = [direct_stack_policy(steps, capacity, policy, dict(zip(rows, o))) for o in orders]
        assert hits[i] == pytest.approx(float(Fraction(sum(h for h, _ in runs), len(runs))), abs=1e-9)
        assert distinct_hits[i] == pytest.approx(float(Fraction(sum(d for _, d in runs), len(runs))), abs=1e-9)


def _two_tables(steps: int = 12, seed: int = 0) -> list[np.ndarray]:
    """Global rows of a skewed stream over two tables (40 and 15 rows)."""
    rng = np.random.default_rng(seed)
    return [np.concatenate([rng.zipf(1.4, 30) % 40, 40 + rng.zipf(1.2, 30) % 15]) for _ in range(steps)]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 6))
def test_min_of_the_curve_equals_belady_and_bounds_the_others(seed, skip):
    steps = _two_tables(seed=seed)
    ratios = (0.02, 0.1, 0.3, 1.0)
    curve = measure(steps, {"a": 40, "b": 15}, ratios, ("lru", "lfu", "min"), skip=skip)
    for scope in curve["scopes"]:
        lo, hi = {"all": (0, 55), "a": (0, 40), "b": (40, 55)}[scope["name"]]
        stream = [torch.from_numpy(s[(s >= lo) & (s < hi)]) for s in steps]
        line = scope["policies"]["min"]
        for i, capacity in enumerate(scope["capacity"]):
            assert (line["hit_rate"][i], line["unique_hit_rate"][i]) == belady_hit_rates(stream, capacity, skip)
            for other in ("lru", "lfu"):  # MIN is the optimum per distinct row
                assert scope["policies"][other]["unique_hit_rate"][i] <= line["unique_hit_rate"][i] + 1e-12
        for policy in ("lru", "lfu", "min"):  # a larger cache holds what a smaller one does
            assert np.all(np.diff(scope["policies"][policy]["unique_hit_rate"]) >= -1e-12)


def test_freqcache_point_equals_the_sweep():
    """freqcache's point is the sweep's measurement of the same stream (and MIN's, beside it,
    the sweep's bound)."""
    from embbench.cache.sweep import Workload, simulate

    steps = _two_tables(steps=30, seed=3)
    rows = lambda i: steps[i]  # noqa: E731
    point = freqcache_policy(rows, 55, 60, profile_batches=4, warmup_steps=2, steps=8)
    curve = measure(steps[:14], {"a": 40, "b": 15}, (0.1, 0.3), ("freqcache", "min"), skip=6,
                    freqcache=point, freqcache_ratios=(0.3,))
    swept = simulate(Workload(alpha=0.0, rows=55, cache_ratio=0.3, batch_ids=60), profile_batches=4, warmup_steps=2,
                     steps=8, batch_rows=rows)
    everything = curve["scopes"][0]
    assert everything["policies"]["freqcache"]["hit_rate"] == [None, pytest.approx(swept["hit_rate"])]
    assert everything["policies"]["freqcache"]["unique_hit_rate"][1] == pytest.approx(swept["unique_hit_rate"])
    assert everything["policies"]["min"]["hit_rate"][1] == pytest.approx(swept["belady_hit_rate"])
    assert curve["scopes"][1]["policies"]["freqcache"]["hit_rate"] == [None, None]  # freqcache holds one cache


def test_curve_csv_has_a_line_per_scope_policy_and_ratio():
    curve = measure(_two_tables(), {"a": 40, "b": 15}, (0.1, 0.5), ("lru", "min"), skip=2, row_bytes=64)
    lines = to_csv(curve).splitlines()
    assert lines[0] == "scope,rows,policy,ratio,capacity_rows,hit_rate,unique_hit_rate,rows_moved_per_step,bytes_per_step"
    assert len(lines) == 1 + 3 * 2 * 2
    scope, rows, policy, ratio, capacity, *_, moved, moved_bytes = lines[1].split(",")
    assert (scope, rows, policy, ratio, capacity) == ("all", "55", "lru", "0.1", "6")
    assert float(moved_bytes) == pytest.approx(2 * 64 * float(moved))


def _tiny_scenario(tmp_path, **data) -> "Path":
    import yaml

    raw = {"name": "tiny", "data": {"preset": "criteo_kaggle", "scale": 0.0002, "embedding_dim": 16, "batch_size": 64, **data},
           "run": {"device": "cpu"}, "baseline": "device", "strategies": [{"name": "device"}]}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``embbench ARGS`` in this process: (exit status, stdout, stderr)."""
    from embbench.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:  # argparse refusing a flag
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_curve_command_prints_the_table_and_writes_json_and_csv(tmp_path, capsys, monkeypatch):
    import json

    monkeypatch.setenv("COLUMNS", "200")
    scenario = _tiny_scenario(tmp_path)
    out = tmp_path / "curve.json"
    code, stdout, stderr = _cli(capsys, "curve", str(scenario), "--warmup", "4", "--steps", "6", "--sizes", "0.01,0.1,0.5",
                                "--policies", "min,lru,freqcache", "--freqcache-sizes", "0.1", "--out", str(out))
    assert code == 0, stderr
    assert "LRU" in stdout and "MIN" in stdout and "worst tables" in stdout
    curve = json.loads(out.read_text())
    assert curve["format"] == "embbench-curve-1" and curve["ratios"] == [0.01, 0.1, 0.5]
    assert curve["policies"] == ["lru", "freqcache", "min"] and len(curve["scopes"]) == 27
    assert curve["scopes"][0]["policies"]["freqcache"]["hit_rate"][1] is not None
    code, _, stderr = _cli(capsys, "curve", str(scenario), "--out", str(tmp_path / "curve.txt"))
    assert code == 2 and "--out" in stderr and ".json or .csv" in stderr
    csv_out = tmp_path / "curve.csv"
    code, _, stderr = _cli(capsys, "curve", str(scenario), "--warmup", "4", "--steps", "6", "--sizes", "0.01,0.1,0.5",
                           "--policies", "lru,min", "--out", str(csv_out))
    assert code == 0, stderr
    assert csv_out.read_text().splitlines()[1].startswith("all,")
    other = tmp_path / "other.json"
    other.write_text("{}")
    code, _, stderr = _cli(capsys, "curve", str(scenario), "--policies", "lru", "--out", str(other))
    assert code == 2 and f"--out {other}: exists and was not made by `embbench curve`" in stderr


def test_curve_command_rejects_bad_input_naming_it(tmp_path, capsys):
    scenario = _tiny_scenario(tmp_path, batch_sise=64)
    code, _, stderr = _cli(capsys, "curve", str(scenario))
    assert code == 2 and f"{scenario}: data.batch_sise: unknown key" in stderr
    code, _, stderr = _cli(capsys, "curve", str(_tiny_scenario(tmp_path)), "--policies", "lru,arc")
    assert code == 2 and "--policies: unknown policy arc" in stderr
    code, _, stderr = _cli(capsys, "curve", str(_tiny_scenario(tmp_path)), "--sizes", "0.1,2")
    assert code == 2 and "--sizes: must be at most 1" in stderr


def test_the_knee_is_where_the_curve_bends_most():
    from embbench.cache.curve import knee

    def curve(rates):
        return {"ratios": [0.001, 0.01, 0.1, 1.0], "scopes": [{"name": "all", "policies": {"min": {"unique_hit_rate": rates}}}]}

    assert knee(curve([0.1, 0.8, 0.85, 0.9])) == (0.01, 0.8)
    assert knee(curve([0.1, 0.2, 0.3, 0.4])) is None  # straight on a log scale: no bend
    assert knee(curve([0.5, 0.5, 0.5, 0.5])) is None


def test_the_curve_table_marks_sizes_below_a_batch_and_scales_its_byte_units():
    """Issue 41: at the smoke's 0.1 %, 34 rows against ~1,365 distinct rows a batch, MIN per
    access is no bound; and a step moving 6 KiB read ``0.0..0.0`` MiB."""
    import io

    from rich.console import Console

    from embbench.cache.curve_scenario import curve_tables

    rng = np.random.default_rng(0)
    steps = [rng.integers(0, 1000, 200) for _ in range(8)]  # ~180 distinct rows a batch
    curve = measure(steps, {"a": 1000}, (0.01, 0.5), ("lru", "min"), skip=2, row_bytes=64)
    console = Console(width=200, record=True, file=io.StringIO())
    for shown in curve_tables(curve):
        console.print(shown)
    text = console.export_text()
    small, large = [line for line in text.splitlines() if "%" in line and "│" in line][:2]
    assert "10 *" in small and " *" not in large and "smaller than one batch's distinct rows" in text
    assert "KiB.." in text and "0.0..0.0" not in text


def test_measure_tells_its_progress_before_each_unit_of_work():
    """Issue 41: curve measured 116 s in silence. freqcache's simulations (the slow part) are
    told one by one before each starts, then every other policy scope by scope; each phase ends
    with all of its units done."""
    events = []

    def freqcache(ratio):
        events.append(("simulate", ratio))
        return 0.5, 0.4

    measure(_two_tables(), {"a": 40, "b": 15}, (0.1, 0.3, 0.5), ("lru", "freqcache", "min"), skip=2,
            freqcache=freqcache, freqcache_ratios=(0.1, 0.5), progress=lambda *told: events.append(told))
    slow, rest = dict.fromkeys(e[0] for e in events if e[0] != "simulate")
    assert slow == "freqcache's planner, one simulation per size"
    assert rest == "LRU, MIN at 3 sizes, all tables and then each table"
    assert events[:5] == [(slow, 0, 2), ("simulate", 0.1), (slow, 1, 2), ("simulate", 0.5), (slow, 2, 2)]
    assert events[5:] == [(rest, done, 6) for done in (0, 2, 4, 6)]  # 3 scopes of 2 policies


def test_the_curve_command_prints_a_line_per_phase_where_no_bar_is_drawn(tmp_path, capsys):
    code, stdout, stderr = _cli(capsys, "curve", str(_tiny_scenario(tmp_path)), "--warmup", "4", "--steps", "6",
                                "--sizes", "0.01,0.1", "--freqcache-sizes", "0.1")
    assert code == 0, stderr
    phases = [line for line in stdout.splitlines() if line.endswith("s so far)")]
    assert [p.split(" (")[0] for p in phases] == ["reading the training batches: 10 to do",
                                                  "freqcache's planner, one simulation per size: 1 to do",
                                                  "LRU, LFU, MIN at 2 sizes, all tables and then each table: 81 to do"]
    assert stdout.index(phases[-1]) < stdout.index("hit rate % per access")  # before the table


@given(st.one_of(st.just(0.0), st.floats(-(2.0**45), 2.0**45, allow_nan=False)))
def test_byte_units_scale_and_keep_two_significant_digits(n):
    """A byte count reads in the largest unit that leaves at least 1 (B below 1 KiB), the shown
    number within half a unit of its second significant digit (``0.0 MiB`` reads nothing)."""
    import math

    from embbench.recommend import format_bytes

    number, unit = format_bytes(n).split(" ")
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    shown = float(number.replace(",", ""))
    assert unit == "B" or abs(n) >= scale
    assert unit == "GiB" or abs(n) < 1024 * scale
    if n == 0:
        assert shown == 0
    else:
        value = abs(n) / scale
        assert abs(shown - n / scale) <= 0.5 * 10 ** (math.floor(math.log10(value)) - 1) * (1 + 1e-9)


def test_a_long_phase_prints_a_line_every_so_often_where_no_bar_is_drawn():
    import io

    from rich.console import Console

    from embbench.progress import PhaseProgress

    now = [0.0]
    console = Console(file=io.StringIO(), width=200)
    with PhaseProgress(console, live=False, clock=lambda: now[0], every=30) as shown:
        for done, at in enumerate((0, 20, 40, 50, 75)):  # 5 units of one phase, then a second phase
            now[0] = at
            shown("simulating", done, 5)
        now[0] = 80
        shown("simulating", 5, 5)
        shown("counting", 0, 2)
    assert console.file.getvalue().splitlines() == [
        "simulating: 5 to do (0 s so far)", "simulating: 2 of 5 done (40 s so far)",
        "simulating: 4 of 5 done (75 s so far)", "counting: 2 to do (80 s so far)"]

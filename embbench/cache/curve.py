"""Cache curves: the hit rates of LRU, LFU, freqcache and Belady's MIN against cache size, per
table and all tables together, and the curve file (JSON, CSV). The simulators, and how each
policy is modelled, are :mod:`embbench.cache.simulators` (re-exported here): a step's distinct
rows are looked up against the cache as it was after the previous step; hit rates are counted
per access (each id) and per distinct row of each step (what a cache has to move).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Callable, Literal

import numpy as np
from pydantic import Field
from typing_extensions import TypedDict

from embbench.bounds import Count, NonNegative, PositiveCount, Rate
from embbench.cache.simulators import (CacheTrace, MinKeys, StepRows, min_hits, min_trace, stack_hits, stack_trace,
                                       step_rows)
from embbench.inputs import open_schema as _open, read_json, validated

__all__ = ["CURVE_FORMAT", "CacheTrace", "CurveFile", "DEFAULT_RATIOS", "POLICIES", "Progress", "StepRows",
           "below_one_batch", "capacity_of", "knee", "measure", "min_hits", "min_trace", "read_curve", "stack_hits",
           "stack_trace", "step_rows", "to_csv"]

#: ``progress(what, done, total)``: ``done`` of ``total`` units of the work ``what`` are done.
Progress = Callable[[str, int, int], None]


#: Default cache sizes: 12 ratios of the rows, log-spaced from 0.1 % to 20 %.
DEFAULT_RATIOS = tuple(round(float(r), 6) for r in np.geomspace(0.001, 0.2, 12))
#: The policies of a curve, in the order they are shown.
POLICIES = ("lru", "lfu", "freqcache", "min")
CURVE_FORMAT = "embbench-curve-1"


def capacity_of(ratio: float, rows: int) -> int:
    """Cache rows for a ratio of ``rows``, as the sweep sizes freqcache's cache."""
    return max(1, min(rows, round(ratio * rows)))


def _rates(hits, distinct_hits, accesses: int, distinct: int, steps: int, row_bytes: int) -> dict[str, list]:
    """A policy's line of a curve: hit rates, and the rows (and bytes, in and out: a step
    updates every row it uses) a step moves for its distinct misses."""
    hits, distinct_hits = np.asarray(hits, np.float64), np.asarray(distinct_hits, np.float64)
    moved = (distinct - distinct_hits) / max(1, steps)
    return {"hit_rate": (hits / max(1, accesses)).tolist(), "unique_hit_rate": (distinct_hits / max(1, distinct)).tolist(),
            "rows_moved_per_step": moved.tolist(), "bytes_per_step": (2 * row_bytes * moved).tolist()}


def measure(steps: list[np.ndarray], table_rows: dict[str, int], ratios=DEFAULT_RATIOS, policies=POLICIES,
            skip: int = 0, row_bytes: int = 0, freqcache=None, freqcache_ratios=(), progress: Progress | None = None) -> dict:
    """The cache curves of an id stream: every policy's hit rates at each ratio of the rows,
    for all tables together (one cache of ``ratio`` of all rows, as freqcache holds) and for
    each table alone (``ratio`` of its rows).

    Args:
        steps: each step's global rows (table ``i``'s rows follow table ``i - 1``'s, in the
            order of ``table_rows``).
        table_rows: each table's name and rows.
        skip: steps simulated before the counted ones (every policy starts empty).
        row_bytes: bytes of a row and its optimizer state (what a miss moves each way).
        freqcache: ``ratio -> (hit rate, unique hit rate)`` of freqcache's policy over the same
            counted steps (all tables together only: freqcache holds one cache), measured at
            ``freqcache_ratios``.
        progress: told of each unit of work before it starts, and when a phase is done
            (:data:`Progress`): freqcache's simulations, then every other policy of every scope.
    """
    progress = progress or (lambda what, done, total: None)
    counted = len(steps) - skip
    if counted <= 0:
        raise ValueError(f"a curve needs counted steps: {len(steps)} steps, {skip} of them before counting")
    everything = step_rows(steps)
    starts = np.cumsum([0] + list(table_rows.values()))
    table_of = np.searchsorted(starts, everything.rows, side="right") - 1
    scopes = [("all", int(starts[-1]), everything)] + list(zip(table_rows, table_rows.values(),
                                                               everything.split(table_of, len(table_rows))))
    out = {"format": CURVE_FORMAT, "ratios": list(ratios), "policies": list(policies), "row_bytes": row_bytes,
           "warmup_steps": skip, "counted_steps": counted, "tables": dict(table_rows), "scopes": []}
    simulated = _freqcache_points(freqcache if "freqcache" in policies else None, ratios, freqcache_ratios, progress)
    others = [p for p in policies if p != "freqcache"]
    what = f"{', '.join(p.upper() for p in others)} at {len(ratios)} sizes, all tables and then each table"
    for done, (name, rows, s) in enumerate(scopes):
        progress(what, done * len(others), len(scopes) * len(others))
        window = slice(int(s.start[skip]), int(s.start[-1]))
        accesses, distinct = int(s.counts[window].sum()), window.stop - window.start
        capacities = [capacity_of(r, rows) for r in ratios]
        lines: dict[str, dict] = {}
        for policy in policies:
            if policy in ("lru", "lfu"):
                lines[policy] = _rates(*stack_hits(s, capacities, policy, skip), accesses, distinct, counted, row_bytes)
            elif policy == "min":
                keys, runs = MinKeys(s), {}
                for c in capacities:  # a small table's ratios share capacities
                    runs[c] = runs.get(c) or min_hits(s, c, skip, keys=keys)
                runs = [runs[c] for c in capacities]
                lines[policy] = _rates([r[0] for r in runs], [r[2] for r in runs], accesses, distinct, counted, row_bytes)
            elif policy == "freqcache":
                lines[policy] = _freqcache_line(simulated if name == "all" else {}, ratios, accesses, distinct, counted,
                                                row_bytes)
            else:
                raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
        out["scopes"].append({"name": name, "rows": rows, "accesses": accesses, "distinct": distinct,
                              "capacity": capacities, "policies": lines})
    if others:
        progress(what, len(scopes) * len(others), len(scopes) * len(others))
    return out


def _freqcache_points(freqcache, ratios, measured, progress: Progress) -> dict[float, tuple[float, float]]:
    """``ratio -> (hit rate, unique hit rate)`` of freqcache at the ``measured`` ratios (a whole
    simulation each: the slow part of a curve, so each is told to ``progress``)."""
    todo = [r for r in ratios if r in measured] if freqcache is not None else []
    what = "freqcache's planner, one simulation per size"
    points = {}
    for done, ratio in enumerate(todo):
        progress(what, done, len(todo))
        points[ratio] = freqcache(ratio)
    if todo:
        progress(what, len(todo), len(todo))
    return points


def _freqcache_line(points: dict, ratios, accesses: int, distinct: int, steps: int, row_bytes: int) -> dict:
    """freqcache's line from its ``points`` (None where not measured: every table alone, ratios
    not asked for)."""
    line: dict[str, list] = {k: [None] * len(ratios) for k in ("hit_rate", "unique_hit_rate", "rows_moved_per_step", "bytes_per_step")}
    for i, ratio in enumerate(ratios):
        if ratio not in points:
            continue
        hit, unique = points[ratio]
        point = _rates([hit * accesses], [unique * distinct], accesses, distinct, steps, row_bytes)
        for k in line:
            line[k][i] = point[k][0]
    return line


_Ratio = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=1)]


@_open
class _Line(TypedDict):
    """A policy's points, one per ratio (None: not measured, freqcache's line only)."""

    hit_rate: list[Rate | None]
    unique_hit_rate: list[Rate | None]
    rows_moved_per_step: list[NonNegative | None]
    bytes_per_step: list[NonNegative | None]


@_open
class _Scope(TypedDict):
    name: str
    rows: PositiveCount
    accesses: Count
    distinct: Count
    capacity: list[PositiveCount]
    policies: dict[str, _Line]


@_open
class CurveFile(TypedDict):
    """What :func:`measure` writes, with the bounds of :mod:`embbench.bounds`."""

    format: Literal["embbench-curve-1"]
    ratios: Annotated[list[_Ratio], Field(min_length=1)]
    policies: Annotated[list[Literal["lru", "lfu", "freqcache", "min"]], Field(min_length=1)]
    row_bytes: Count
    warmup_steps: Count
    counted_steps: PositiveCount
    tables: Annotated[dict[str, PositiveCount], Field(min_length=1)]
    scopes: list[_Scope]


def _inconsistency(curve: dict) -> tuple[str, str] | None:
    """The first key where a curve that passes :class:`CurveFile` contradicts itself, and why:
    its scopes are ``all`` and then each table, every line has a point per ratio, only
    freqcache's line has gaps."""
    ratios, tables = curve["ratios"], curve["tables"]
    if any(b <= a for a, b in zip(ratios, ratios[1:])):
        return "ratios", f"{ratios} do not ascend"
    names = [s["name"] for s in curve["scopes"]]
    if names != ["all", *tables]:
        return "scopes", f"are {names}; expected all and then each table ({', '.join(tables)})"
    for i, scope in enumerate(curve["scopes"]):
        if i and scope["rows"] != tables[scope["name"]]:
            return f"scopes.{i}.rows", f"{scope['rows']}, tables.{scope['name']} {tables[scope['name']]}"
        if len(scope["capacity"]) != len(ratios):
            return f"scopes.{i}.capacity", f"{len(scope['capacity'])} values for {len(ratios)} ratios"
        if sorted(scope["policies"]) != sorted(curve["policies"]):
            return f"scopes.{i}.policies", f"are {sorted(scope['policies'])}; the curve's are {curve['policies']}"
        for policy, line in scope["policies"].items():
            for key, values in line.items():
                if key in _Line.__annotations__ and len(values) != len(ratios):
                    return f"scopes.{i}.policies.{policy}.{key}", f"{len(values)} values for {len(ratios)} ratios"
                if key in _Line.__annotations__ and policy != "freqcache" and None in values:
                    return f"scopes.{i}.policies.{policy}.{key}", "null where every ratio was measured"
    return None


def read_curve(path: str | Path) -> dict:
    """An ``embbench curve`` JSON file, checked as a record is (:mod:`embbench.inputs`, then
    :class:`CurveFile` and its consistency); ValueError naming the file and the key otherwise."""
    path = Path(path)
    hint = "; write one with `embbench curve --out`"
    curve = read_json(path, "curve file")
    if curve.get("format") != CURVE_FORMAT:
        raise ValueError(f"{path}: not a curve file (format is not {CURVE_FORMAT}{hint})")
    curve = validated(CurveFile, curve, path, hint=f" (a damaged curve file{hint})")
    wrong = _inconsistency(curve)
    if wrong:
        raise ValueError(f"{path}: {wrong[0]}: {wrong[1]} (a damaged curve file{hint})")
    return curve


def to_csv(curve: dict) -> str:
    """One line per (scope, policy, ratio): the curve as a spreadsheet reads it."""
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    fields = ("hit_rate", "unique_hit_rate", "rows_moved_per_step", "bytes_per_step")
    writer.writerow(("scope", "rows", "policy", "ratio", "capacity_rows") + fields)
    for scope in curve["scopes"]:
        for policy, line in scope["policies"].items():
            for i, ratio in enumerate(curve["ratios"]):
                writer.writerow((scope["name"], scope["rows"], policy, ratio, scope["capacity"][i])
                                + tuple("" if line[f][i] is None else line[f][i] for f in fields))
    return buffer.getvalue()


def knee(curve: dict, policy: str = "min", scope: str = "all") -> tuple[float, float] | None:
    """Where a curve bends most, as ``(ratio, unique hit rate)``: of the sizes, the one farthest
    above the chord from the smallest to the largest on (log ratio, hit rate per distinct
    row) (Kneedle's rule): past it a larger cache gains little. None for a flat curve or
    fewer than three sizes."""
    line = next(s for s in curve["scopes"] if s["name"] == scope)["policies"].get(policy)
    if line is None or len(curve["ratios"]) < 3 or None in line["unique_hit_rate"]:
        return None
    x, y = np.log(curve["ratios"]), np.asarray(line["unique_hit_rate"])
    if y[-1] <= y[0]:
        return None
    above = (y - y[0]) / (y[-1] - y[0]) - (x - x[0]) / (x[-1] - x[0])
    i = int(np.argmax(above))
    return (curve["ratios"][i], float(y[i])) if above[i] > 0 else None


def below_one_batch(curve: dict) -> list[bool]:
    """Per ratio: whether the cache of all tables is smaller than one batch's distinct rows (on
    average over the counted batches). No batch-granular cache can hold such a batch, so there
    MIN per access is no bound (it may keep a few rows with many ids that a policy evicts):
    compare per distinct row."""
    everything = curve["scopes"][0]
    batch = everything["distinct"] / curve["counted_steps"]
    return [rows < batch for rows in everything["capacity"]]

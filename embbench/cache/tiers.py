"""The tier model (``embbench curve SCENARIO --tiers hbm=1.5%,dram=10%``): can a drive feed
this cache? Answered on the scenario's id stream in seconds, before a GPU is booked.

Three tiers, as freqcache with its rows in a file runs them (issue 43):

- **hbm**: the device cache of ``hbm`` of all rows, under each curve policy (LRU, LFU,
  freqcache, MIN), run row by row (:func:`~embbench.cache.curve.stack_trace`,
  :func:`~embbench.cache.curve.min_trace`, freqcache's planner): which rows each batch loads
  from host memory, and which it writes back (in training every row a batch uses is updated,
  so every row that leaves the device cache is written back).
- **dram**: a host cache of whole pages (the file is read a page at a time, so the store
  keeps pages), ``dram`` of the file's pages, LRU or MIN (Belady on the page stream), fed
  each batch with the pages of the rows the device loads (reads) and writes back (writes).
  A write makes its page dirty; a write to a page not held reads it first where the page
  holds other rows (a read-modify-write); a dirty page is written when it leaves.
- **nvme**: the drive: the pages the host cache misses (reads) and the dirty pages it lets
  go (writes), a batch; read amplification is the bytes of the pages read for rows the
  device needed over those rows' bytes (at most a page over a row: the pages read only to
  merge a written row are counted apart); the time a batch's reads take at ``--iops`` random reads a
  second, and against a measured step (``--step-ms``) the ratio: below 1 the drive keeps up.

A batch's pages are looked up against the host cache as it was after the previous batch,
as the curve looks up a batch's rows. Every tier starts empty (freqcache from its preload)
at the first batch, and is counted over the curve's counted batches.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import Field
from rich.table import Table
from typing_extensions import NotRequired, TypedDict

from embbench.bounds import Count, NonNegative, Positive, PositiveCount, Rate
from embbench.cache.curve import CacheTrace, StepRows, capacity_of, min_trace, read_curve, stack_trace, step_rows
from embbench.cache.device_planner import DevicePlanner
from embbench.disk.layout import PAGE, ROW_ORDERS, PageLayout, RowOrder
from embbench.inputs import open_schema as _open, validated
from embbench.recommend import format_bytes

__all__ = ["DRAM_POLICIES", "TIERS_FORMAT", "TierSizes", "TiersSection", "dram_tier", "hbm_moves", "measured_iops",
           "parse_iops", "parse_tiers", "read_tiers", "scenario_tiers", "tier_model", "tiers_table"]

TIERS_FORMAT = "embbench-tiers-1"
#: The host cache's policies, in the order they are shown.
DRAM_POLICIES = ("lru", "min")
#: A batch's moves at the device cache: the rows it loads, the rows it writes back.
Moves = list[tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class TierSizes:
    """``hbm``: the device cache, a share of all rows; ``dram``: the host cache, a share of the file's pages."""

    hbm: float
    dram: float


def _share(key: str, value: str) -> float:
    """``1.5%`` or ``0.015``: a share in (0, 1]."""
    text = value.strip()
    percent = text.endswith("%")
    try:
        share = float(text[:-1] if percent else text) / (100 if percent else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}={value}: not a share (write it as 1.5% or 0.015)") from None
    if not (0 < share <= 1):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{key}={value}: a share must be above 0 and at most 100%")
    return share


def parse_tiers(text: str) -> TierSizes:
    """``--tiers hbm=1.5%,dram=10%``: the device cache's share of the rows and the host cache's
    of the pages (an argparse type: argparse names the flag before the message)."""
    given: dict[str, float] = {}
    for item in text.split(","):
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals or key not in ("hbm", "dram"):
            raise argparse.ArgumentTypeError(f"{item.strip()!r} in {text!r}: expected hbm=SHARE,dram=SHARE (e.g. hbm=1.5%,dram=10%)")
        if key in given:
            raise argparse.ArgumentTypeError(f"{key} given twice in {text!r}")
        given[key] = _share(key, value)
    missing = [k for k in ("hbm", "dram") if k not in given]
    if missing:
        raise argparse.ArgumentTypeError(f"{text!r} lacks {' and '.join(missing)} (e.g. hbm=1.5%,dram=10%)")
    return TierSizes(**given)


#: ``--iops measured:PATH``: the reads a second measured on the drive that holds PATH.
MEASURED = "measured:"


def measured_iops(path: str) -> float:
    """``--iops measured:PATH``: random 4 KiB O_DIRECT reads a second of the drive that holds the
    folder PATH, 32 in flight (freqcache's ``io_depth``), measured now for two seconds
    (:func:`embbench.disk.probe.measure_drive`; ``embbench disk PATH`` shows more depths)."""
    from embbench.disk.probe import measure_drive

    if not path.strip():
        raise argparse.ArgumentTypeError(f"{MEASURED}: names no folder (measured:PATH, PATH a folder on the drive)")
    try:
        probe = measure_drive(path, seconds=2.0, depths=(32,), file_bytes=256 << 20, ceiling_seconds=0.5)
    except (OSError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"{MEASURED}{path}: {error}") from None
    if probe.drive is None:
        raise argparse.ArgumentTypeError(f"{MEASURED}{path}: no drive to measure there: {probe.problem}")
    return probe.drive[0].reads_per_s


def parse_iops(text: str) -> float:
    """``--iops 37000`` (random 4 KiB reads a second), or ``measured:PATH`` (:func:`measured_iops`)."""
    if text.startswith(MEASURED):
        return measured_iops(text[len(MEASURED):])
    try:
        iops = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of reads a second (or {MEASURED}PATH)") from None
    if not (IOPS_RANGE[0] <= iops <= IOPS_RANGE[1]):
        raise argparse.ArgumentTypeError(f"must be {IOPS_RANGE[0]:g} to {IOPS_RANGE[1]:g} reads a second, got {text}")
    return iops


#: What ``--iops`` takes: a read a second to far beyond any drive (a tiny rate overflowed the model).
IOPS_RANGE = (1.0, 1e9)


# -- the model -------------------------------------------------------------------------------


def _trace_moves(s: StepRows, trace: CacheTrace) -> Moves:
    return [(s.rows[s.step(t)][trace.missed[s.step(t)]], trace.evicted[t]) for t in range(s.num_steps)]


def hbm_moves(s: StepRows, capacity: int, policy: str, seed: int = 0, freqcache=None, ratio: float | None = None) -> Moves:
    """Each batch's moves at a device cache of ``capacity`` rows under ``policy`` (LRU's and
    LFU's ties drawn from ``seed``); freqcache's: its planner's, ``freqcache(ratio, moves)``
    (:func:`embbench.cache.sweep.freqcache_policy`), which plans from its profile on."""
    if policy in ("lru", "lfu"):
        return _trace_moves(s, stack_trace(s, capacity, policy, seed=seed))
    if policy == "min":
        return _trace_moves(s, min_trace(s, capacity))
    if policy == "freqcache":
        empty = np.empty(0, np.int64)
        moves: Moves = [(empty, empty)] * s.num_steps

        def told(i: int, loaded: np.ndarray, written: np.ndarray) -> None:
            if i < s.num_steps:  # the look-ahead's batches past the stream are not the model's
                moves[i] = (np.concatenate([moves[i][0], loaded]), np.concatenate([moves[i][1], written]))

        freqcache(ratio, told)
        return moves
    raise ValueError(f"unknown policy {policy!r}")


@dataclass
class _Totals:
    """Sums over the counted batches (ids, rows, pages)."""

    accesses: int = 0
    distinct: int = 0
    loaded_ids: int = 0
    loaded_rows: int = 0
    written_rows: int = 0
    dram_hit_ids: int = 0
    dram_hit_rows: int = 0
    page_accesses: int = 0
    page_hits: int = 0
    pages_read: int = 0
    pages_read_for_writes: int = 0  # (of pages_read) read only to merge a written row
    pages_written: int = 0
    rows_from_drive: int = 0


def dram_tier(s: StepRows, moves: Moves, layout: PageLayout, capacity_pages: int, policy: str, skip: int = 0,
              seed: int = 0, order: RowOrder | None = None) -> _Totals:
    """The host page cache of ``capacity_pages`` pages under ``policy`` (``lru``: ties from
    ``seed``; ``min``) on a device cache's ``moves``, summed over the batches from ``skip``,
    with the rows placed in the file by ``order`` (default: in id order).

    The cache holds *blocks*: a page, or the pages of one row where a row takes more than one
    (they always move together)."""
    per_block = layout.pages_per_row  # pages
    rows_per_block = layout.rows_per_page
    shared = rows_per_block > 1  # a write to a page not held must read it first
    place = order.place if order is not None else (lambda rows: rows)
    batches = []
    for t, (loaded, written) in enumerate(moves):
        here = s.step(t)
        ids = _ids_of(s, here, loaded)
        # a block appears once per id the device loads from it (its weight, as MIN breaks ties),
        # once per row written back, once at least
        batches.append(np.concatenate([np.repeat(place(loaded) // rows_per_block, np.maximum(ids, 1)),
                                       place(written) // rows_per_block]))
    p = step_rows(batches)
    blocks = max(1, capacity_pages // per_block)
    if policy == "lru":
        trace = stack_trace(p, blocks, "lru", seed=seed)
    elif policy == "min":
        trace = min_trace(p, blocks)
    else:
        raise ValueError(f"unknown host cache policy {policy!r}: one of {', '.join(DRAM_POLICIES)}")
    dirty = np.zeros(max(1, layout.rows // rows_per_block + 1), bool)
    c = _Totals()
    for t, (loaded, written) in enumerate(moves):
        here, at = s.step(t), p.step(t)
        held, missed = p.rows[at], trace.missed[at]
        read = np.zeros(len(held), bool)
        loaded_blocks = place(loaded) // rows_per_block
        read[np.searchsorted(held, loaded_blocks)] = True
        from_drive = missed[np.searchsorted(held, loaded_blocks)]
        dirty[place(written) // rows_per_block] = True
        leaving = trace.evicted[t]
        flushed = int(dirty[leaving].sum())
        dirty[leaving] = False
        if t < skip:
            continue
        ids = _ids_of(s, here, loaded)
        used = ids > 0  # the preload's rows are loaded, not used
        c.accesses += int(s.counts[here].sum())
        c.distinct += here.stop - here.start
        c.loaded_ids += int(ids.sum())
        c.loaded_rows += int(used.sum())
        c.written_rows += len(written)
        c.dram_hit_ids += int(ids[~from_drive].sum())
        c.dram_hit_rows += int((used & ~from_drive).sum())
        c.page_accesses += len(held)
        c.page_hits += int((~missed).sum())
        c.pages_read += per_block * int((missed & (read | shared)).sum())
        c.pages_read_for_writes += per_block * int((missed & ~read & shared).sum())
        c.pages_written += per_block * flushed
        c.rows_from_drive += int(from_drive.sum())
    return c


def _ids_of(s: StepRows, here: slice, rows: np.ndarray) -> np.ndarray:
    """The ids the step ``here`` has of each of ``rows`` (0 for a row it does not use)."""
    used, counts = s.rows[here], s.counts[here]
    if not len(used):
        return np.zeros(len(rows), np.int64)
    at = np.minimum(np.searchsorted(used, rows), len(used) - 1)
    return np.where(used[at] == rows, counts[at], 0)


def _rate(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _entry(c: _Totals, steps: int, row_bytes: int, iops: float | None, step_ms: float | None) -> dict:
    """One (device policy, host policy) line of the section."""
    reaching = c.loaded_ids  # ids that miss the device cache
    read_bytes, useful = c.pages_read * PAGE, c.rows_from_drive * row_bytes
    load_bytes = (c.pages_read - c.pages_read_for_writes) * PAGE  # the reads that bring rows the device needs
    read_ms = 1000 * c.pages_read / steps / iops if iops else None
    return {
        "hbm": {"hit_rate": _rate(c.accesses - reaching, c.accesses),
                "unique_hit_rate": _rate(c.distinct - c.loaded_rows, c.distinct),
                "rows_read_per_step": c.loaded_rows / steps, "rows_written_per_step": c.written_rows / steps,
                "bytes_read_per_step": c.loaded_rows * row_bytes / steps,
                "bytes_written_per_step": c.written_rows * row_bytes / steps},
        "dram": {"hit_rate": _rate(c.dram_hit_ids, c.accesses), "conditional_hit_rate": _rate(c.dram_hit_ids, reaching),
                 "unique_hit_rate": _rate(c.dram_hit_rows, c.distinct),
                 "unique_conditional_hit_rate": _rate(c.dram_hit_rows, c.loaded_rows),
                 "page_hit_rate": _rate(c.page_hits, c.page_accesses)},
        "nvme": {"pages_read_per_step": c.pages_read / steps, "pages_written_per_step": c.pages_written / steps,
                 "bytes_read_per_step": read_bytes / steps, "bytes_written_per_step": c.pages_written * PAGE / steps,
                 "pages_read_for_writes_per_step": c.pages_read_for_writes / steps,
                 "read_amplification": load_bytes / useful if useful else None,
                 "read_ms_per_step": read_ms,
                 "step_ratio": read_ms / step_ms if read_ms is not None and step_ms else None},
    }


def tier_model(steps: list[np.ndarray], num_rows: int, row_bytes: int, sizes: TierSizes, policies, skip: int = 0,
               seed: int = 0, freqcache=None, iops: float | None = None, step_ms: float | None = None,
               profile: int = 0, layouts=None, table_starts=(0,), samples: list[np.ndarray] | None = None) -> dict:
    """The ``tiers`` section of a curve file: every device policy of ``policies`` with every
    host policy of :data:`DRAM_POLICIES` and every file layout of ``layouts`` (default: all
    of :data:`~embbench.disk.layout.ROW_ORDERS`, less ``coaccess`` where ``samples`` is not
    given; ordered by the first ``profile`` batches, as freqcache's store orders its file;
    ``coaccess`` needs ``samples``, the sample of each id of those batches, and keeps the
    rows of the device cache freqcache would have, or of the ``hbm`` share without it,
    first), on ``steps`` (each batch's global rows), counted over the batches from ``skip``.
    ``freqcache``: its planner on the same batches (:func:`embbench.cache.sweep.freqcache_policy`),
    needed where ``policies`` has it; it gets the ``hbm`` share's rows less its staging slots
    (two batches' rows, which it holds beside its cache), and no entry where they leave none."""
    counted = len(steps) - skip
    if counted <= 0:
        raise ValueError(f"the tier model needs counted steps: {len(steps)} steps, {skip} of them before counting")
    layout = PageLayout(num_rows, row_bytes)
    hbm_rows, dram_pages = capacity_of(sizes.hbm, num_rows), capacity_of(sizes.dram, layout.pages)
    s = step_rows(steps)
    staging = DevicePlanner.slots_for(num_rows, 0, max(map(len, steps)))
    freqcache_rows = hbm_rows - staging  # its cache, within the hbm share with its staging slots
    if layouts is None:
        layouts = [name for name in ROW_ORDERS if name != "coaccess" or samples is not None]
    if "coaccess" in layouts and samples is None:
        raise ValueError("the coaccess layout needs the sample of each profiled id (samples=)")
    device_rows = freqcache_rows if "freqcache" in policies and freqcache_rows >= 1 else hbm_rows
    builders = {"id": lambda: None, "frequency": lambda: RowOrder.by_frequency(num_rows, steps[:profile]),
                "table_frequency": lambda: RowOrder.by_table_frequency(num_rows, steps[:profile], table_starts),
                "coaccess": lambda: RowOrder.by_coaccess(num_rows, steps[:profile], (samples or [])[:profile],
                                                         layout.rows_per_page, device_rows)}
    orders = {name: builders[name]() for name in layouts}
    entries = []
    for policy in policies:
        if policy == "freqcache" and freqcache_rows < 1:
            continue
        ratio = freqcache_rows / num_rows if policy == "freqcache" else sizes.hbm
        moves = hbm_moves(s, hbm_rows, policy, seed, freqcache, ratio)
        for name, order in orders.items():
            for host in DRAM_POLICIES:
                totals = dram_tier(s, moves, layout, dram_pages, host, skip, seed, order)
                entries.append({"hbm_policy": policy, "dram_policy": host, "layout": name,
                                **_entry(totals, counted, row_bytes, iops, step_ms)})
    if not entries:
        raise ValueError(f"hbm={100 * sizes.hbm:g}% holds {hbm_rows:,} rows: fewer than freqcache's {staging:,} staging "
                         "slots (two batches' rows), so no policy is left to model: give a larger hbm share")
    slots = hbm_rows if "freqcache" in policies and freqcache_rows >= 1 else None
    return {"format": TIERS_FORMAT, "hbm_ratio": sizes.hbm, "dram_ratio": sizes.dram, "hbm_rows": hbm_rows,
            "freqcache_slots": slots, "freqcache_cache_rows": max(0, freqcache_rows) if "freqcache" in policies else None,
            "dram_pages": dram_pages, "rows": num_rows, "pages": layout.pages, "row_bytes": row_bytes,
            "rows_per_page": layout.rows_per_page, "pages_per_row": layout.pages_per_row, "iops": iops, "step_ms": step_ms,
            "warmup_steps": skip, "counted_steps": counted, "entries": entries}


def scenario_tiers(scenario, sizes: TierSizes, policies, warmup: int = 48, steps: int = 64, iops: float | None = None,
                   step_ms: float | None = None) -> dict:
    """:func:`tier_model` on the scenario's first ``warmup + steps`` training batches (as
    :func:`~embbench.cache.curve_scenario.scenario_curve` reads them), its rows in the
    scenario's (first) row precision with their optimizer state."""
    from embbench.cache.curve_scenario import scenario_stream
    from embbench.row_precision import row_type

    from embbench.cache.curve_scenario import FREQCACHE_PROFILE, profile_samples

    stream, table_rows, freqcache = scenario_stream(scenario, warmup, steps)
    precision = scenario.run.row_precisions[0]
    row_bytes = row_type(precision).row_bytes(scenario.data.embedding_dim, scenario.optimizer.embedding.state_width)
    profile = min(FREQCACHE_PROFILE, warmup)
    starts = np.concatenate([[0], np.cumsum(list(table_rows.values()))[:-1]]).astype(np.int64)
    section = tier_model(stream, sum(table_rows.values()), row_bytes, sizes, policies, warmup, scenario.run.seed,
                         freqcache, iops, step_ms, profile=profile, table_starts=starts,
                         samples=profile_samples(scenario, profile))
    section["row_precision"] = precision
    return section


# -- the file --------------------------------------------------------------------------------


@_open
class _Hbm(TypedDict):
    hit_rate: Rate
    unique_hit_rate: Rate
    rows_read_per_step: NonNegative
    rows_written_per_step: NonNegative
    bytes_read_per_step: NonNegative
    bytes_written_per_step: NonNegative


@_open
class _Dram(TypedDict):
    hit_rate: Rate
    conditional_hit_rate: Rate
    unique_hit_rate: Rate
    unique_conditional_hit_rate: Rate
    page_hit_rate: Rate


@_open
class _Nvme(TypedDict):
    pages_read_per_step: NonNegative
    pages_written_per_step: NonNegative
    bytes_read_per_step: NonNegative
    bytes_written_per_step: NonNegative
    pages_read_for_writes_per_step: NotRequired[NonNegative]
    read_amplification: NonNegative | None
    read_ms_per_step: NonNegative | None
    step_ratio: NonNegative | None


@_open
class _Entry(TypedDict):
    hbm_policy: Literal["lru", "lfu", "freqcache", "min"]
    dram_policy: Literal["lru", "min"]
    layout: NotRequired[Literal["id", "frequency", "table_frequency", "coaccess"]]  # (files before issue 48: id)
    hbm: _Hbm
    dram: _Dram
    nvme: _Nvme


_Share = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=1)]


@_open
class TiersSection(TypedDict):
    """What :func:`tier_model` writes (a curve file's ``tiers``)."""

    format: Literal["embbench-tiers-1"]
    hbm_ratio: _Share
    dram_ratio: _Share
    hbm_rows: PositiveCount
    freqcache_slots: PositiveCount | None
    freqcache_cache_rows: NotRequired[Count | None]
    dram_pages: PositiveCount
    rows: PositiveCount
    pages: PositiveCount
    row_bytes: PositiveCount
    rows_per_page: PositiveCount
    pages_per_row: PositiveCount
    iops: Positive | None
    step_ms: Positive | None
    warmup_steps: Count
    counted_steps: PositiveCount
    entries: Annotated[list[_Entry], Field(min_length=1)]


def read_tiers(path: str | Path) -> dict:
    """The ``tiers`` section of an ``embbench curve --tiers --out`` JSON file, checked;
    ValueError naming the file and the key otherwise."""
    curve = read_curve(path)
    if "tiers" not in curve:
        raise ValueError(f"{path}: no tiers section (write one with `embbench curve SCENARIO --tiers hbm=1.5%,dram=10% --out FILE.json`)")
    return validated(TiersSection, curve["tiers"], Path(path), hint=" (a damaged tiers section)")


# -- the table -------------------------------------------------------------------------------


def _percent(rate: float) -> str:
    """Two significant digits, but never 100% or 0% for a rate that is not (a miss rate is what counts near 100%)."""
    value = 100 * rate
    if value in (0, 100):
        return f"{value:.0f}%"
    decimals = max(0, 1 - math.floor(math.log10(value)))
    while round(value, decimals) in (0, 100):
        decimals += 1
    return f"{value:.{decimals}f}%"


def _two(value: float) -> str:
    """``value`` to two significant digits, never in exponent form."""
    if value == 0:
        return "0"
    decimals = 1 - math.floor(math.log10(abs(value)))
    return f"{round(value, decimals):.{max(0, decimals)}f}"


def _number(value: float) -> str:
    """Two significant digits with a unit that scales (k, M, G)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return _two(value / scale) + unit
    return _two(value)


def _duration(ms: float) -> str:
    """Two significant digits in s, ms or µs."""
    for unit, scale in (("s", 1000), ("ms", 1)):
        if ms >= scale:
            return f"{_two(ms / scale)} {unit}"
    return f"{_two(ms * 1000)} µs"


def tiers_table(section: dict, title: str = "stream") -> Table:
    """What ``embbench curve --tiers`` prints: one line per device policy and host policy."""
    s = section
    table = Table(title=f"{title}: tiers, HBM {100 * s['hbm_ratio']:g}% of rows ({s['hbm_rows']:,}), host memory "
                        f"{100 * s['dram_ratio']:g}% of pages ({s['dram_pages']:,} of {s['pages']:,}, "
                        f"{s['rows_per_page']} rows of {s['row_bytes']} B a page), per batch "
                        f"({s['counted_steps']} after {s['warmup_steps']})")
    for name in ("HBM", "hit", "host", "file", "hit all / reaching", "drive reads", "writes", "read", "written",
                 "read amp"):
        table.add_column(name, justify="left" if name in ("HBM", "host", "file") else "right")
    if s["iops"]:
        table.add_column(f"reads take @ {_number(s['iops'])}/s", justify="right")
    if s["step_ms"]:
        table.add_column(f"vs {s['step_ms']:g} ms step", justify="right")
    for e in s["entries"]:
        hbm, dram, nvme = e["hbm"], e["dram"], e["nvme"]
        amp = nvme["read_amplification"]
        cells = [e["hbm_policy"], f"{_percent(hbm['hit_rate'])} / {_percent(hbm['unique_hit_rate'])}", e["dram_policy"],
                 e.get("layout", "id"), f"{_percent(dram['hit_rate'])} / {_percent(dram['conditional_hit_rate'])}",
                 _number(nvme["pages_read_per_step"]), _number(nvme["pages_written_per_step"]),
                 format_bytes(nvme["bytes_read_per_step"]), format_bytes(nvme["bytes_written_per_step"]),
                 "-" if amp is None else f"{_two(amp)}x"]
        if s["iops"]:
            cells.append(_duration(nvme["read_ms_per_step"]))
        if s["step_ms"]:
            ratio = nvme["step_ratio"]
            cells.append(f"{_two(ratio)}x " + ("keeps up" if ratio <= 1 else "too slow"))
        table.add_row(*cells)
    staged = (f" (freqcache: {s['freqcache_cache_rows']:,} cached rows and its staging slots for two batches, "
              f"{s['freqcache_slots']:,} rows in all: the HBM share)") if s.get("freqcache_cache_rows") else \
        (f" (freqcache: also rows staged by the batch before; with its staging slots it holds {s['freqcache_slots']:,} "
         "rows)") if s.get("freqcache_slots") else ""
    table.caption = (f"HBM hit: per access / per distinct row, served without a read from host memory{staged}. Host hit: per access of all / of those reaching host "
                     "memory. Drive: 4 KiB pages read (host misses, and pages read to merge a written row) and "
                     "written (dirty pages leaving) a batch; read amp: bytes read over the needed rows' bytes; file: rows "
                     "in pages in id order, the profile's most used rows first (frequency, table_frequency), or the "
                     "rows the device caches first and the others in pages by the sample that used them (coaccess)"
                     + ("; a batch's reads at the drive's rate, issued with enough in flight" if s["iops"] else ""))
    return table

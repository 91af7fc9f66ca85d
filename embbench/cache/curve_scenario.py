"""A scenario's cache curves (``embbench curve``): its training id stream, read through the
data source ``embbench run`` uses, measured by :func:`embbench.cache.curve.measure`, and
shown as a terminal table. Evaluation data is never read."""

from __future__ import annotations

import numpy as np
import torch
from rich.table import Table
from rich.text import Text

from embbench.cache.curve import DEFAULT_RATIOS, POLICIES, Progress, below_one_batch, measure
from embbench.cache.sweep import freqcache_policy
from embbench.data import Stream
from embbench.recommend import format_bytes

__all__ = ["FREQCACHE_PROFILE", "curve_tables", "profile_samples", "scenario_curve", "scenario_stream"]

#: freqcache's profiled batches (its ``profile_batches`` default), the first of the warm-up.
FREQCACHE_PROFILE = 32


def _training_batches(scenario, batches: int):
    """``i -> training batch i's global rows`` (each batch read once) and each table's rows;
    files must hold the ``batches`` read (a replay past the end would repeat them)."""
    from embbench.embedding import RowSpace

    tables = scenario.tables()
    source = scenario.data_source(torch.device("cpu"), (batches, 0))
    space = RowSpace(tables)
    read: dict[int, np.ndarray] = {}

    def batch_rows(i: int) -> np.ndarray:
        if i not in read:
            batch = source.batch(Stream.TRAIN, i, scenario.data.batch_size)
            read[i] = space.global_rows(batch.sparse).numpy()
        return read[i]

    return batch_rows, {t.name: t.num_rows for t in tables}


def profile_samples(scenario, profile: int) -> list[np.ndarray]:
    """The sample of each id of the first ``profile`` training batches (in the order of their
    global rows): the co-access layout groups rows by it. Read again from the data source: only
    the profile's batches, never evaluation data."""
    source = scenario.data_source(torch.device("cpu"), (profile, 0))
    return [source.batch(Stream.TRAIN, i, scenario.data.batch_size).sparse.sample_of_each_id().numpy()
            for i in range(profile)]


#: The last stream read, with its scenario and length: `curve --tiers` models the tiers on
#: the stream the curve read, without reading it again.
_last_stream: dict = {}


def scenario_stream(scenario, warmup: int, steps: int, progress: Progress | None = None):
    """The scenario's first ``warmup + steps`` training batches (global rows), each table's
    rows, and freqcache's policy on them (:func:`embbench.cache.sweep.freqcache_policy`:
    profiled on the first :data:`FREQCACHE_PROFILE` of the warm-up, counted over the last
    ``steps``). ``progress`` is told of the batches read."""
    if _last_stream.get("key") == (id(scenario), warmup, steps) and _last_stream["scenario"] is scenario:
        return _last_stream["value"]
    batch_rows, table_rows = _training_batches(scenario, warmup + steps)
    progress = progress or (lambda what, done, total: None)
    what, stream = "reading the training batches", []
    for i in range(warmup + steps):
        progress(what, i, warmup + steps)
        stream.append(batch_rows(i))
    progress(what, warmup + steps, warmup + steps)
    profile = min(FREQCACHE_PROFILE, warmup)
    policy = freqcache_policy(batch_rows, sum(table_rows.values()), max(len(b) for b in stream), profile,
                              warmup - profile, steps, scenario.run.seed)
    _last_stream.clear()
    _last_stream.update(key=(id(scenario), warmup, steps), scenario=scenario, value=(stream, table_rows, policy))
    return stream, table_rows, policy


def scenario_curve(scenario, ratios=DEFAULT_RATIOS, policies=POLICIES, warmup: int = 48, steps: int = 64,
                   freqcache_ratios=None, progress: Progress | None = None) -> dict:
    """The curves of the scenario's first ``warmup + steps`` training batches, counted over the
    last ``steps`` (freqcache profiles the first :data:`FREQCACHE_PROFILE` of the warm-up,
    and reads the batches its look-ahead needs beyond them).

    ``freqcache_ratios``: where freqcache's planner is driven (each a full simulation);
    default the smallest, the middle and the largest of ``ratios``. ``progress``: told of the
    batches read, then of :func:`~embbench.cache.curve.measure`'s work."""
    stream, table_rows, freqcache = scenario_stream(scenario, warmup, steps, progress)
    if freqcache_ratios is None:
        ordered = sorted(ratios)
        freqcache_ratios = sorted({ordered[0], ordered[len(ordered) // 2], ordered[-1]})
    row_bytes = 4 * (scenario.data.embedding_dim + scenario.optimizer.embedding.state_width)
    curve = measure(stream, table_rows, ratios, policies, warmup, row_bytes, freqcache, freqcache_ratios, progress)
    curve["scenario"] = {"name": scenario.name, "source": scenario.data.source, "batch_size": scenario.data.batch_size,
                         "digest": scenario.digest()}
    return curve


def _shown(ratios: list[float], count: int = 4) -> list[int]:
    """A few of the ratios, spread from the smallest to the largest."""
    return sorted({round(i * (len(ratios) - 1) / (count - 1)) for i in range(count)}) if len(ratios) > count else list(range(len(ratios)))


def _cell(line: dict, i: int) -> str:
    if line["hit_rate"][i] is None:
        return "-"
    return f"{100 * line['hit_rate'][i]:.1f} / {100 * line['unique_hit_rate'][i]:.1f}"


def curve_tables(curve: dict, worst: int = 3) -> list:
    """What ``embbench curve`` prints: all tables together at a few sizes, every policy, and
    the tables that do worst."""
    ratios, scopes = curve["ratios"], curve["scopes"]
    everything = scopes[0]
    shown = _shown(ratios)
    table = Table(title=f"{curve.get('scenario', {}).get('name', 'stream')}: hit rate % per access / per distinct row "
                        f"({curve['counted_steps']} batches after {curve['warmup_steps']} of warm-up), all tables in one cache")
    table.add_column("cache", justify="right")
    table.add_column("rows", justify="right")
    for policy in curve["policies"]:
        table.add_column(policy.upper() if policy in ("lru", "lfu", "min") else policy, justify="right")
    table.add_column("moved/step (fewest..most)", justify="right")  # in and out, over the policies
    lines = everything["policies"]
    small = below_one_batch(curve)
    for i in shown:
        moved = [lines[p]["bytes_per_step"][i] for p in curve["policies"] if lines[p]["bytes_per_step"][i] is not None]
        table.add_row(f"{100 * ratios[i]:.2g}%", f"{everything['capacity'][i]:,}" + (" *" if small[i] else ""),
                      *(_cell(lines[p], i) for p in curve["policies"]),
                      f"{format_bytes(min(moved))}..{format_bytes(max(moved))}" if moved else "-")
    if any(small[i] for i in shown):
        batch = everything["distinct"] / curve["counted_steps"]
        table.caption = (f"*: smaller than one batch's distinct rows ({batch:,.0f}): no batch-granular cache can hold a "
                         "batch, and MIN per access is no bound there; compare per distinct row")
    out: list = [table]
    alone = [p for p in curve["policies"] if p != "freqcache"]  # freqcache has no line per table
    if not alone:
        return out
    policy = "min" if "min" in alone else alone[0]
    middle = shown[len(shown) // 2]
    busy = [s for s in scopes[1:] if s["accesses"] >= 0.01 * everything["accesses"]]
    busy.sort(key=lambda s: s["policies"][policy]["unique_hit_rate"][middle])
    if busy:
        named = ", ".join(f"{s['name']} ({s['rows']:,} rows, {100 * s['accesses'] / everything['accesses']:.0f}% of ids: "
                          + " ".join(f"{p.upper()} {100 * s['policies'][p]['unique_hit_rate'][middle]:.0f}%"
                                     for p in alone) + ")"
                          for s in busy[:worst])
        out.append(Text(f"worst tables alone at {100 * ratios[middle]:.2g}% of their rows, per distinct row: {named}"))
    return out

"""``fae``: FAE's hot-embedding placement (Adnan et al., "High-Performance Training by
Exploiting Hot-Embeddings in Recommendation Systems", arXiv:2103.00686).

FAE profiles a small random sample of the training data, picks the most accessed rows of
all tables as the *hot set* within a device-memory budget, and calls a sample hot when every
one of its ids is hot. Hot samples are batched together and train entirely on the device
against a device copy of the hot rows; every other sample trains in cold batches on the
host tables (CPU lookups and updates, as the ``cpu`` baseline). Hot and cold batches run
in alternating phases, and a hot row's two copies are synchronised when training switches
phase: the copy that was trained is copied over the other.

Only the order of the samples changes (``semantics: reordered``): ``device`` trained on the
same schedule ends with the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from pydantic import Field, model_validator
from torch import Tensor

from embbench.plugin import (WORK_INSTRUMENT, BuildContext, MemoryFootprint, RowSpace, RowStore, RuntimeEnv, Schedule, ScheduleContext,
                             SparseFeatures, SparseModule, Strategy, StrategyParams, TableSpec, per_sample,
                             pooled_lookup)

__all__ = ["FaeParams", "FaePlan", "FaeStrategy", "HotColdTables", "plan_hot_cold"]

#: The side-data key that tags a scheduled batch as hot (True) or cold (False).
HOT_TAG = "fae_hot"
#: Below this share of hot batches the record says the hot set is too small for the skew.
_FEW_HOT = 0.1
_DEFAULT_HOT_RATIO = 0.015


class FaeParams(StrategyParams):
    hot_ratio: float | None = Field(None, gt=0, le=1, description=(
        f"share of all rows in the hot set (default {_DEFAULT_HOT_RATIO} when hot_bytes is not given)"))
    hot_bytes: int | None = Field(None, gt=0, description=(
        "device bytes for the hot rows' weights (float32, dim per row); their optimizer state comes on top"))
    profile_fraction: float = Field(0.05, gt=0, le=1, description="share of the training samples profiled (random, seeded)")
    phase_batches: int = Field(8, ge=1, description=(
        "longest run of batches of one kind (hot or cold) before training switches and the hot rows sync"))

    @model_validator(mode="after")
    def _one_budget(self) -> "FaeParams":
        if self.hot_ratio is not None and self.hot_bytes is not None:
            raise ValueError("give hot_ratio or hot_bytes, not both")
        return self

    def hot_rows_budget(self, num_rows: int, dim: int) -> int:
        """How many rows the hot set may hold."""
        if self.hot_bytes is not None:
            return min(num_rows, self.hot_bytes // (dim * 4))
        return min(num_rows, math.ceil((self.hot_ratio or _DEFAULT_HOT_RATIO) * num_rows))


@dataclass
class FaePlan:
    """What the schedule decided, from training data only.

    Attributes:
        hot_rows: the hot set as global rows (sorted, on the CPU).
        hot_samples: training samples whose every id is hot.
        samples: training samples in the run.
        profiled_samples: samples counted to choose the hot set.
        hot_batches, cold_batches: the batches the schedule forms of each kind.
    """

    hot_rows: Tensor
    hot_samples: int
    samples: int
    profiled_samples: int
    hot_batches: int
    cold_batches: int


def _sample_of_each_id(features: SparseFeatures) -> Tensor:
    bags = torch.arange(features.lengths.numel(), device=features.values.device)
    bag_of_id = torch.repeat_interleave(bags, features.lengths, output_size=features.values.numel())
    return bag_of_id % features.batch_size


def _interleave(hot: Tensor, cold: Tensor, phase_batches: int) -> tuple[list[Tensor], list[bool]]:
    """Batches of both kinds in alternating phases (cold first), the longer kind's phases at
    most ``phase_batches`` long and the shorter kind's spread in proportion."""
    rounds = max(1, math.ceil(max(len(hot), len(cold)) / phase_batches))
    batches, tags = [], []
    for cold_part, hot_part in zip(torch.tensor_split(cold, rounds), torch.tensor_split(hot, rounds)):
        batches += list(cold_part) + list(hot_part)
        tags += [False] * len(cold_part) + [True] * len(hot_part)
    return batches, tags


def plan_hot_cold(ctx: ScheduleContext, params: FaeParams) -> tuple[FaePlan, Schedule]:
    """FAE's profile, hot set, sample classification and hot/cold batch schedule.

    Hot samples fill as many whole batches as they can; the remainder joins the cold samples
    (a hot sample trains correctly on the host path). Within each kind, samples keep their
    stream order.
    """
    space = RowSpace(ctx.tables)
    samples = ctx.samples()
    n, b = samples.batch_size, ctx.batch_size
    device = samples.values.device
    generator = torch.Generator().manual_seed(ctx.seed)
    profiled = max(1, math.ceil(params.profile_fraction * n))
    profile = torch.randperm(n, generator=generator)[:profiled].sort().values.to(device)
    rows = space.global_rows(samples.select(profile))
    counts = torch.zeros(space.num_rows, dtype=torch.long, device=device).index_add_(0, rows, torch.ones_like(rows))
    budget = min(params.hot_rows_budget(space.num_rows, space.dim), int((counts > 0).sum()))
    hot_rows = torch.sort(counts, descending=True, stable=True).indices[:budget]
    is_hot_row = torch.zeros(space.num_rows, dtype=torch.bool, device=device)
    is_hot_row[hot_rows] = True

    cold_ids = ~is_hot_row[space.global_rows(samples)]
    cold_per_sample = torch.zeros(n, dtype=torch.long, device=device).index_add_(
        0, _sample_of_each_id(samples)[cold_ids], torch.ones_like(cold_ids, dtype=torch.long)[cold_ids])
    hot_samples = torch.nonzero(cold_per_sample == 0).flatten().cpu()
    num_hot_batches = hot_samples.numel() // b
    hot_part = hot_samples[: num_hot_batches * b]
    rest = torch.ones(n, dtype=torch.bool)
    rest[hot_part] = False
    cold_part = torch.nonzero(rest).flatten()
    batches, tags = _interleave(hot_part.view(-1, b), cold_part.view(-1, b), params.phase_batches)
    order = torch.cat(batches) if batches else torch.empty(0, dtype=torch.long)
    plan = FaePlan(hot_rows=hot_rows.sort().values.cpu(), hot_samples=hot_samples.numel(), samples=n,
                   profiled_samples=profiled, hot_batches=num_hot_batches, cold_batches=len(batches) - num_hot_batches)
    return plan, Schedule(order, side=[{HOT_TAG: tag} for tag in tags])


class HostRows:
    """Every table with its optimizer state in host memory, looked up and updated on the CPU
    by embbench's fused lookup (FAE's cold path: DLRM's CPU embedding bags); pooled rows go
    to the compute device."""

    def __init__(self, ctx: BuildContext, space: RowSpace):
        self.space, self.compute = space, ctx.env.device
        weights = torch.empty(space.num_rows, space.dim)
        space.fill_initial(weights, ctx.init_weights)
        self.store = RowStore(weights, ctx.optimizer.new_state(space.num_rows, "cpu"), ctx.optimizer)
        ctx.configure(self.store)

    def pooled(self, features: SparseFeatures) -> Tensor:
        features = features.to("cpu")
        return pooled_lookup(self.store, self.space.global_rows(features), features.offsets(), self.compute)


class HotColdTables(SparseModule):
    """Host tables plus a device copy of the hot rows; batches tagged hot use the copy.

    Which copy of the hot rows is current: ``both``, ``device`` (after hot batches) or
    ``host`` (after cold batches). A batch of the other kind first copies the current one
    over the other (``rows_synced``); a copy back to the host waits for the device
    (``host_syncs``). Evaluation and flush read the host tables, synchronised first.
    """

    def __init__(self, ctx: BuildContext, plan: FaePlan):
        super().__init__()
        self.plan = plan
        self.space = RowSpace(ctx.tables)
        self.host = HostRows(ctx, self.space)
        self.device = ctx.env.device
        self.hot_rows = plan.hot_rows
        host_store = self.host.store
        self.hot_store = RowStore(host_store.weights[self.hot_rows].to(self.device),
                                  host_store.state[self.hot_rows].to(self.device), ctx.optimizer)
        ctx.configure(self.hot_store)
        self.hot_slot = torch.full((self.space.num_rows,), -1, dtype=torch.int32, device=self.device)
        self.hot_slot[self.hot_rows.to(self.device)] = torch.arange(len(self.hot_rows), dtype=torch.int32, device=self.device)
        self.row_bytes = (self.space.dim + ctx.optimizer.state_width) * 4
        self._current = "both"
        self._counts = dict.fromkeys(("accesses", "hot_batches", "cold_batches", "rows_synced", "host_syncs",
                                      "bytes_h2d", "bytes_d2h"), 0)

    def _sync_to_device(self) -> None:
        store = self.host.store
        self.hot_store.weights.copy_(store.weights[self.hot_rows])
        self.hot_store.state.copy_(store.state[self.hot_rows])
        self._synced(bytes_h2d=len(self.hot_rows) * self.row_bytes)

    def _sync_to_host(self) -> None:
        store = self.host.store
        store.weights[self.hot_rows] = self.hot_store.weights.to(store.weights.device)
        store.state[self.hot_rows] = self.hot_store.state.to(store.state.device)
        self._synced(bytes_d2h=len(self.hot_rows) * self.row_bytes, host_syncs=int(self.device.type == "cuda"))

    def _synced(self, **counts: int) -> None:
        self._counts["rows_synced"] += len(self.hot_rows)
        for name, value in counts.items():
            self._counts[name] += value

    def forward(self, features: SparseFeatures) -> Tensor:
        training = torch.is_grad_enabled()
        hot = training and bool(features.side.get(HOT_TAG, False))
        if training:
            self._counts["hot_batches" if hot else "cold_batches"] += 1
        if not hot:
            if self._current == "device":
                self._sync_to_host()
                self._current = "both"
            if training:  # evaluation changes nothing: a stale device copy stays stale
                self._current = "host"
            self._counts["accesses"] += features.values.numel()
            if self.device.type != "cpu":  # ids to the host, pooled rows back, their gradients to the host
                pooled_bytes = features.lengths.numel() * self.space.dim * 4
                self._counts["bytes_d2h"] += (features.values.numel() + features.lengths.numel()) * 8 + pooled_bytes
                self._counts["bytes_h2d"] += pooled_bytes
            return per_sample(self.host.pooled(features), features)
        if self._current == "host":
            self._sync_to_device()
        self._current = "device"
        features = features.to(self.device)
        # An id outside the hot set maps to slot -1, which the lookup rejects as out of range.
        slots = self.hot_slot[self.space.global_rows(features)].long()
        self._counts["accesses"] += slots.numel()
        return per_sample(pooled_lookup(self.hot_store, slots, features.offsets(), self.device), features)

    def instruments(self) -> dict[str, str]:
        return dict(WORK_INSTRUMENT)

    def set_counting(self, mode) -> None:
        for store in (self.host.store, self.hot_store):  # its work counters: the harness's, off in timed steps
            store.counting = mode != "off"

    def counters(self) -> dict[str, int]:
        work = [store.work_counters() for store in (self.host.store, self.hot_store)]
        return {**self._counts, **{k: sum(w.get(k, 0) for w in work) for k in set().union(*work)}}

    def memory(self) -> MemoryFootprint:
        device = self.hot_store.weights.nbytes + self.hot_store.state.nbytes + self.hot_slot.nbytes
        host = self.host.store.weights.nbytes + self.host.store.state.nbytes + self.hot_rows.nbytes
        return MemoryFootprint(device_bytes=device, host_bytes=host)

    def flush(self) -> list[Tensor]:
        if self._current == "device":
            self._sync_to_host()
            self._current = "both"
        return [t.clone() for t in self.space.split(self.host.store.weights)]

    def extra_metrics(self) -> dict:
        p = self.plan
        out = {
            "hot_rows": len(p.hot_rows),
            "hot_row_fraction": len(p.hot_rows) / self.space.num_rows,
            "hot_sample_fraction": p.hot_samples / p.samples,
            "profiled_samples": p.profiled_samples,
            "scheduled_hot_batches": p.hot_batches,
            "scheduled_cold_batches": p.cold_batches,
        }
        if p.hot_batches < _FEW_HOT * (p.hot_batches + p.cold_batches):
            out["note"] = (f"hot set too small for the skew: {p.hot_samples / p.samples:.1%} of samples are hot, "
                           f"{p.hot_batches} of {p.hot_batches + p.cold_batches} batches train on the device copy; "
                           "the rest run on the host path (raise hot_ratio or hot_bytes)")
        return out


class FaeStrategy(Strategy):
    name = "fae"
    summary = "FAE: hot rows (from a training-data profile) on the device, hot/cold batches scheduled apart, rest on the host"
    Params = FaeParams
    semantics = "reordered"

    def __init__(self, params: FaeParams | None = None):
        super().__init__(params)
        self._plan: FaePlan | None = None

    def unsupported_reason(self, env: RuntimeEnv) -> str | None:
        if env.world_size > 1:
            return "fae's hot set spans every table; placement over several ranks is not implemented"
        return None

    def estimate_memory(self, tables: list[TableSpec], optimizer, world_size):
        n = sum(t.num_rows for t in tables)
        row_bytes = (tables[0].dim + optimizer.state_width) * 4
        hot = self.params.hot_rows_budget(n, tables[0].dim)
        return MemoryFootprint(device_bytes=hot * row_bytes + n * 4, host_bytes=n * row_bytes + hot * 8)

    def schedule(self, ctx: ScheduleContext) -> Schedule:
        self._plan, schedule = plan_hot_cold(ctx, self.params)
        return schedule

    def build(self, ctx: BuildContext) -> SparseModule:
        if self._plan is None:
            raise RuntimeError("fae builds from its own schedule's hot set: call schedule() first "
                               "(run_cell does unless it is given another schedule)")
        return HotColdTables(ctx, self._plan)

"""Table-wise placement over several ranks, for strategies that hold rows themselves.

Each table is owned by one rank (a greedy balance of rows x ids per sample). A rank's
sparse module is built for the tables it owns and sees the *global* batch for them: the
ids of every rank's samples are exchanged by all-to-all, the owner pools them, and the
pooled rows go back by all-to-all to the ranks whose samples they are. In backward the
gradients take the reverse path, divided by the world size (the convention of
:class:`embbench.strategy.SparseModule`: embedding gradients are averaged like DDP's).

The id exchange needs the number of ids per destination on the host (one small read per
step, as in torchrec's input distribution); the owner's module keeps its own guarantees.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from embbench.data.batch import Batch, SparseFeatures
from embbench.data.presets import TableSpec
from embbench.strategy import BuildContext, MemoryFootprint, SparseModule

__all__ = ["TableWiseSharded", "plan_table_wise"]


def plan_table_wise(tables: list[TableSpec], world_size: int) -> list[int]:
    """The owner rank of each table: largest cost (rows x ids per sample) first, each to
    the least-loaded rank. Every rank gets at least one table when there are enough."""
    if world_size > len(tables):
        raise ValueError(f"{world_size} ranks but only {len(tables)} tables: table-wise placement needs a table per rank")
    load = [0] * world_size
    owner = [0] * len(tables)
    order = sorted(range(len(tables)), key=lambda t: tables[t].num_rows * tables[t].bag_size, reverse=True)
    for i, t in enumerate(order):
        # the first W tables seed one rank each, so no rank is left without a table
        rank = i if i < world_size else min(range(world_size), key=lambda r: load[r])
        owner[t] = rank
        load[rank] += tables[t].num_rows * tables[t].bag_size
    return owner


class _PooledExchange(torch.autograd.Function):
    """Owner-side pooled rows [global batch, mine] -> this rank's samples of every table."""

    @staticmethod
    def forward(ctx, pooled_mine: Tensor, sharded: "TableWiseSharded") -> Tensor:
        ctx.sharded = sharded
        return sharded._pooled_to_samples(pooled_mine)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.sharded._grad_to_owner(grad), None


class TableWiseSharded(SparseModule):
    """Wraps a single-rank sparse module built for the tables this rank owns.

    Args:
        ctx: the full build context (all tables, this rank, the group).
        build_local: builds the owner's module from a context restricted to its tables,
            with the global batch size and the global training stream of those tables.
    """

    def __init__(self, ctx: BuildContext, build_local: Callable[[BuildContext], SparseModule]):
        super().__init__()
        self.group = ctx.process_group
        self.world, self.rank = ctx.env.world_size, ctx.env.rank
        self.tables = ctx.tables
        self.device = ctx.env.device
        self.dim = ctx.tables[0].dim
        self.owner = plan_table_wise(ctx.tables, self.world)
        self.owned = [[t for t, o in enumerate(self.owner) if o == r] for r in range(self.world)]
        self.mine = self.owned[self.rank]
        grouped = [t for r in range(self.world) for t in self.owned[r]]
        # columns of the concatenated per-owner blocks -> the original table order
        position = {t: i for i, t in enumerate(grouped)}
        self._column_order = torch.cat([
            torch.arange(position[t] * self.dim, (position[t] + 1) * self.dim) for t in range(len(ctx.tables))
        ]).to(self.device)
        self._local_batch = ctx.local_batch_size
        self._bytes_comm = 0
        self._comm_seconds = 0.0  # CPU: wall time in collectives
        self._comm_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: read lazily
        self._exchanged: tuple[Tensor, SparseFeatures] | None = None  # the prefetched batch

        mine = self.mine

        def train_batches(n: int):
            for batch in ctx.train_batches(n):
                features = self._exchange_ids(batch.sparse.to(self.device))
                yield Batch(batch.dense, features, batch.labels)  # dense/labels stay local: unused

        local_ctx = dataclasses.replace(
            ctx, tables=[ctx.tables[t] for t in mine], local_batch_size=ctx.local_batch_size * self.world,
            init_weights=lambda i, a, b: ctx.init_weights(mine[i], a, b), train_batches=train_batches,
        )
        self.local = build_local(local_ctx)

    # -- exchanges -------------------------------------------------------------------------

    @contextmanager
    def _timed_comm(self):
        """Time spent in collectives, without adding a host synchronisation on CUDA."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._comm_events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._comm_seconds += time.perf_counter() - t0

    def _all_to_all(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        with self._timed_comm():
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def _exchange_ids(self, features: SparseFeatures) -> SparseFeatures:
        """This rank's samples of every table -> the global batch of the tables it owns."""
        t_all, b = features.num_tables, features.batch_size
        lengths = features.lengths.view(t_all, b)
        per_table = lengths.sum(1)
        send_lengths = torch.cat([lengths[self.owned[r]].reshape(-1) for r in range(self.world)])
        per_table_host = per_table.tolist()  # the host needs the split sizes (one read)
        starts_host = [0, *itertools.accumulate(per_table_host)]
        send_values = torch.cat([features.values[starts_host[t] : starts_host[t] + per_table_host[t]]
                                 for r in range(self.world) for t in self.owned[r]])
        value_splits = [sum(per_table_host[t] for t in self.owned[r]) for r in range(self.world)]
        length_splits = [len(self.owned[r]) * b for r in range(self.world)]
        recv_lengths = lengths.new_empty(len(self.mine) * b * self.world)
        self._all_to_all(recv_lengths, send_lengths, [len(self.mine) * b] * self.world, length_splits)
        # ids received from each rank, per owned table: sizes from the received lengths
        block = recv_lengths.view(self.world, len(self.mine), b)
        sizes = block.sum(2)  # [source rank, my table]
        sizes_host = sizes.tolist()
        recv_values = features.values.new_empty(int(sum(map(sum, sizes_host))))
        self._all_to_all(recv_values, send_values, [sum(s) for s in sizes_host], value_splits)
        pieces = torch.split(recv_values, [n for row in sizes_host for n in row])
        values = torch.cat([pieces[s * len(self.mine) + i] for i in range(len(self.mine)) for s in range(self.world)])
        self._bytes_comm += 8 * (send_values.numel() - value_splits[self.rank] + send_lengths.numel() - length_splits[self.rank])
        return SparseFeatures(values, block.permute(1, 0, 2).reshape(-1), len(self.mine))

    def _pooled_to_samples(self, pooled_mine: Tensor) -> Tensor:
        b, d = self._local_batch, self.dim
        send = pooled_mine.reshape(self.world, b, len(self.mine) * d).contiguous()
        recv = pooled_mine.new_empty(sum(b * len(o) * d for o in self.owned))
        self._all_to_all(recv, send.view(-1), [b * len(o) * d for o in self.owned], [b * len(self.mine) * d] * self.world)
        blocks = torch.split(recv, [b * len(o) * d for o in self.owned])
        grouped = torch.cat([blk.view(b, len(o) * d) for blk, o in zip(blocks, self.owned)], dim=1)
        self._bytes_comm += 4 * (send.numel() - send[self.rank].numel())
        return grouped.index_select(1, self._column_order)

    def _grad_to_owner(self, grad: Tensor) -> Tensor:
        b, d = self._local_batch, self.dim
        grouped = torch.empty_like(grad)
        grouped.index_copy_(1, self._column_order, grad)  # back to per-owner column blocks
        blocks = torch.split(grouped, [len(o) * d for o in self.owned], dim=1)
        send = torch.cat([blk.reshape(-1) for blk in blocks])
        recv = grad.new_empty(self.world * b * len(self.mine) * d)
        self._all_to_all(recv, send, [b * len(self.mine) * d] * self.world, [b * len(o) * d for o in self.owned])
        self._bytes_comm += 4 * (send.numel() - blocks[self.rank].numel())
        return recv.view(self.world * b, len(self.mine) * d) / self.world

    # -- SparseModule ----------------------------------------------------------------------

    def _global_features(self, features: SparseFeatures) -> SparseFeatures:
        exchanged, self._exchanged = self._exchanged, None
        if exchanged is not None and exchanged[0] is features.values:
            return exchanged[1]
        return self._exchange_ids(features.to(self.device))

    def forward(self, features: SparseFeatures) -> Tensor:
        pooled_mine = self.local(self._global_features(features))
        return _PooledExchange.apply(pooled_mine, self)

    def prefetch(self, features: SparseFeatures) -> None:
        exchanged = self._exchange_ids(features.to(self.device))
        self._exchanged = (features.values, exchanged)  # the tensor itself: an id() could be reused
        self.local.prefetch(exchanged)

    def after_backward(self) -> None:
        self.local.after_backward()

    def end_step(self) -> None:
        self.local.end_step()

    def empty_slots(self) -> int | None:
        return self.local.empty_slots()

    def instruments(self) -> dict[str, str]:
        return self.local.instruments()

    def set_counting(self, mode) -> None:
        self.local.set_counting(mode)

    def counters(self) -> dict[str, int]:
        comm_us = self._comm_seconds * 1e6 + sum(s.elapsed_time(e) * 1e3 for s, e in self._comm_events)
        return {**self.local.counters(), "bytes_comm": self._bytes_comm, "comm_us": int(comm_us)}

    def memory(self) -> MemoryFootprint:
        return self.local.memory()

    def extra_metrics(self) -> dict:
        return {**self.local.extra_metrics(), "tables_owned": self.mine}

    def flush(self) -> list[Tensor]:
        """Full tables on every rank: each owner contributes its tables, then a sum-reduce."""
        mine = dict(zip(self.mine, self.local.flush()))
        out = []
        for t, table in enumerate(self.tables):
            full = mine.get(t, torch.zeros(table.num_rows, table.dim))
            full = full.to(self.device)
            dist.all_reduce(full, group=self.group)
            out.append(full.cpu())
        return out

"""The training batches of one run, in the order the run trains them.

By default that is the data source's own stream order. A strategy may propose another
order through :meth:`embbench.strategy.Strategy.schedule`: the stream then materialises the
run's training samples once (a pool of ``num_batches * batch_size`` samples, training data
only) and forms each batch from the schedule's sample indices, with the schedule's side data
attached. Every rank forms the same global batch and takes its own share of it.

The batches the run is about to train are kept, so that a strategy's lookahead, its
prefetch and its forward see the very same objects.
"""

from __future__ import annotations

from typing import Any

from embbench.data.batch import Batch
from embbench.data.synthetic import Stream
from embbench.strategy import Schedule, ScheduleContext, Strategy

__all__ = ["TrainingStream"]


class TrainingStream:
    """Training batch ``i`` of this rank, from ``source`` (``.batch(stream, index, size)``).

    Args:
        source: the data source.
        batch_size: the global batch size.
        rank, world_size: which share of each global batch this rank trains.
        num_batches: training batches the run may use; a schedule covers exactly these.
    """

    def __init__(self, source: Any, batch_size: int, rank: int, world_size: int, num_batches: int):
        self.source, self.batch_size = source, batch_size
        self.rank, self.world_size, self.num_batches = rank, world_size, num_batches
        self._pool: Batch | None = None
        self._schedule: Schedule | None = None
        self._kept: dict[int, Batch] = {}

    @property
    def scheduled(self) -> bool:
        """Whether batches follow a schedule rather than the data's order."""
        return self._schedule is not None

    def _global(self, index: int) -> Batch:
        return self.source.batch(Stream.TRAIN, index, self.batch_size)

    def pool(self) -> Batch:
        """All training samples of the run, in stream order (built once)."""
        if self._pool is None:
            self._pool = Batch.cat([self._global(i) for i in range(self.num_batches)])
        return self._pool

    def schedule_context(self, tables, seed: int) -> ScheduleContext:
        return ScheduleContext(tables=tables, batch_size=self.batch_size, num_batches=self.num_batches,
                               world_size=self.world_size, seed=seed, samples=lambda: self.pool().sparse)

    def use_schedule(self, strategy: Strategy, tables, seed: int) -> bool:
        """Ask the strategy for a schedule; returns whether it proposed one."""
        schedule = strategy.schedule(self.schedule_context(tables, seed))
        if schedule is None:
            return False
        self.set_schedule(schedule)
        return True

    def set_schedule(self, schedule: Schedule) -> None:
        """Train in this order from now on (checked against the pool's size)."""
        expected = self.num_batches * self.batch_size
        order = schedule.order
        if order.dim() != 1 or order.numel() != expected:
            raise ValueError(f"a schedule must order {expected} samples ({self.num_batches} batches of "
                             f"{self.batch_size}), got shape {tuple(order.shape)}")
        if order.numel() and (int(order.min()) < 0 or int(order.max()) >= expected):
            raise ValueError(f"a schedule's sample indices must lie in [0, {expected})")
        if schedule.side is not None and len(schedule.side) != self.num_batches:
            raise ValueError(f"a schedule's side data must hold {self.num_batches} entries, got {len(schedule.side)}")
        self.pool()
        self._schedule = Schedule(order.to(self._pool.labels.device), schedule.side)
        self._kept.clear()

    def _make(self, index: int) -> Batch:
        if self._schedule is None:
            batch = self._global(index)
        else:
            if index >= self.num_batches:
                raise IndexError(f"the schedule covers {self.num_batches} training batches; batch {index} was asked for")
            samples = self._schedule.order[index * self.batch_size : (index + 1) * self.batch_size]
            batch = self._pool.select(samples)
            if self._schedule.side is not None:
                batch.sparse.side = dict(self._schedule.side[index])
        return batch.shard(self.rank, self.world_size)

    def get(self, index: int) -> Batch:
        """Batch ``index`` (this rank's share), kept until :meth:`release` passes it."""
        if index not in self._kept:
            self._kept[index] = self._make(index)
        return self._kept[index]

    def release(self, before: int) -> None:
        """Forget the kept batches before ``before``."""
        for index in [i for i in self._kept if i < before]:
            del self._kept[index]

    def fresh(self, index: int) -> Batch:
        """Batch ``index`` made anew, not kept (for profiling a strategy's statistics)."""
        return self._make(index)


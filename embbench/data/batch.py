"""The batch that every strategy and the model see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["Batch", "SparseFeatures"]


@dataclass
class SparseFeatures:
    """Jagged ids of every table, laid out as a torchrec KeyedJaggedTensor.

    ``lengths`` is table-major: ``lengths[t * B + b]`` is the number of ids of sample ``b``
    in table ``t``; ``values`` holds those ids (local to their table) in the same order.
    ``side`` is data a strategy's schedule attached to this batch (a hot/cold tag, say); it
    travels with the features through ``to``, ``slice`` and ``select``.
    """

    values: Tensor
    lengths: Tensor
    num_tables: int
    side: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // self.num_tables

    def offsets(self) -> Tensor:
        """Bag offsets, ``[T * B + 1]``, as embedding_bag and fbgemm's TBE take them."""
        return torch.cat([self.lengths.new_zeros(1), torch.cumsum(self.lengths, 0)])

    def table_of_each_id(self) -> Tensor:
        """For every entry of ``values``, the index of its table."""
        per_table = self.lengths.view(self.num_tables, -1).sum(1)
        # output_size: no device-to-host read of the total on CUDA
        return torch.repeat_interleave(
            torch.arange(self.num_tables, device=self.values.device), per_table, output_size=self.values.numel()
        )

    def sample_of_each_id(self) -> Tensor:
        """For every entry of ``values``, the index of its sample in the batch."""
        samples = torch.arange(self.batch_size, device=self.values.device).repeat(self.num_tables)
        return torch.repeat_interleave(samples, self.lengths, output_size=self.values.numel())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "SparseFeatures":
        return SparseFeatures(
            self.values.to(device, non_blocking=non_blocking),
            self.lengths.to(device, non_blocking=non_blocking),
            self.num_tables,
            self.side,
        )

    def slice(self, start: int, stop: int) -> "SparseFeatures":
        """The samples ``[start, stop)`` of every table."""
        lengths = self.lengths.view(self.num_tables, -1)
        offsets = self.offsets()
        batch = lengths.shape[1]
        pieces = []
        for t in range(self.num_tables):
            lo = offsets[t * batch + start]
            hi = offsets[t * batch + stop]
            pieces.append(self.values[lo:hi])
        return SparseFeatures(
            torch.cat(pieces), lengths[:, start:stop].reshape(-1).contiguous(), self.num_tables, self.side
        )

    def select(self, samples: Tensor) -> "SparseFeatures":
        """The given samples (indices, any order, repeats allowed) of every table."""
        num_bags = self.num_tables * samples.numel()
        lengths = self.lengths.view(self.num_tables, -1)[:, samples].reshape(-1)
        starts = self.offsets()[:-1].view(self.num_tables, -1)[:, samples].reshape(-1)
        total = int(lengths.sum())
        bag = torch.repeat_interleave(torch.arange(num_bags, device=lengths.device), lengths, output_size=total)
        within = torch.arange(total, device=lengths.device) - (torch.cumsum(lengths, 0) - lengths)[bag]
        return SparseFeatures(self.values[starts[bag] + within], lengths, self.num_tables, self.side)

    @staticmethod
    def cat(parts: list["SparseFeatures"]) -> "SparseFeatures":
        """The samples of several batches as one (``parts[0]``'s samples first)."""
        num_tables = parts[0].num_tables
        per_table = [torch.split(p.values, p.lengths.view(num_tables, -1).sum(1).tolist()) for p in parts]
        values = torch.cat([per_table[i][t] for t in range(num_tables) for i in range(len(parts))])
        lengths = torch.cat([p.lengths.view(num_tables, -1) for p in parts], dim=1).reshape(-1)
        return SparseFeatures(values, lengths, num_tables)

    def to_kjt(self, keys: list[str]):
        """A torchrec KeyedJaggedTensor with the same layout (for the torchrec strategies)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        return KeyedJaggedTensor(keys=keys, values=self.values, lengths=self.lengths)


@dataclass
class Batch:
    """One batch of Criteo-shaped samples."""

    dense: Tensor  # [B, num_dense] float32
    sparse: SparseFeatures
    labels: Tensor  # [B] float32 in {0, 1}

    @property
    def size(self) -> int:
        return self.labels.numel()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def shard(self, rank: int, world_size: int) -> "Batch":
        """This rank's contiguous share of a global batch (the global size must divide)."""
        if world_size == 1:
            return self
        if self.size % world_size:
            raise ValueError(f"batch size {self.size} does not divide by world size {world_size}")
        per_rank = self.size // world_size
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        return Batch(self.dense[lo:hi], self.sparse.slice(lo, hi), self.labels[lo:hi])

    def select(self, samples: Tensor) -> "Batch":
        """The given samples of this batch, in that order."""
        return Batch(self.dense[samples], self.sparse.select(samples), self.labels[samples])

    @staticmethod
    def cat(parts: list["Batch"]) -> "Batch":
        """Several batches as one, in order."""
        return Batch(torch.cat([p.dense for p in parts]), SparseFeatures.cat([p.sparse for p in parts]),
                     torch.cat([p.labels for p in parts]))

"""The batch that every strategy and the model see."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Batch", "SparseFeatures"]


@dataclass
class SparseFeatures:
    """Jagged ids of every table, laid out as a torchrec KeyedJaggedTensor.

    ``lengths`` is table-major: ``lengths[t * B + b]`` is the number of ids of sample ``b``
    in table ``t``; ``values`` holds those ids (local to their table) in the same order.
    """

    values: Tensor
    lengths: Tensor
    num_tables: int

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

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "SparseFeatures":
        return SparseFeatures(
            self.values.to(device, non_blocking=non_blocking),
            self.lengths.to(device, non_blocking=non_blocking),
            self.num_tables,
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
            torch.cat(pieces), lengths[:, start:stop].reshape(-1).contiguous(), self.num_tables
        )

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

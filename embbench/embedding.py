"""Building blocks for strategies that hold rows themselves: a pooled lookup whose
backward applies the embedding optimizer (fused into backward, as fbgemm's TBE does), and
the global row space that puts all tables of a model into one index range.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embbench.data.batch import SparseFeatures
from embbench.data.presets import TableSpec
from embbench.data.weights import fill_in_parallel
from embbench.optim import EmbeddingOptimizer, aggregate_rows

__all__ = ["RowSpace", "RowStore", "per_sample", "pooled_lookup"]


class RowSpace:
    """All tables of a model as one range of global rows: table ``t`` starts at ``starts[t]``."""

    def __init__(self, tables: list[TableSpec]):
        dims = {t.dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"every table must have the same dim, got {sorted(dims)}")
        self.tables = tables
        self.dim = dims.pop()
        sizes = torch.tensor([t.num_rows for t in tables], dtype=torch.long)
        self.starts = torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)[:-1]])
        self.num_rows = int(sizes.sum())
        self._starts_on: dict[torch.device, Tensor] = {}

    def global_rows(self, features: SparseFeatures) -> Tensor:
        """Each id of ``features`` as a global row index."""
        device = features.values.device
        if device not in self._starts_on:
            self._starts_on[device] = self.starts.to(device)
        return features.values + self._starts_on[device][features.table_of_each_id()]

    def fill_initial(self, out: Tensor, init_weights, position=None, chunk: int = 1 << 18,
                     workers: int | None = None) -> None:
        """Write every table's initial weights into ``out`` (``[num_rows, dim]``, any device),
        a chunk of rows at a time so that no second copy of the tables is ever held.

        Chunks are generated on a thread per core (:func:`~embbench.data.weights.fill_in_parallel`);
        each chunk depends only on its rows, so the result does not depend on the order.

        Args:
            init_weights: ``init_weights(t, start, stop)`` as in BuildContext.
            position: maps global rows (a CPU tensor) to rows of ``out``; identity if None.
            workers: threads (default: one per core).
        """
        jobs = [(int(self.starts[t]), t, lo, min(table.num_rows, lo + chunk))
                for t, table in enumerate(self.tables) for lo in range(0, table.num_rows, chunk)]

        def fill(job: tuple[int, int, int, int]) -> None:
            start, t, lo, hi = job
            block = init_weights(t, lo, hi).to(out.device)
            if position is None:
                out[start + lo : start + hi] = block
            else:  # distinct rows per chunk: the chunks' writes never overlap
                out[position(torch.arange(start + lo, start + hi)).to(out.device)] = block

        fill_in_parallel(fill, jobs, workers)

    def split(self, full: Tensor) -> list[Tensor]:
        """A ``[num_rows, ...]`` tensor cut into one piece per table."""
        return list(torch.split(full, [t.num_rows for t in self.tables]))


class RowStore:
    """Rows and their optimizer state on one device, trained by :func:`pooled_lookup`.

    Subclasses (a cache) may override :meth:`apply_gradient` to do bookkeeping around it.
    """

    def __init__(self, weights: Tensor, state: Tensor, optimizer: EmbeddingOptimizer):
        self.weights, self.state, self.optimizer = weights, state, optimizer

    def pool(self, rows: Tensor, offsets: Tensor) -> Tensor:
        return torch.nn.functional.embedding_bag(rows, self.weights, offsets, mode="sum", include_last_offset=True)

    def apply_gradient(self, rows: Tensor, offsets: Tensor, grad_pooled: Tensor) -> None:
        """Scatter each bag's gradient to its ids, sum per row, and update."""
        bag_of_id = torch.repeat_interleave(
            torch.arange(offsets.numel() - 1, device=rows.device), offsets.diff(), output_size=rows.numel()
        )
        unique, summed = aggregate_rows(rows, grad_pooled[bag_of_id])
        self.optimizer.update(self.weights, self.state, unique, summed)


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: Tensor, store: RowStore, rows: Tensor, offsets: Tensor, out_device: torch.device):
        ctx.store = store
        ctx.save_for_backward(rows, offsets)
        return store.pool(rows, offsets).to(out_device, non_blocking=True)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, offsets = ctx.saved_tensors
        ctx.store.apply_gradient(rows, offsets, grad.to(rows.device))
        return None, None, None, None, None


_ANCHOR = torch.zeros((), requires_grad=True)


def pooled_lookup(store: RowStore, rows: Tensor, offsets: Tensor, out_device: torch.device) -> Tensor:
    """Sum-pooled bags ``[num_bags, D]`` on ``out_device``; backward updates ``store``.

    ``rows`` index ``store`` (global rows, or cache slots) and live on the store's device.
    The weights get no ``.grad``: the optimizer step happens inside backward.
    """
    if torch.is_grad_enabled():
        return _PooledLookup.apply(_ANCHOR, store, rows, offsets, out_device)
    return store.pool(rows, offsets).to(out_device, non_blocking=True)


def per_sample(pooled: Tensor, features: SparseFeatures) -> Tensor:
    """Bags pooled in ``features``' table-major order ``[T * B, D]`` as the SparseModule
    output ``[B, T * D]`` (a sample's tables side by side, like torchrec's KeyedTensor)."""
    batch = features.batch_size
    return pooled.view(features.num_tables, batch, -1).transpose(0, 1).reshape(batch, -1)

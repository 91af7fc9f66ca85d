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
from embbench.optim import EmbeddingOptimizer, aggregate_rows, aggregate_rows_padded
from embbench.row_precision import RowType, row_type, uniform_keyed

__all__ = ["RoundedRowStore", "RowSpace", "RowStore", "per_sample", "pooled_lookup", "stored_rows", "whole_store"]


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
                     workers: int | None = None, kind: RowType | None = None, scales: Tensor | None = None) -> None:
        """Write every table's initial weights into ``out`` (``[num_rows, dim]``, any device),
        a chunk of rows at a time so that no second copy of the tables is ever held.

        Chunks are generated on a thread per core (:func:`~embbench.data.weights.fill_in_parallel`);
        each chunk depends only on its rows, so the result does not depend on the order.

        Args:
            init_weights: ``init_weights(t, start, stop)`` as in BuildContext.
            position: maps global rows (a CPU tensor) to rows of ``out``; identity if None.
            workers: threads (default: one per core).
            kind, scales: ``out`` stores rows of this type (rounded to nearest), their scales
                (fp8) go to ``scales`` (``[num_rows, 1]`` float32, aligned with ``out``).
        """
        jobs = [(int(self.starts[t]), t, lo, min(table.num_rows, lo + chunk))
                for t, table in enumerate(self.tables) for lo in range(0, table.num_rows, chunk)]

        def fill(job: tuple[int, int, int, int]) -> None:
            start, t, lo, hi = job
            block, scale = init_weights(t, lo, hi).to(out.device), None
            if kind is not None:
                block, scale = kind.encode(block, None)
            # distinct rows per chunk: the chunks' writes never overlap
            where = slice(start + lo, start + hi) if position is None else \
                position(torch.arange(start + lo, start + hi)).to(out.device)
            out[where] = block
            if scale is not None:
                scales[where] = scale

        fill_in_parallel(fill, jobs, workers)

    def split(self, full: Tensor) -> list[Tensor]:
        """A ``[num_rows, ...]`` tensor cut into one piece per table."""
        return list(torch.split(full, [t.num_rows for t in self.tables]))


class RowStore:
    """Rows and their optimizer state on one device, trained by :func:`pooled_lookup`.

    Subclasses (a cache) may override :meth:`apply_gradient` to do bookkeeping around it.
    """

    #: How backward sums the gradients of repeated rows: True: at a fixed shape
    #: (:func:`~embbench.optim.aggregate_rows_padded`), False: ``torch.unique``, None: fixed on
    #: CUDA (where ``unique`` makes the host wait for the device every step), unique elsewhere
    #: (fewer rows to update). Set it on a store to force one.
    padded_aggregation: bool | None = None

    def __init__(self, weights: Tensor, state: Tensor, optimizer: EmbeddingOptimizer):
        self.weights, self.state, self.optimizer = weights, state, optimizer

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes + self.state.nbytes

    def pool(self, rows: Tensor, offsets: Tensor) -> Tensor:
        return torch.nn.functional.embedding_bag(rows, self.weights, offsets, mode="sum", include_last_offset=True)

    def apply_gradient(self, rows: Tensor, offsets: Tensor, grad_pooled: Tensor, keys: Tensor | None = None) -> None:
        """Scatter each bag's gradient to its ids, sum per row, and update. ``keys``: each id's
        global row where ``rows`` are slots (a :class:`RoundedRowStore` keys its rounding by it)."""
        bag_of_id = torch.repeat_interleave(
            torch.arange(offsets.numel() - 1, device=rows.device), offsets.diff(), output_size=rows.numel()
        )
        grads = grad_pooled[bag_of_id]
        padded = self.padded_aggregation
        if padded is None:
            padded = rows.device.type == "cuda"
        if padded:
            unique, summed, valid, inverse = aggregate_rows_padded(rows, grads)
        else:
            (unique, summed), valid = aggregate_rows(rows, grads), None
            inverse = None if keys is None else torch.searchsorted(unique, rows)
        if keys is not None:  # the key of each unique row: any of its ids' (a slot holds one row)
            keys = torch.zeros_like(unique).scatter_(0, inverse, keys.to(unique.dtype))
        self.update_rows(unique, summed, unique if keys is None else keys, valid)

    def update_rows(self, rows: Tensor, grad: Tensor, keys: Tensor, valid: Tensor | None = None) -> None:
        """The optimizer step of ``rows`` with their summed gradients: unique rows, or those
        of :func:`~embbench.optim.aggregate_rows_padded` (``valid``: False on its padding)."""
        self.optimizer.update(self.weights, self.state, rows, grad)


class RoundedRowStore(RowStore):
    """Rows stored in a low-precision :class:`~embbench.row_precision.RowType`: read as float32
    to pool and to update (the optimizer state is float32), written back stochastically rounded.

    Args:
        weights: ``[R, D]`` stored rows (``kind.carrier`` elements).
        extras: ``[R, kind.extras(state_width)]`` float32: the row's scale (fp8), then its
            optimizer state.
        seed: the rounding stream's seed; the store's n-th update draws from (seed, n, the
            row's key, column), the key being the row's global index.
    """

    def __init__(self, weights: Tensor, extras: Tensor, optimizer: EmbeddingOptimizer, kind: RowType, seed: int):
        super().__init__(weights, extras[:, int(kind.scaled):], optimizer)
        self.extras, self.kind, self.seed = extras, kind, seed
        self.updates = 0

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes + self.extras.nbytes

    def rows32(self, rows: Tensor) -> Tensor:
        """Rows ``rows`` as float32."""
        return self.kind.decode(self.weights[rows], self.extras[rows, :1] if self.kind.scaled else None)

    def pool(self, rows: Tensor, offsets: Tensor) -> Tensor:
        ids = torch.arange(rows.numel(), device=rows.device)
        return torch.nn.functional.embedding_bag(ids, self.rows32(rows), offsets, mode="sum", include_last_offset=True)

    def update_rows(self, rows: Tensor, grad: Tensor, keys: Tensor, valid: Tensor | None = None) -> None:
        weights, state = self.rows32(rows), self.state[rows]
        local = torch.arange(rows.numel(), device=rows.device)
        self.optimizer.update(weights, state, local, grad)
        uniform = uniform_keyed(self.seed, self.updates, keys, weights.shape[1])
        self.updates += 1
        stored, scale = self.kind.encode(weights, uniform)
        if valid is not None:  # padding repeats row 0 (the same row): write row 0's values there too
            stored, state, scale = (x if x is None else torch.where(valid[:, None], x, x[:1])
                                    for x in (stored, state, scale))
        self.weights[rows] = stored
        self.state[rows] = state
        if scale is not None:
            self.extras[rows, :1] = scale


def whole_store(space: RowSpace, ctx, device: torch.device) -> RowStore:
    """Every row of ``space`` with its optimizer state on ``device``, stored in the build
    context's row precision (a :class:`RoundedRowStore` unless fp32), from the initial weights."""
    kind, n = row_type(ctx.row_precision), space.num_rows
    if kind.exact:
        weights = torch.empty(n, space.dim, device=device)
        space.fill_initial(weights, ctx.init_weights)
        return RowStore(weights, ctx.optimizer.new_state(n, device), ctx.optimizer)
    weights = torch.empty(n, space.dim, dtype=kind.carrier, device=device)
    extras = torch.zeros(n, kind.extras(ctx.optimizer.state_width), device=device)
    space.fill_initial(weights, ctx.init_weights, kind=kind, scales=extras[:, :1])
    return RoundedRowStore(weights, extras, ctx.optimizer, kind, ctx.seed)


def stored_rows(store: RowStore) -> Tensor:
    """A store's rows as float32 (on its device)."""
    if isinstance(store, RoundedRowStore):
        return store.rows32(slice(None))
    return store.weights


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: Tensor, store: RowStore, rows: Tensor, offsets: Tensor, out_device: torch.device,
                keys: Tensor | None):
        ctx.store, ctx.keys = store, keys
        ctx.save_for_backward(rows, offsets)
        return store.pool(rows, offsets).to(out_device, non_blocking=True)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, offsets = ctx.saved_tensors
        ctx.store.apply_gradient(rows, offsets, grad.to(rows.device), ctx.keys)
        return None, None, None, None, None, None


_ANCHOR = torch.zeros((), requires_grad=True)


def pooled_lookup(store: RowStore, rows: Tensor, offsets: Tensor, out_device: torch.device,
                  keys: Tensor | None = None) -> Tensor:
    """Sum-pooled bags ``[num_bags, D]`` on ``out_device``; backward updates ``store``.

    ``rows`` index ``store`` (global rows, or cache slots) and live on the store's device;
    ``keys``: each id's global row when ``rows`` are slots (the rounding of a
    :class:`RoundedRowStore` is keyed by it; None: the rows are the keys). The weights get no
    ``.grad``: the optimizer step happens inside backward.
    """
    if torch.is_grad_enabled():
        return _PooledLookup.apply(_ANCHOR, store, rows, offsets, out_device, keys)
    return store.pool(rows, offsets).to(out_device, non_blocking=True)


def per_sample(pooled: Tensor, features: SparseFeatures) -> Tensor:
    """Bags pooled in ``features``' table-major order ``[T * B, D]`` as the SparseModule
    output ``[B, T * D]`` (a sample's tables side by side, like torchrec's KeyedTensor)."""
    batch = features.batch_size
    return pooled.view(features.num_tables, batch, -1).transpose(0, 1).reshape(batch, -1)

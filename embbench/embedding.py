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
from embbench.row_update import stepped_rows, triton_problem, update_valid_rounded_rows, update_valid_rows
from embbench.row_precision import RowType, row_type, uniform_keyed

__all__ = ["RoundedRowStore", "RowSpace", "RowStore", "WORK_COUNTERS", "WORK_INSTRUMENT", "per_sample", "pooled_lookup", "stored_rows",
           "whole_store"]

#: What a store's updates cost, as counters (see embbench.strategy.COUNTERS).
WORK_COUNTERS = ("update_entries", "update_entries_max_per_row", "ids_max_per_row")
#: The store's work counting as ``SparseModule.instruments`` names it (:attr:`RowStore.counting`).
WORK_INSTRUMENT = {"update_work": "the row update's entries and the most ids on one row, added up on the device"}


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

    def initial_rows(self, init_weights, start: int, stop: int) -> Tensor:
        """Global rows ``[start, stop)`` of the initial weights (float32 ``[stop - start, dim]``),
        across as many tables as the range spans."""
        parts = []
        for t, table in enumerate(self.tables):
            first = int(self.starts[t])
            lo, hi = max(start, first), min(stop, first + table.num_rows)
            if lo < hi:
                parts.append(init_weights(t, lo - first, hi - first))
        return torch.cat(parts) if parts else torch.empty(0, self.dim)

    def split(self, full: Tensor) -> list[Tensor]:
        """A ``[num_rows, ...]`` tensor cut into one piece per table."""
        return list(torch.split(full, [t.num_rows for t in self.tables]))


class RowStore:
    """Rows and their optimizer state on one device, trained by :func:`pooled_lookup`.

    Subclasses (a cache) may override :meth:`apply_gradient` to do bookkeeping around it.
    """

    #: How backward sums the gradients of repeated rows (``run.sparse_backward``): True: at a
    #: fixed shape (:func:`~embbench.optim.aggregate_rows_padded`), False: ``torch.unique``,
    #: None: fixed on CUDA (where ``unique`` makes the host wait for the device every step),
    #: unique elsewhere (fewer rows to update). Set it on a store to force one.
    padded_aggregation: bool | None = None
    #: Whether a fixed-shape backward updates its rows with the Triton kernel that skips the
    #: padding (:mod:`embbench.row_update`), in any row precision; None: where it runs compiled
    #: (CUDA with Triton). True on a CPU runs it in Triton's interpreter (the tests).
    update_kernel: bool | None = None
    #: Whether a step adds its work to the counters (:data:`WORK_COUNTERS`): the harness's
    #: instrument (device adds and a search for the most ids on a row), off in timed steps
    #: (``SparseModule.set_counting``).
    counting: bool = True

    def __init__(self, weights: Tensor, state: Tensor, optimizer: EmbeddingOptimizer):
        self.weights, self.state, self.optimizer = weights, state, optimizer
        # WORK_COUNTERS summed over steps: what the host knows (sizes) as numbers, what only the
        # device knows as a tensor there (a number made a device tensor would be a blocking copy)
        self._work_known = [0] * len(WORK_COUNTERS)
        self._work: Tensor | None = None

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
        if not padded:
            unique, summed, inverse, ids = aggregate_rows(rows, grads)
            keys = None if keys is None else torch.zeros_like(unique).scatter_(0, inverse, keys.to(unique.dtype))
            self.update_rows(unique, summed, unique if keys is None else keys, None)
            if self.counting:
                self._count(len(unique), int(len(unique) > 0), ids.max() if len(ids) else 0)
            return
        agg = aggregate_rows_padded(rows, grads, count=self.counting)
        if keys is not None:  # the key of each row: any of its ids' (a slot holds one row)
            keys = torch.zeros_like(agg.rows).scatter_(0, agg.inverse, keys.to(agg.rows.dtype))
        if self._kernel_updates(rows.device):
            self.update_valid(agg.rows, agg.grads, agg.rows if keys is None else keys, agg.distinct)
            if self.counting:
                self._count(agg.distinct, 1, agg.ids_max_per_row)
            return
        self.update_rows(agg.rows, agg.grads, agg.rows if keys is None else keys, agg.owner)
        # the padding repeats each row once per further id: as many entries on a row as it had ids
        if self.counting:
            self._count(len(agg.rows), agg.ids_max_per_row, agg.ids_max_per_row)

    def update_rows(self, rows: Tensor, grad: Tensor, keys: Tensor, owner: Tensor | None = None) -> None:
        """The optimizer step of ``rows`` with their summed gradients: unique rows, or the
        entries of :func:`~embbench.optim.aggregate_rows_padded` (``owner``: the entry whose
        gradient each entry's row got; a padding entry's is +0.0)."""
        self.optimizer.update(self.weights, self.state, rows, grad)

    def update_valid(self, rows: Tensor, grad: Tensor, keys: Tensor, distinct: Tensor) -> None:
        """The kernel's step of the first ``distinct`` entries of a fixed-shape aggregation (the
        rest are padding, skipped)."""
        update_valid_rows(self.optimizer, self.weights, self.state, rows, grad, distinct)

    def _kernel_updates(self, device: torch.device) -> bool:
        if self.update_kernel is not None:
            return self.update_kernel
        return triton_problem(device) is None

    def _count(self, *work: int | Tensor) -> None:
        """Add one step's work (WORK_COUNTERS' order) to the counters; a tensor stays on the
        device (never read in a step); called only while :attr:`counting`."""
        for i, value in enumerate(work):
            if isinstance(value, Tensor):
                if self._work is None:
                    self._work = torch.zeros(len(WORK_COUNTERS), dtype=torch.long, device=value.device)
                self._work[i] += value
            else:
                self._work_known[i] += value

    def work_counters(self) -> dict[str, int]:
        """The update's work since the store was made (reads the device: not for a step)."""
        if self._work is None and not any(self._work_known):
            return {}
        on_device = [0] * len(WORK_COUNTERS) if self._work is None else self._work.tolist()
        return {name: known + counted for name, known, counted in zip(WORK_COUNTERS, self._work_known, on_device)}


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

    def update_rows(self, rows: Tensor, grad: Tensor, keys: Tensor, owner: Tensor | None = None) -> None:
        # the kernel's arithmetic (update_valid): the same stored bits either way
        weights, state = stepped_rows(self.optimizer, self.rows32(rows), self.state[rows], grad)
        uniform = uniform_keyed(self.seed, self.updates, keys, weights.shape[1])
        self.updates += 1
        stored, scale = self.kind.encode(weights, uniform)
        if owner is not None:  # a padding entry repeats a row: it writes that row's new values too
            stored, state, scale = (x if x is None else x[owner] for x in (stored, state, scale))
        self.weights[rows] = stored
        self.state[rows] = state
        if scale is not None:
            self.extras[rows, :1] = scale

    def update_valid(self, rows: Tensor, grad: Tensor, keys: Tensor, distinct: Tensor) -> None:
        update_valid_rounded_rows(self.kind, self.optimizer, self.weights, self.extras, rows, keys, grad, distinct,
                                  self.seed, self.updates)
        self.updates += 1


def whole_store(space: RowSpace, ctx, device: torch.device) -> RowStore:
    """Every row of ``space`` with its optimizer state on ``device``, stored in the build
    context's row precision (a :class:`RoundedRowStore` unless fp32), from the initial weights."""
    kind, n = row_type(ctx.row_precision), space.num_rows
    if kind.exact:
        weights = torch.empty(n, space.dim, device=device)
        space.fill_initial(weights, ctx.init_weights)
        store = RowStore(weights, ctx.optimizer.new_state(n, device), ctx.optimizer)
    else:
        weights = torch.empty(n, space.dim, dtype=kind.carrier, device=device)
        extras = torch.zeros(n, kind.extras(ctx.optimizer.state_width), device=device)
        space.fill_initial(weights, ctx.init_weights, kind=kind, scales=extras[:, :1])
        store = RoundedRowStore(weights, extras, ctx.optimizer, kind, ctx.seed)
    ctx.configure(store)
    return store


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

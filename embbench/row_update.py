"""The embedding optimizer's step as one Triton kernel that skips the padding of a fixed-shape
backward: a step costs its distinct rows, not its ids.

:func:`~embbench.optim.aggregate_rows_padded` sums a batch's row gradients at a fixed shape (no
host sync on CUDA): one entry per id, the first k the distinct rows. Updating all of them with
torch's scatters costs the ids: at the Kaggle shape 425,984 entries for ~52k rows, 1.2 ms of a
13.95 ms H100 step for ``device`` (results/2026-11-28-h100). Here one program updates 16 entries
and reads k on the device: the padded entries issue no memory transaction. The valid rows are
distinct, so no two programs touch one row: no atomics, the same floats in any order.

The math is :meth:`~embbench.optim.EmbeddingOptimizer.update`'s (``sgd``, ``rowwise_adagrad``)
on float32 rows; Triton's reductions and fused multiply-adds may round its last bit otherwise
than torch's, so it is equal to torch's update within float32 rounding, and equal to itself
wherever it runs (``device`` and freqcache take it alike). On a CPU it runs in Triton's
interpreter (``TRITON_INTERPRET=1``, the tests).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from embbench.optim import EmbeddingOptimizer

__all__ = ["triton_problem", "update_valid_rows"]

#: Entries and columns of one program's tile.
_ROWS, _COLS = 16, 64

_kernel = None


def _triton_kernel():
    """Built on first use (importing triton costs a second)."""
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def update_rows(weights, w_stride, state, s_stride, rows, grads, distinct, n, dim, lr, eps,
                        ADAGRAD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
            i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
            live = (i < n) & (i < tl.load(distinct))  # the padding: no load, no store
            row = tl.load(rows + i, mask=live, other=0).to(tl.int64)
            entry = i.to(tl.int64) * dim
            if ADAGRAD:  # state += mean(g^2); w -= lr * g / (sqrt(state) + eps)
                squares = tl.zeros([ROWS], dtype=tl.float32)
                for c0 in range(0, dim, COLS):
                    c = c0 + tl.arange(0, COLS)
                    g = tl.load(grads + entry[:, None] + c[None, :], mask=live[:, None] & (c < dim)[None, :], other=0.0)
                    squares += tl.sum(g * g, axis=1)
                acc = tl.load(state + row * s_stride, mask=live, other=0.0) + squares / dim
                tl.store(state + row * s_stride, acc, mask=live)
                scale = lr / (tl.sqrt(acc) + eps)
            else:  # w -= lr * g
                scale = tl.zeros([ROWS], dtype=tl.float32) + lr
            for c0 in range(0, dim, COLS):
                c = c0 + tl.arange(0, COLS)
                mask = live[:, None] & (c < dim)[None, :]
                g = tl.load(grads + entry[:, None] + c[None, :], mask=mask, other=0.0)
                at = weights + row[:, None] * w_stride + c[None, :]
                tl.store(at, tl.load(at, mask=mask) - g * scale[:, None], mask=mask)

        _kernel = update_rows
    return _kernel


def triton_problem(device: torch.device) -> str | None:
    """Why embbench's Triton kernels (this update, freqcache's row moves) cannot run compiled on
    ``device``, or None."""
    if device.type != "cuda":
        return "not on CUDA"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def update_valid_rows(optimizer: EmbeddingOptimizer, weights: Tensor, state: Tensor, rows: Tensor, grads: Tensor,
                      distinct: Tensor) -> None:
    """``optimizer``'s step on ``weights[rows[:k]]`` (float32, in place) with the summed
    gradients ``grads[:k]``, k = ``distinct`` (a 0-dim tensor on the rows' device, never read on
    the host); the entries past k are skipped. ``rows[:k]`` must be distinct."""
    n, dim = grads.shape
    if n == 0 or dim == 0:
        return
    adagrad = optimizer.type == "rowwise_adagrad"
    grid = (-(-n // _ROWS),)
    _triton_kernel()[grid](weights, weights.stride(0), state if adagrad else weights, state.stride(0) if adagrad else 0,
                           rows, grads.contiguous(), distinct.reshape(1), n, dim, float(optimizer.lr),
                           float(optimizer.eps), ADAGRAD=adagrad, ROWS=_ROWS, COLS=_COLS)

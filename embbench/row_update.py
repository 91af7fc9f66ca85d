"""The embedding optimizer's step as Triton kernels that skip the padding of a fixed-shape
backward: a step costs its distinct rows, not its ids.

:func:`~embbench.optim.aggregate_rows_padded` sums a batch's row gradients at a fixed shape (no
host sync on CUDA): one entry per id, the first k the distinct rows. Updating all of them with
torch's scatters costs the ids: at the Kaggle shape 425,984 entries for ~52k rows, 1.2 ms of a
13.95 ms H100 step for ``device`` (results/2026-11-28-h100). Here one program updates a tile of
entries and reads k on the device: the padded entries issue no memory transaction. The valid
rows are distinct, so no two programs touch one row: no atomics, the same floats in any order.

- float32 rows (:func:`update_valid_rows`): :meth:`~embbench.optim.EmbeddingOptimizer.update`'s
  math (``sgd``, ``rowwise_adagrad``); Triton's reductions and fused multiply-adds may round its
  last bit otherwise than torch's, so it is equal to torch's update within float32 rounding.
- rounded rows, fp16/bf16/fp8 (:func:`update_valid_rounded_rows`): decoded, stepped, and
  written back with :mod:`~embbench.row_precision`'s keyed stochastic rounding (and fp8's
  per-row scale), all in the kernel. A rounding turns a last-bit difference into a different
  stored value now and then, so here the kernel and torch's path (:func:`stepped_rows`, what a
  :class:`~embbench.embedding.RoundedRowStore` computes) share one arithmetic, every operation
  rounded once in one order: no fused multiply-add, divisions and square roots correctly
  rounded, each row's sum of squares added column into lane ``c % LANES`` and then lane by lane.
  The stored rows are then bit for bit torch's.

Either is equal to itself wherever it runs (``device`` and freqcache take it alike). On a CPU
it runs in Triton's interpreter (``TRITON_INTERPRET=1``, the tests).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from embbench.optim import EmbeddingOptimizer
from embbench.row_precision import RowType, update_key

__all__ = ["LANES", "ROUNDED_KERNEL_OPTIONS", "stepped_rows", "triton_problem", "update_valid_rounded_rows", "update_valid_rows"]

#: Entries and columns of one program's tile (float32 rows).
_ROWS, _COLS = 16, 64
#: Entries and columns (the lanes of the sum of squares) of one program's tile (rounded rows).
_ROUNDED_ROWS, LANES = 32, 16
#: The kernels' stored-element formats (a constexpr of the rounded-row kernel).
_FORMATS = {"fp16": 0, "bf16": 1, "fp8": 2}
#: Compiler options of the rounded-row kernel: ``a * b + c`` rounded twice, as torch's separate
#: operations (Triton may fuse them into one fused multiply-add otherwise).
ROUNDED_KERNEL_OPTIONS = {"enable_fp_fusion": False}

_kernels: dict[str, object] = {}


def _triton_kernel():
    """Built on first use (importing triton costs a second)."""
    if "fp32" not in _kernels:
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

        _kernels["fp32"] = update_rows
    return _kernels["fp32"]


def _rounded_kernel():
    """The rounded-row kernel (:mod:`embbench.rounded_row_kernel`), imported on first use."""
    if "rounded" not in _kernels:
        from embbench.rounded_row_kernel import update_rounded_rows

        _kernels["rounded"] = update_rounded_rows
    return _kernels["rounded"]


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


def update_valid_rounded_rows(kind: RowType, optimizer: EmbeddingOptimizer, weights: Tensor, extras: Tensor,
                              rows: Tensor, keys: Tensor, grads: Tensor, distinct: Tensor, seed: int,
                              update: int) -> None:
    """``optimizer``'s step on the rounded rows ``weights[rows[:k]]`` (``kind.carrier``
    elements; ``extras``: each row's float32 scale for fp8, then its optimizer state), in
    place, k = ``distinct`` as in :func:`update_valid_rows`; the new rows rounded with the
    stream of (``seed``, ``update``, ``keys[i]``, column): bit for bit what
    :class:`~embbench.embedding.RoundedRowStore` stores."""
    n, dim = grads.shape
    if n == 0 or dim == 0:
        return
    bits = weights.view(torch.int16) if weights.element_size() == 2 else weights
    grid = (-(-n // _ROUNDED_ROWS),)
    _rounded_kernel()[grid](bits, bits.stride(0), extras, extras.stride(0), rows, keys, grads.contiguous(),
                            distinct.reshape(1), n, dim, float(optimizer.lr), float(optimizer.eps),
                            update_key(seed, update), float(kind.max_value), ADAGRAD=optimizer.type == "rowwise_adagrad",
                            FORMAT=_FORMATS[kind.name], MANTISSA=kind.mantissa_bits, MIN_EXP=kind.min_exponent,
                            SCALED=kind.scaled, ROWS=_ROUNDED_ROWS, LANES=LANES, **ROUNDED_KERNEL_OPTIONS)


def _lane_sum(x: Tensor) -> Tensor:
    """Each row's sum in the rounded-row kernel's order: column ``c`` into lane ``c % LANES``,
    columns in increasing order, then the lanes in order."""
    n, dim = x.shape
    if n == 0:
        return x.new_zeros(0)
    blocks = torch.nn.functional.pad(x, (0, -dim % LANES)).view(n, -1, LANES)
    lanes = blocks[:, 0]
    for b in range(1, blocks.shape[1]):
        lanes = lanes + blocks[:, b]
    total = lanes[:, 0]
    for j in range(1, LANES):
        total = total + lanes[:, j]
    return total


def stepped_rows(optimizer: EmbeddingOptimizer, weights: Tensor, state: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """``optimizer``'s step on float32 copies of rows (``[n, D]``, their state ``[n, width]``,
    their summed gradients): the new rows and state, in the rounded-row kernel's arithmetic
    (each operation rounded once; divisions by tensors: torch divides a CUDA tensor by a
    Python number as a multiplication by its reciprocal)."""
    if optimizer.type == "sgd":
        return weights - grad * optimizer.lr, state
    squares = _lane_sum(grad * grad)
    acc = state[:, 0] + squares / torch.full_like(squares, grad.shape[1])
    # a correctly rounded square root, as the kernel's (float32's on a CPU is not; double's,
    # rounded to float32, is)
    rate = torch.full_like(acc, optimizer.lr) / (acc.double().sqrt().float() + optimizer.eps)
    return weights - grad * rate[:, None], acc[:, None]

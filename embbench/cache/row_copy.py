"""Row copies between two tables that skip padded entries: a move costs the rows it moves.

freqcache's plans have fixed shapes (CUDA graphs need them): every move is padded to the batch's
id capacity (16384 x 26 = 425,984 rows at the Kaggle shape), although a step moves ~2 % of that.
A padded entry (index -1) must therefore cost nothing. With torch's ``index_copy_`` it cannot: on
an H100 the padding, sent to a spare row, wrote 425,984 rows a step across PCIe to the host table
(11.7 ms of 26 ms a step, results/2026-11-26-h100). So on CUDA one Triton kernel does the copies:
a padded row's loads and stores are masked off and issue no memory transaction. Elsewhere (the
CPU, or no Triton) freqcache keeps torch's padded copies.

Tables are copied as 32-bit words, so one kernel moves float32, float16, bfloat16 and fp8 rows
and their float32 extras alike (a packed host row is a whole number of words: see
``RowType.packing_problem``).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

__all__ = ["copy_rows", "triton_problem", "words"]

#: Rows and 32-bit columns of one Triton program's tile.
_ROWS, _COLS = 16, 64

_kernel = None


def _triton_kernel():
    """The Triton kernel, built on first use (importing triton costs a second; the CPU never does)."""
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_rows(dst, dst_rows, dst_stride, dst_col, src, src_rows, src_stride, src_col, n, width,
                      ROWS: tl.constexpr, COLS: tl.constexpr):
            i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
            inside = i < n
            d = tl.load(dst_rows + i, mask=inside, other=-1).to(tl.int64)
            s = tl.load(src_rows + i, mask=inside, other=-1).to(tl.int64)
            live = (d >= 0) & (s >= 0)  # a padded entry: no load, no store
            for c0 in range(0, width, COLS):
                c = c0 + tl.arange(0, COLS)
                mask = live[:, None] & (c < width)[None, :]
                words = tl.load(src + s[:, None] * src_stride + (src_col + c)[None, :], mask=mask)
                tl.store(dst + d[:, None] * dst_stride + (dst_col + c)[None, :], words, mask=mask)

        _kernel = copy_rows
    return _kernel


def triton_problem(device: torch.device) -> str | None:
    """Why the Triton copies cannot run on ``device``, or None."""
    if device.type != "cuda":
        return "not on CUDA"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def words(t: Tensor) -> Tensor:
    """A 2-D table as 32-bit words (its rows must be a whole number of words)."""
    return t.view(torch.int32)


def copy_rows(dst: Tensor, dst_rows: Tensor, src: Tensor, src_rows: Tensor, *, dst_col: int = 0, src_col: int = 0,
              width: int | None = None) -> None:
    """``dst[dst_rows[i], dst_col:dst_col+width] = src[src_rows[i], src_col:src_col+width]`` for
    every ``i`` whose two indices are not -1, with the Triton kernel (CUDA; the interpreter on a
    CPU with ``TRITON_INTERPRET=1``), on tables of 32-bit words (:func:`words`). ``width``:
    the rest of ``src``'s row from ``src_col`` unless given."""
    width = src.shape[1] - src_col if width is None else width
    n = dst_rows.numel()
    if width == 0 or n == 0:
        return
    grid = (-(-n // _ROWS),)
    _triton_kernel()[grid](dst, dst_rows, dst.stride(0), dst_col, src, src_rows, src.stride(0), src_col, n, width,
                           ROWS=_ROWS, COLS=_COLS)

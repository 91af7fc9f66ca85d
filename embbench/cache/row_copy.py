"""Row copies between two tables that skip padded entries: a move costs the rows it moves.

freqcache's plans have fixed shapes (CUDA graphs need them): every move is padded to the batch's
id capacity (16384 x 26 = 425,984 rows at the Kaggle shape), although a step moves ~2 % of that.
A padded entry (the sink slot, the dummy host row) must therefore cost nothing. With torch's
``index_copy_`` it cannot: on an H100 the padding wrote 425,984 rows a step across PCIe to the
host table (11.7 ms of 26 ms a step, results/2026-11-26-h100). So on CUDA one Triton kernel does
each direction's copies (a packed host row's weights and extras together) in a persistent loop
bounded by the plan's live entries, read on the device: a padded entry's loads and stores are
masked off and issue no memory transaction. Elsewhere (the CPU, or no Triton) freqcache keeps
torch's padded copies.

Tables are copied as 32-bit words, so one kernel moves float32, float16, bfloat16 and fp8 rows
and their float32 extras alike (a packed host row is a whole number of words: see
``RowType.packing_problem``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from embbench.row_update import triton_problem

__all__ = ["move_rows", "triton_problem", "words"]

#: Entries and 32-bit columns of one Triton program's tile.
_ROWS, _COLS = 16, 64
#: Programs of a move at most: each loops over the live entries (a persistent loop), so a move
#: launches for the rows it moves, not for the 425,984 entries of a padded plan (26,624 programs a
#: call before, results/2026-11-28-h100).
_PROGRAMS = 1024

_kernel = None


def _triton_kernel():
    """The Triton kernel, built on first use (importing triton costs a second; the CPU never does)."""
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def move_rows(host, host_stride, rows_per_block, block_stride, weights, w_stride, extras, e_stride, slots,
                      rows, late, live, sink, pad, w_words, e_words, LATE: tl.constexpr, TO_HOST: tl.constexpr,
                      ROWS: tl.constexpr, COLS: tl.constexpr):
            bound = tl.load(live)
            for start in range(tl.program_id(0) * ROWS, bound, tl.num_programs(0) * ROWS):
                i = start + tl.arange(0, ROWS)
                inside = i < bound
                s = tl.load(slots + i, mask=inside, other=sink).to(tl.int64)
                r = tl.load(rows + i, mask=inside, other=pad).to(tl.int64)
                mine = (tl.load(late + i, mask=inside, other=0) != 0) == LATE
                go = inside & mine & (s != sink) & (r != pad)  # a padded entry: no load, no store
                # host row r: row r % rows_per_block of block r // rows_per_block (a row file's
                # pages hold whole rows and leave a tail; one block of one row elsewhere)
                base = (r // rows_per_block) * block_stride + (r % rows_per_block) * host_stride
                # a packed host row: the weights' words, then the extras'
                for c0 in range(0, w_words, COLS):
                    c = c0 + tl.arange(0, COLS)
                    mask = go[:, None] & (c < w_words)[None, :]
                    at_host = host + base[:, None] + c[None, :]
                    at_slot = weights + s[:, None] * w_stride + c[None, :]
                    if TO_HOST:
                        tl.store(at_host, tl.load(at_slot, mask=mask), mask=mask)
                    else:
                        tl.store(at_slot, tl.load(at_host, mask=mask), mask=mask)
                for c0 in range(0, e_words, COLS):
                    c = c0 + tl.arange(0, COLS)
                    mask = go[:, None] & (c < e_words)[None, :]
                    at_host = host + base[:, None] + (w_words + c)[None, :]
                    at_slot = extras + s[:, None] * e_stride + c[None, :]
                    if TO_HOST:
                        tl.store(at_host, tl.load(at_slot, mask=mask), mask=mask)
                    else:
                        tl.store(at_slot, tl.load(at_host, mask=mask), mask=mask)

        _kernel = move_rows
    return _kernel


def words(t: Tensor) -> Tensor:
    """A 2-D table as 32-bit words (its rows must be a whole number of words)."""
    return t.view(torch.int32)


def move_rows(host: Tensor, weights: Tensor, extras: Tensor, slots: Tensor, rows: Tensor, late: Tensor, live: Tensor,
              *, sink: int, pad: int, late_part: bool, to_host: bool, rows_per_block: int = 1,
              block_stride: int | None = None) -> None:
    """One direction of a plan's moves in one launch: for each entry ``i < live`` of the part
    ``late_part`` selects (``late[i] == late_part``) whose slot is not ``sink`` and whose row is
    not ``pad``, the packed host row ``rows[i]`` (``host``: the weights' words, then the
    extras') to or from slot ``slots[i]`` of ``weights`` and ``extras``. All tables are 32-bit
    words (:func:`words`); ``live`` is a 1-element tensor read on the device (the plan's
    candidates: no move lies past it). Runs compiled on CUDA, in Triton's interpreter on a CPU
    with ``TRITON_INTERPRET=1``. A row file's host slots (:mod:`~embbench.cache.file_moves`) are
    blocks of ``rows_per_block`` rows ``block_stride`` words apart: row ``r`` is row
    ``r % rows_per_block`` of block ``r // rows_per_block`` (default: one row a block)."""
    n = slots.numel()
    if n == 0:
        return
    grid = (min(-(-n // _ROWS), _PROGRAMS),)
    stride = host.stride(0)
    _triton_kernel()[grid](host, stride, rows_per_block, stride if block_stride is None else block_stride, weights, weights.stride(0), extras, max(1, extras.stride(0)), slots,
                           rows, late, live.reshape(1), sink, pad, weights.shape[1], extras.shape[1],
                           LATE=late_part, TO_HOST=to_host, ROWS=_ROWS, COLS=_COLS)

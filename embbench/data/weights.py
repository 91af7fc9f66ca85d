"""The tables' initial weights: every strategy and every rank starts from the same numbers."""

from __future__ import annotations

import math

import torch

from embbench.data.presets import TableSpec
from embbench.data.synthetic import _mix

__all__ = ["initial_weights"]

_INIT_CHUNK = 1 << 16


def initial_weights(table: TableSpec, index: int, seed: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a table's initial weights, uniform in +-1/sqrt(rows).

    Generated in fixed chunks with their own seeds, so any row range can be produced
    without the rows before it, and every strategy and rank gets the same numbers.
    """
    bound = 1.0 / math.sqrt(table.num_rows)
    pieces = []
    for chunk in range(start // _INIT_CHUNK, (stop - 1) // _INIT_CHUNK + 1 if stop > start else 0):
        g = torch.Generator().manual_seed(_mix(seed, 10, index, chunk))
        lo = chunk * _INIT_CHUNK
        rows = min(_INIT_CHUNK, table.num_rows - lo)
        block = torch.rand(rows, table.dim, generator=g) * (2 * bound) - bound
        pieces.append(block[max(start - lo, 0) : stop - lo])
    return torch.cat(pieces) if pieces else torch.empty(0, table.dim)

"""The embedding rows' storage type, ``run.row_precision``: ``fp32``, ``fp16``, ``bf16`` or ``fp8``.

Rows are *stored* in the type (on the device, in a cache, on the host); lookups, gradients and
the optimizer's state are float32. A strategy that holds rows itself reads them through
:meth:`RowType.decode` and writes updated rows back through :meth:`RowType.encode`, which
rounds stochastically: up with probability equal to the distance from the value below, so
that many small updates add up on average instead of vanishing (a round-to-nearest
``w + lr * g`` in fp16 loses any update under half an ulp of ``w``).

- ``fp16``, ``bf16``: the weights in torch's half types, nothing else per row.
- ``fp8``: E4M3 (``torch.float8_e4m3fn``, largest 448) with one float32 scale per row
  (``max |w| / 448``), stored and moved beside the row: a row keeps its range whatever its
  magnitude, at one byte per element.

The random numbers of the rounding are a counter-based stream: a hash of (seed, update number,
global row, column). A row's update therefore rounds the same way whichever slot, cache or
process holds it, and a run repeats exactly for a seed (a sequential generator would give
``freqcache`` and ``device`` different draws for the same update, as they visit rows in
another order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["ROW_PRECISIONS", "RowPrecision", "RowType", "row_type", "stochastic_round", "table_bytes", "uniform_keyed",
           "update_key"]

RowPrecision = Literal["fp32", "fp16", "bf16", "fp8"]
ROW_PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8")

_FP8_MAX = 448.0  # the largest finite torch.float8_e4m3fn


@dataclass(frozen=True)
class RowType:
    """How one precision stores a row.

    Attributes:
        name: ``fp32`` | ``fp16`` | ``bf16`` | ``fp8``.
        dtype: the stored element type.
        mantissa_bits, min_exponent, max_value: the format (for stochastic rounding).
        scaled: one float32 scale per row beside the weights (fp8).
    """

    name: str
    dtype: torch.dtype
    mantissa_bits: int
    min_exponent: int
    max_value: float
    scaled: bool = False

    @property
    def exact(self) -> bool:
        """fp32: stored as computed, no rounding."""
        return self.name == "fp32"

    @property
    def carrier(self) -> torch.dtype:
        """The element type of a packed row (weights, then float32 extras): the stored type,
        or bytes for fp8 (whose type few operations take)."""
        return torch.uint8 if self.dtype == torch.float8_e4m3fn else self.dtype

    @property
    def element_bytes(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def extras(self, state_width: int) -> int:
        """float32 values stored beside each row's weights: its scale (fp8), then its optimizer state."""
        return int(self.scaled) + state_width

    def row_bytes(self, dim: int, state_width: int) -> int:
        """Bytes of one row with its scale and optimizer state: what a move of the row copies."""
        return dim * self.element_bytes + 4 * self.extras(state_width)

    def packing_problem(self, dim: int) -> str | None:
        """Why rows of ``dim`` cannot be packed with float32 extras beside them, or None."""
        if (dim * self.element_bytes) % 4:
            return (f"{self.name} rows of dim {dim} are {dim * self.element_bytes} bytes: a multiple of 4 is needed "
                    "to pack the float32 scale and optimizer state beside them")
        return None

    def packed_width(self, dim: int, state_width: int) -> int:
        """``carrier`` elements of a packed row: its weights, then its float32 extras."""
        return dim + self.extras(state_width) * 4 // torch.empty(0, dtype=self.carrier).element_size()

    def pack(self, weights: Tensor, extras: Tensor) -> Tensor:
        """Rows (``carrier`` elements) and their float32 extras side by side, one tensor of
        ``carrier`` elements: one copy moves a row with its scale and state."""
        return torch.cat([weights, extras.view(self.carrier)], 1)

    def unpack(self, packed: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        """Views of packed rows: the weights (``carrier``) and the float32 extras."""
        return packed[:, :dim], packed[:, dim:].view(torch.float32)

    def encode(self, weights: Tensor, uniform: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """float32 rows ``[R, D]`` as stored rows (``carrier`` elements) and their scales (``[R, 1]`` float32 for fp8,
        else None). ``uniform``: one draw in [0, 1) per element for stochastic rounding, or
        None to round to nearest (initial weights)."""
        scale = None
        if self.scaled:
            amax = weights.abs().amax(1, keepdim=True)
            # a tensor divisor: torch divides a CUDA tensor by a Python number as a multiplication
            # by its reciprocal, not as the rounded-row kernel divides (embbench.row_update)
            scale = torch.where(amax > 0, amax / torch.full_like(amax, self.max_value), torch.ones_like(amax))
            weights = (weights / scale).clamp(-self.max_value, self.max_value)
        if uniform is not None:
            weights = stochastic_round(weights, uniform, self.mantissa_bits, self.min_exponent, self.max_value)
        return weights.to(self.dtype).view(self.carrier), scale

    def decode(self, stored: Tensor, scale: Tensor | None) -> Tensor:
        """Stored rows (``carrier`` elements, and their scales) as float32."""
        weights = stored.view(self.dtype).float()
        return weights * scale if scale is not None else weights


_TYPES = {
    "fp32": RowType("fp32", torch.float32, 23, -126, torch.finfo(torch.float32).max),
    "fp16": RowType("fp16", torch.float16, 10, -14, torch.finfo(torch.float16).max),
    "bf16": RowType("bf16", torch.bfloat16, 7, -126, torch.finfo(torch.bfloat16).max),
    "fp8": RowType("fp8", torch.float8_e4m3fn, 3, -6, _FP8_MAX, scaled=True),
}


def row_type(precision: str) -> RowType:
    """The storage of ``precision`` (one of :data:`ROW_PRECISIONS`)."""
    try:
        return _TYPES[precision]
    except KeyError:
        raise ValueError(f"unknown row precision {precision!r}; known: {', '.join(ROW_PRECISIONS)}") from None


def table_bytes(tables, state_width: int, precision: str = "fp32") -> int:
    """Bytes of ``tables`` (anything with ``num_rows`` and ``dim``) stored in ``precision``, with
    ``state_width`` float32s of optimizer state per row (and fp8's scale): what the memory
    estimates count. fbgemm keeps no per-row scale for its fp8 rows: 4 bytes a row high there."""
    kind = row_type(precision)
    return sum(t.num_rows * kind.row_bytes(t.dim, state_width) for t in tables)


def stochastic_round(x: Tensor, uniform: Tensor, mantissa_bits: int, min_exponent: int, max_value: float) -> Tensor:
    """float32 ``x`` rounded to a format of ``mantissa_bits`` (normal numbers from
    ``2**min_exponent``, subnormals below), down or up to a neighbour with probability
    proportional to the distance from the other: unbiased (``E[result] = x``). The result is
    float32, exactly representable in the format (saturated at ``max_value``)."""
    _, exponent = torch.frexp(x)  # x = m * 2**exponent, |m| in [0.5, 1)
    spacing = torch.ldexp(torch.ones_like(x), (exponent - 1).clamp_min(min_exponent) - mantissa_bits)
    scaled = x / spacing  # exact: a power of two
    low = scaled.floor()
    rounded = (low + (uniform < scaled - low).to(x.dtype)) * spacing
    return rounded.clamp(-max_value, max_value)


_MASK_32 = (1 << 32) - 1


def _mix(x: Tensor) -> Tensor:
    """A 64-bit integer hash (splitmix64's finaliser) on int64 tensors; shifts are logical
    (masked), multiplications wrap as two's complement."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685  # 0x94d049bb133111eb as int64
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def update_key(seed: int, update: int) -> int:
    """The (seed, update) part of :func:`uniform_keyed`'s key, mixed on the CPU: a Python int
    (no copy to the device; the rounded-row kernel takes it as an argument)."""
    packed = ((seed & _MASK_32) << 32) | (update & _MASK_32)
    return int(_mix(torch.tensor(packed - (1 << 64) if packed >= 1 << 63 else packed, dtype=torch.long)))


def uniform_keyed(seed: int, update: int, rows: Tensor, columns: int) -> Tensor:
    """``[len(rows), columns]`` float32 draws in [0, 1), each a function of (seed, update, row,
    column) only: the same for a row wherever it is stored and in whatever order rows come."""
    per_row = _mix(rows.long() * 0x9E3779B1 + update_key(seed, update))
    bits = _mix(per_row.unsqueeze(1) + torch.arange(columns, device=rows.device))
    return ((bits >> 40) & ((1 << 24) - 1)).float() * (1.0 / (1 << 24))

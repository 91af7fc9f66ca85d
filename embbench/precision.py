"""The dense model's arithmetic, ``run.dense_precision``: ``fp32``, ``tf32`` or ``bf16``.

It applies to the dense model only (the MLPs and the interaction): the embedding rows, their
optimizer and the pooled embeddings a strategy returns stay float32 unless a strategy says
otherwise; with ``bf16`` the pooled embeddings enter the dense part under autocast, which
casts them where it computes in bfloat16 (MLPerf's DLRM trains its dense part so).

- ``tf32``: float32 matmuls in TensorFloat-32 on CUDA (``torch.set_float32_matmul_precision
  ("high")``), for the cell's forward and backward; the CPU has no TF32 and computes float32,
  so there the record says ``dense_precision_effective: fp32``.
- ``bf16``: the dense forward under ``torch.autocast(device, bfloat16)`` (CUDA and CPU); the
  logits come back as float32, so the loss and the evaluation compute in float32.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator, Literal

import torch
from torch import Tensor, nn

__all__ = ["DENSE_PRECISIONS", "DensePrecision", "effective_precision", "matmul_precision", "scoped_to_the_cell",
           "with_dense_precision"]

DensePrecision = Literal["fp32", "tf32", "bf16"]
DENSE_PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16")


def effective_precision(requested: str, device: torch.device) -> str:
    """What the dense model really computes in on ``device``."""
    if requested == "tf32" and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8):
        return "fp32"  # TF32 is a mode of CUDA's tensor cores from Ampere on
    return requested


@contextmanager
def matmul_precision(requested: str, device: torch.device) -> Iterator[None]:
    """CUDA's float32 matmuls in TF32 for ``tf32``, in full float32 otherwise; the process's
    setting is restored after. Nothing changes on the CPU."""
    if device.type != "cuda":
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if effective_precision(requested, device) == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def scoped_to_the_cell(run_cell):
    """Run a cell (``run_cell(scenario, cell, env, ...)``) under its scenario's matmul precision."""

    @functools.wraps(run_cell)
    def scoped(scenario, cell, env, *args, **kwargs):
        with matmul_precision(scenario.run.dense_precision, env.device):
            return run_cell(scenario, cell, env, *args, **kwargs)

    return scoped


class _Autocast(nn.Module):
    """A dense model whose forward runs under bfloat16 autocast; float32 logits out."""

    def __init__(self, model: nn.Module, device: torch.device):
        super().__init__()
        self.model, self.device_type = model, device.type

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            logits = self.model(dense, pooled)
        return logits.float()


def with_dense_precision(model: nn.Module, requested: str, device: torch.device) -> nn.Module:
    """The dense model as it computes under ``requested`` (autocast for ``bf16``; the same
    module otherwise: TF32 is a process setting, see :func:`matmul_precision`)."""
    return _Autocast(model, device) if requested == "bf16" else model

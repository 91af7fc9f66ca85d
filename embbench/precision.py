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

``run.deterministic`` (a correctness check, not a timing): torch's deterministic algorithms for
the cell. On CUDA float atomics (``index_add_``, the embedding backward) sum in any order, and a
training amplifies a last-bit difference to ~1e-4 in log-loss (docs/measurement.md); with them,
sums of repeated rows are sorted, so two exact strategies can train bit for bit alike.
"""

from __future__ import annotations

import functools
import os
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Literal

import torch
from torch import Tensor, nn

__all__ = ["DENSE_PRECISIONS", "DensePrecision", "deterministic_algorithms", "effective_precision", "matmul_precision",
           "scoped_to_the_cell", "with_dense_precision"]

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


@contextmanager
def deterministic_algorithms(on: bool) -> Iterator[list[str]]:
    """torch's deterministic algorithms while ``on`` (the process's setting restored after).
    An operator that has none here does not stop the cell: torch warns and it runs as it is;
    the list yielded names those operators when the block ends."""
    nondeterministic: list[str] = []
    if not on:
        yield nondeterministic
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's reductions in a fixed order
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield nondeterministic
        finally:
            torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    for w in caught:  # torch's alert starts with the operator: "<op> does not have a deterministic implementation..."
        text = str(w.message)
        if "does not have a deterministic implementation" in text:
            op = text.split(" does not have")[0]
            if op not in nondeterministic:
                nondeterministic.append(op)
        else:  # the cell's other warnings, as they would have been shown
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def scoped_to_the_cell(run_cell):
    """Run a cell (``run_cell(scenario, cell, env, ...)``) under its scenario's matmul precision
    and, with ``run.deterministic``, torch's deterministic algorithms (the record's
    ``deterministic`` names the operators that had none)."""

    @functools.wraps(run_cell)
    def scoped(scenario, cell, env, *args, **kwargs):
        with matmul_precision(scenario.run.dense_precision, env.device), \
                deterministic_algorithms(scenario.run.deterministic) as nondeterministic:
            metrics: dict[str, Any] = run_cell(scenario, cell, env, *args, **kwargs)
        if scenario.run.deterministic:
            metrics["deterministic"] = {"nondeterministic_ops": nondeterministic}
        return metrics

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

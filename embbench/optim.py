"""Embedding and dense optimizers, with one definition of the embedding math.

Every strategy that updates rows itself calls :meth:`EmbeddingOptimizer.update`; the
torchrec/fbgemm strategies get the same math from fbgemm's fused kernels (the tests check
that the two agree). As in fbgemm, the gradients of repeated ids in a batch are summed
first and each row is updated once per step.

Two aggregations give the same sums: :func:`aggregate_rows` (``torch.unique``: as many rows as
are distinct, a size the host must read: a sync on CUDA) and :func:`aggregate_rows_padded`
(a fixed shape, one entry per id, padded with zero gradients: no sync). The optimizer step is
written so that a padding entry changes nothing; on CUDA an update kernel skips the padding
(:mod:`embbench.row_update`), so that a step costs its distinct rows, not its ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from embbench.bounds import Config

__all__ = ["EmbeddingOptimizer", "DenseOptimizer", "PaddedRows", "aggregate_rows", "aggregate_rows_padded"]


class EmbeddingOptimizer(Config):
    """The sparse (embedding) optimizer of a scenario.

    ``rowwise_adagrad`` keeps one accumulator per row (fbgemm's default for training):
    ``acc += mean(g^2)``, ``w -= lr * g / (sqrt(acc) + eps)``.
    """

    type: Literal["sgd", "rowwise_adagrad"] = "rowwise_adagrad"
    lr: float = Field(0.05, gt=0)
    eps: float = Field(1e-8, gt=0)

    @property
    def state_width(self) -> int:
        """Optimizer-state floats per row (it travels with the row wherever the row goes)."""
        return 1 if self.type == "rowwise_adagrad" else 0

    def new_state(self, num_rows: int, device: torch.device | str, pin_memory: bool = False) -> Tensor:
        return torch.zeros(num_rows, self.state_width, device=device, pin_memory=pin_memory)

    def update(self, weights: Tensor, state: Tensor, rows: Tensor, grad: Tensor) -> None:
        """Apply one step to ``weights[rows]`` in place.

        Args:
            weights: ``[R, D]`` rows (a full table, or a cache).
            state: ``[R, state_width]`` optimizer state aligned with ``weights``.
            rows: row indices into ``weights``, unique except for entries whose gradient is
                exactly zero (the padding of :func:`aggregate_rows_padded`, never more entries
                on a row than it had ids).
            grad: ``[len(rows), D]`` summed gradient of each row.
        """
        # Only additions (index_add_), so that a zero-gradient entry adds +0.0 to the state and
        # -0.0 to the weights of its row: nothing, in whatever order it lands.
        if self.type == "sgd":
            weights.index_add_(0, rows, grad, alpha=-self.lr)
            return
        state.index_add_(0, rows, grad.pow(2).mean(1, keepdim=True))
        acc = state[rows, 0]
        step = grad * (self.lr / (acc.sqrt() + self.eps)).unsqueeze(1)
        weights.index_add_(0, rows, step, alpha=-1.0)


class DenseOptimizer(Config):
    """The optimizer of the dense (MLP) parameters."""


    type: Literal["sgd", "adagrad", "adam"] = "sgd"
    lr: float = Field(0.05, gt=0)

    def build(self, params) -> torch.optim.Optimizer:
        cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[self.type]
        return cls(params, lr=self.lr)


def aggregate_rows(rows: Tensor, grads: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sum the gradient rows that share an index: ``(unique rows, summed gradients, each id's
    entry, ids per unique row)``."""
    unique, inverse, ids = torch.unique(rows, return_inverse=True, return_counts=True)
    summed = grads.new_zeros(unique.numel(), grads.shape[1]).index_add_(0, inverse, grads)
    return unique, summed, inverse, ids


@dataclass
class PaddedRows:
    """The row gradients of one backward summed at a fixed shape (one entry per id), as
    :func:`aggregate_rows_padded` returns them. Entries ``0..k-1`` hold the k distinct rows in
    ascending order with their summed gradients; entries ``k..`` are padding: each row again,
    once per further id it has, with a gradient of exactly +0.0. So no row is aimed at by more
    entries than it has ids (one row named by all the padding was a hot spot of ~374k
    same-address atomics a step at the Kaggle shape, and under deterministic algorithms a
    serial walk of CUDA's sorted ``index_put_``: 322 ms a step on an H100)."""

    rows: Tensor  #: [n] the entries' rows
    grads: Tensor  #: [n, D] their summed gradients (+0.0 on padding)
    valid: Tensor  #: [n] bool: the first k entries
    inverse: Tensor  #: [n] each id's entry, as ``torch.unique`` returns it
    owner: Tensor  #: [n] the valid entry of each entry's row (itself on the first k)
    distinct: Tensor  #: 0-dim: k, on the rows' device
    ids_max_per_row: Tensor | None  #: 0-dim: the most ids on one row (None: not counted)


def aggregate_rows_padded(rows: Tensor, grads: Tensor, count: bool = True) -> PaddedRows:
    """:func:`aggregate_rows` at a fixed shape, with no operation whose output size depends
    on the values (on CUDA: no host sync). Each row's gradients are summed in the order of
    ``rows``, as :func:`aggregate_rows` sums them: the same floats on the CPU. ``count``: also
    the most ids on one row (a counter's, four more operations: not in a timed step)."""
    n = rows.numel()
    position = torch.arange(n, device=rows.device)
    ordered, order = torch.sort(rows, stable=True)
    starts = torch.ones(n, dtype=torch.bool, device=rows.device)
    starts[1:] = ordered[1:] != ordered[:-1]
    group = torch.cumsum(starts, 0) - 1  # each sorted id's row, numbered in ascending order
    distinct = starts.sum()
    # a run's first id names its row's entry; the others take the padding entries in order
    # (before sorted position p lie p - group[p] - 1 ids that are not their run's first)
    entry = torch.where(starts, group, distinct + position - group - 1)
    inverse = torch.empty_like(group).scatter_(0, order, group)
    summed = grads.new_zeros(n, grads.shape[1]).index_add_(0, inverse, grads)
    most = None
    if count:
        run_start = torch.cummax(torch.where(starts, position, 0), 0).values
        most = (position - run_start + 1).max() if n else position.new_zeros(())
    return PaddedRows(rows=torch.empty_like(ordered).scatter_(0, entry, ordered), grads=summed,
                      valid=position < distinct, inverse=inverse,
                      owner=torch.empty_like(group).scatter_(0, entry, group), distinct=distinct,
                      ids_max_per_row=most)

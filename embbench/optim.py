"""Embedding and dense optimizers, with one definition of the embedding math.

Every strategy that updates rows itself calls :meth:`EmbeddingOptimizer.update`; the
torchrec/fbgemm strategies get the same math from fbgemm's fused kernels (the tests check
that the two agree). As in fbgemm, the gradients of repeated ids in a batch are summed
first and each row is updated once per step.

Two aggregations give the same sums: :func:`aggregate_rows` (``torch.unique``: as many rows as
are distinct, a size the host must read: a sync on CUDA) and :func:`aggregate_rows_padded`
(a fixed shape, one entry per id, padded with zero gradients: no sync). The optimizer step is
written so that a padding entry changes nothing.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from embbench.bounds import Config

__all__ = ["EmbeddingOptimizer", "DenseOptimizer", "aggregate_rows", "aggregate_rows_padded"]


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
                exactly zero (the padding of :func:`aggregate_rows_padded`).
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


def aggregate_rows(rows: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """Sum the gradient rows that share an index: ``(unique rows, summed gradients)``."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    summed = grads.new_zeros(unique.numel(), grads.shape[1]).index_add_(0, inverse, grads)
    return unique, summed


def aggregate_rows_padded(rows: Tensor, grads: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`aggregate_rows` at a fixed shape, with no operation whose output size depends
    on the values (on CUDA: no host sync).

    Returns:
        ``(unique, summed, valid, inverse)``, the first three of length ``len(rows)``: entries
        ``0..k-1`` hold the k distinct rows in ascending order with their summed gradients;
        entries ``k..`` are padding (row ``unique[0]``, gradient exactly zero, ``valid``
        False). ``inverse``: the entry of each id's row, as ``torch.unique`` returns it.
        Each row's gradients are summed in the order of ``rows``, as :func:`aggregate_rows`
        sums them: the same floats on the CPU.
    """
    n = rows.numel()
    ordered, order = torch.sort(rows, stable=True)
    starts = torch.ones(n, dtype=torch.bool, device=rows.device)
    starts[1:] = ordered[1:] != ordered[:-1]
    entry_of_sorted = torch.cumsum(starts, 0) - 1
    inverse = torch.empty_like(entry_of_sorted).scatter_(0, order, entry_of_sorted)
    summed = grads.new_zeros(n, grads.shape[1]).index_add_(0, inverse, grads)
    # every id writes its row to its entry (the same value for all ids of a row)
    unique = ordered[:1].expand(n).clone().scatter_(0, entry_of_sorted, ordered)
    valid = torch.arange(n, device=rows.device) < starts.sum()
    return unique, summed, valid, inverse

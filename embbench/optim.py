"""Embedding and dense optimizers, with one definition of the embedding math.

Every strategy that updates rows itself calls :meth:`EmbeddingOptimizer.update`; the
torchrec/fbgemm strategies get the same math from fbgemm's fused kernels (the tests check
that the two agree). As in fbgemm, the gradients of repeated ids in a batch are summed
first and each row is updated once per step.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from embbench.bounds import Config

__all__ = ["EmbeddingOptimizer", "DenseOptimizer", "aggregate_rows"]


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
            rows: unique row indices into ``weights``.
            grad: ``[len(rows), D]`` summed gradient of each row.
        """
        if self.type == "sgd":
            weights.index_add_(0, rows, grad, alpha=-self.lr)
            return
        acc = state[rows, 0] + grad.pow(2).mean(1)
        state[rows, 0] = acc
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

"""The dense part of DLRM: bottom MLP, pairwise dot interaction, top MLP.

The embedding lookups are not here: a strategy's sparse module produces the pooled
embeddings, so every strategy trains the same dense model.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator
from torch import Tensor, nn

__all__ = ["ModelConfig", "DLRM"]


class ModelConfig(BaseModel):
    """The model of a scenario. The bottom MLP's last width must equal the embedding dim."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["dlrm"] = "dlrm"
    bottom_mlp: list[PositiveInt] = Field(default_factory=lambda: [64, 16], min_length=1)
    top_mlp: list[PositiveInt] = Field(default_factory=lambda: [64, 1], min_length=1)

    @field_validator("top_mlp")
    @classmethod
    def _one_logit(cls, widths: list[int]) -> list[int]:
        if widths[-1] != 1:
            raise ValueError(f"must end in 1 (one logit per sample), got {widths}")
        return widths


def _mlp(widths: list[int], final_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if final_activation or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM's dense part, returning one logit per sample.

    Args:
        config: MLP widths (the top MLP must end in 1).
        num_dense: dense input features.
        num_tables: pooled embeddings per sample.
        dim: embedding dimension.
    """

    def __init__(self, config: ModelConfig, num_dense: int, num_tables: int, dim: int):
        super().__init__()
        if config.bottom_mlp[-1] != dim:
            raise ValueError(f"model.bottom_mlp must end in the embedding dim {dim}, got {config.bottom_mlp}")
        if config.top_mlp[-1] != 1:
            raise ValueError(f"model.top_mlp must end in 1 (one logit), got {config.top_mlp}")
        self.num_tables, self.dim = num_tables, dim
        self.bottom = _mlp([num_dense, *config.bottom_mlp], final_activation=True)
        vectors = num_tables + 1
        self.register_buffer("_pairs", torch.triu_indices(vectors, vectors, offset=1), persistent=False)
        self.top = _mlp([dim + vectors * (vectors - 1) // 2, *config.top_mlp], final_activation=False)

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        x = self.bottom(dense)
        vectors = torch.cat([x.unsqueeze(1), pooled.view(-1, self.num_tables, self.dim)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)

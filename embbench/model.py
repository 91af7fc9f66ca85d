"""The dense parts of DLRM and DCNv2: bottom MLP, an interaction, top MLP.

- DLRM: the pairwise dot products of the bottom output and the pooled embeddings.
- DCNv2 (as in MLPerf DLRM-DCNv2): a cross network over the concatenation of the bottom
  output and the pooled embeddings, ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l``, with
  ``W_l`` optionally low-rank (``U_l V_l``); the top MLP reads the last ``x_l``.

The embedding lookups are not here: a strategy's sparse module produces the pooled
embeddings, so every strategy trains the same dense model. :func:`build_model` builds the
one a scenario names.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import AliasChoices, Field, PositiveInt, field_validator
from torch import Tensor, nn

from embbench.bounds import Config

__all__ = ["ModelConfig", "DCNv2", "DLRM", "build_model"]


class ModelConfig(Config):
    """The model of a scenario. The bottom MLP's last width must equal the embedding dim."""

    # Records written before DCNv2 say ``type: dlrm``: still read, so `embbench project` reads them.
    arch: Literal["dlrm", "dcnv2"] = Field("dlrm", validation_alias=AliasChoices("arch", "type"))
    bottom_mlp: list[PositiveInt] = Field(default_factory=lambda: [64, 16], min_length=1)
    top_mlp: list[PositiveInt] = Field(default_factory=lambda: [64, 1], min_length=1)
    cross_layers: int = Field(3, ge=1, description="dcnv2: cross layers")
    cross_rank: int | None = Field(None, ge=1, description="dcnv2: rank of each cross layer's weight (None: full)")

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


def _check_widths(config: ModelConfig, dim: int) -> None:
    if config.bottom_mlp[-1] != dim:
        raise ValueError(f"model.bottom_mlp must end in the embedding dim {dim}, got {config.bottom_mlp}")
    if config.top_mlp[-1] != 1:
        raise ValueError(f"model.top_mlp must end in 1 (one logit), got {config.top_mlp}")


class _DenseModel(nn.Module):
    """The dense part of a recommendation model: a bottom MLP over the dense features, then
    an arch-specific top over them and the pooled embeddings; one logit per sample.

    Args:
        config: MLP widths (the bottom MLP ends in ``dim``, the top MLP in 1), cross layers.
        num_dense: dense input features.
        num_tables: pooled embeddings per sample.
        dim: embedding dimension.
    """

    def __init__(self, config: ModelConfig, num_dense: int, num_tables: int, dim: int):
        super().__init__()
        _check_widths(config, dim)
        self.num_tables, self.dim = num_tables, dim
        self.bottom = _mlp([num_dense, *config.bottom_mlp], final_activation=True)


class DLRM(_DenseModel):
    """DLRM: pairwise dot products of the bottom output and the pooled embeddings."""

    def __init__(self, config: ModelConfig, num_dense: int, num_tables: int, dim: int):
        super().__init__(config, num_dense, num_tables, dim)
        vectors = num_tables + 1
        self.register_buffer("_pairs", torch.triu_indices(vectors, vectors, offset=1), persistent=False)
        self.top = _mlp([dim + vectors * (vectors - 1) // 2, *config.top_mlp], final_activation=False)

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        x = self.bottom(dense)
        vectors = torch.cat([x.unsqueeze(1), pooled.view(-1, self.num_tables, self.dim)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


class CrossLayer(nn.Module):
    """``x0 * (W x + b) + x``, with ``W = U V`` of rank ``rank`` when given."""

    def __init__(self, width: int, rank: int | None):
        super().__init__()
        if rank is None or rank >= width:
            self.project = nn.Linear(width, width)
        else:
            self.project = nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, width))

    def forward(self, x0: Tensor, x: Tensor) -> Tensor:
        return x0 * self.project(x) + x


class DCNv2(_DenseModel):
    """DCNv2 (MLPerf DLRM-DCNv2 layout): cross layers over the bottom output and the pooled
    embeddings, then the top MLP."""

    def __init__(self, config: ModelConfig, num_dense: int, num_tables: int, dim: int):
        super().__init__(config, num_dense, num_tables, dim)
        width = (num_tables + 1) * dim
        self.cross = nn.ModuleList(CrossLayer(width, config.cross_rank) for _ in range(config.cross_layers))
        self.top = _mlp([width, *config.top_mlp], final_activation=False)

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        x0 = torch.cat([self.bottom(dense), pooled], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.top(x).squeeze(1)


def build_model(config: ModelConfig, num_dense: int, num_tables: int, dim: int) -> nn.Module:
    """The dense model a scenario names (``model.arch``)."""
    return {"dlrm": DLRM, "dcnv2": DCNv2}[config.arch](config, num_dense, num_tables, dim)

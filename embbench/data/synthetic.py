"""Deterministic Criteo-shaped synthetic data, generated on the target device.

Every table draws its ids from a Zipf law over frequency ranks (``P(rank k) ~ k^-alpha``),
then scatters the ranks through the table with a per-table bijection, so hot rows are not
the first rows. Labels come from a hidden teacher (a fixed pseudo-random effect per id and
a linear term in the dense features), so a model can learn them.

Batches are addressed by ``(stream, index)``: the training and evaluation streams are
disjoint draws, and any batch can be regenerated without replaying the stream.
"""

from __future__ import annotations

import math
from enum import IntEnum

import torch
from torch import Tensor

from embbench.data.batch import Batch, SparseFeatures
from embbench.data.presets import NUM_DENSE_FEATURES, TableSpec

__all__ = ["Stream", "SyntheticCriteo", "ZipfSampler"]


class Stream(IntEnum):
    """Which stream a batch belongs to. Frequency statistics read TRAIN only."""

    TRAIN = 0
    EVAL = 1


def _mix(*values: int) -> int:
    """A 63-bit seed from a few integers (splitmix64 steps), stable across runs."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


class ZipfSampler:
    """Samples 0-based frequency ranks ``k-1`` with ``P(k) ~ k^-alpha`` for ``k = 1..n``.

    The head (the first ``head`` ranks) is sampled exactly from its cumulative weights; the
    tail, where the density varies slowly, through the inverse of the integral of
    ``x^-alpha`` with midpoint rounding. Both run as a few vectorised ops on the device.
    """

    def __init__(self, n: int, alpha: float, device: torch.device, head: int = 4096):
        if n < 1 or alpha < 0:
            raise ValueError(f"ZipfSampler needs n >= 1 and alpha >= 0, got n={n}, alpha={alpha}")
        self.n, self.alpha = n, alpha
        self.head = min(n, head)
        ranks = torch.arange(1, self.head + 1, dtype=torch.float64, device=device)
        self.head_cdf = torch.cumsum(ranks.pow(-alpha), 0)
        self.head_mass = float(self.head_cdf[-1])
        self.tail_lo = self.head + 0.5
        self.tail_mass = self._integral(self.tail_lo, n + 0.5) if n > self.head else 0.0
        self.total = self.head_mass + self.tail_mass

    def _integral(self, lo: float, hi: float) -> float:
        if abs(self.alpha - 1.0) < 1e-12:
            return math.log(hi / lo)
        e = 1.0 - self.alpha
        return (hi**e - lo**e) / e

    def probability(self, ranks: Tensor) -> Tensor:
        """The model's probability of each 0-based rank (for tests and bounds)."""
        k = ranks.double() + 1
        p = k.pow(-self.alpha)
        tail = k > self.head
        if tail.any():
            lo, hi = k[tail] - 0.5, k[tail] + 0.5
            if abs(self.alpha - 1.0) < 1e-12:
                p[tail] = torch.log(hi / lo)
            else:
                e = 1.0 - self.alpha
                p[tail] = (hi.pow(e) - lo.pow(e)) / e
        return p / self.total

    def sample(self, count: int, generator: torch.Generator) -> Tensor:
        device = self.head_cdf.device
        u = torch.rand(count, dtype=torch.float64, device=device, generator=generator) * self.total
        ranks = torch.searchsorted(self.head_cdf, u, right=True)
        if self.tail_mass > 0:
            v = (u - self.head_mass).clamp_min(0)
            if abs(self.alpha - 1.0) < 1e-12:
                x = self.tail_lo * torch.exp(v)
            else:
                e = 1.0 - self.alpha
                x = (self.tail_lo**e + v * e).clamp_min(1e-300).pow(1.0 / e)
            tail_ranks = torch.floor(x + 0.5).long().clamp(self.head + 1, self.n) - 1
            ranks = torch.where(u >= self.head_mass, tail_ranks, ranks)
        return ranks.clamp_max(self.n - 1)


class _Scatter:
    """A bijection ``rank -> (a * rank + b) mod n`` that spreads hot ranks through the table."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        a = int(torch.randint(1, max(2, n), (1,), generator=g)) if n > 1 else 1
        while math.gcd(a, n) != 1:
            a += 1
        self.n, self.a = n, a
        self.b = int(torch.randint(0, n, (1,), generator=g))

    def __call__(self, ranks: Tensor) -> Tensor:
        return (ranks * self.a + self.b) % self.n


def _hash_effect(ids: Tensor, table_seed: int) -> Tensor:
    """A fixed pseudo-random effect in [-1, 1) per id: the hidden teacher's embedding."""
    phase = (table_seed % 10007) / 10007.0 * 2 * math.pi
    x = torch.sin(ids.double() * 12.9898 + phase) * 43758.5453
    return (x - torch.floor(x)) * 2 - 1


class SyntheticCriteo:
    """Criteo-shaped batches: dense features, one bag of ids per table, labels.

    Args:
        tables: the tables (cardinality, bag size, Zipf exponent each).
        seed: everything (ids, the id scatter, the teacher) derives from it.
        device: where batches are generated.
    """

    def __init__(self, tables: list[TableSpec], seed: int, device: torch.device | str = "cpu"):
        self.tables = tables
        self.seed = seed
        self.device = torch.device(device)
        self.samplers = [ZipfSampler(t.num_rows, t.alpha, self.device) for t in tables]
        self.scatters = [_Scatter(t.num_rows, _mix(seed, 1, i)) for i, t in enumerate(tables)]
        g = torch.Generator().manual_seed(_mix(seed, 2))
        n = len(tables)
        self.table_weights = (torch.randn(n, generator=g, dtype=torch.float64) * 2.5 / math.sqrt(n)).to(
            self.device
        )
        self.dense_weights = (torch.randn(NUM_DENSE_FEATURES, generator=g, dtype=torch.float64) * 0.3).to(
            self.device
        )
        self.bias = -1.0  # about a quarter of the labels positive, as in Criteo

    def hot_ids(self, table: int, count: int) -> Tensor:
        """The ``count`` most popular ids of a table, hottest first (for tests)."""
        count = min(count, self.tables[table].num_rows)
        return self.scatters[table](torch.arange(count, device=self.device))

    def batch(self, stream: Stream, index: int, batch_size: int) -> Batch:
        """Batch ``index`` of ``stream``: the same seed and address give the same batch."""
        g = torch.Generator(self.device).manual_seed(_mix(self.seed, 3, int(stream), index))
        values, lengths, logit = [], [], torch.full((batch_size,), self.bias, dtype=torch.float64, device=self.device)
        for i, (table, sampler, scatter) in enumerate(zip(self.tables, self.samplers, self.scatters)):
            ids = scatter(sampler.sample(batch_size * table.bag_size, g))
            values.append(ids)
            lengths.append(torch.full((batch_size,), table.bag_size, dtype=torch.long, device=self.device))
            effect = _hash_effect(ids, _mix(self.seed, 4, i)).view(batch_size, table.bag_size).mean(1)
            logit += self.table_weights[i] * effect
        dense = torch.randn(batch_size, NUM_DENSE_FEATURES, generator=g, device=self.device)
        logit += dense.double() @ self.dense_weights
        labels = (torch.rand(batch_size, generator=g, device=self.device, dtype=torch.float64) < torch.sigmoid(logit)).float()
        sparse = SparseFeatures(torch.cat(values), torch.cat(lengths), len(self.tables))
        return Batch(dense, sparse, labels)

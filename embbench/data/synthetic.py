"""Deterministic Criteo-shaped synthetic data, generated on the target device.

Every table draws its ids from a Zipf law over frequency ranks (``P(rank k) ~ k^-alpha``),
then scatters the ranks through the table with a per-table bijection, so hot rows are not
the first rows. Labels come from a hidden teacher (a fixed pseudo-random effect per id and
a linear term in the dense features), so a model can learn them.

Batches are addressed by ``(stream, index)``: the training and evaluation streams are
disjoint draws, and any batch can be regenerated without replaying the stream.

Co-access (off by default): a share of the samples are drawn from latent *entities* (a
user, a session) instead of independently per table: the entity is drawn from its own Zipf
law, and each of its ids is a fixed function of the entity (:class:`CoAccess`), so the same
rows recur together, across tables and within a bag.

Speed: the random numbers are drawn table by table, in the same calls and order as ever (so
the batches stay the same), but all the arithmetic after the draws runs once for each group
of tables with the same bag size and Zipf exponent (``[tables, ids]`` blocks), so a batch
costs about a hundred operations instead of dozens per table; on CUDA those are recorded
once per batch size as a CUDA graph and replayed (:class:`_GraphedBatch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

from embbench.data.batch import Batch, SparseFeatures
from embbench.data.presets import NUM_DENSE_FEATURES, TableSpec

__all__ = ["DRIFT_HOT_SHARE", "CoAccess", "Stream", "SyntheticCriteo", "ZipfSampler", "first_sample"]

#: Drift remaps a share of each table's hot ids: the hot ids are its most popular 1 % of rows.
DRIFT_HOT_SHARE = 0.01


class Stream(IntEnum):
    """Which stream a batch belongs to. Frequency statistics read TRAIN only."""

    TRAIN = 0
    EVAL = 1


def first_sample(stream: Stream, index: int, batch_size: int, samples: int) -> int:
    """Where batch ``index`` of a stream of ``samples`` starts. Training wraps around (a run
    may read its rows ``data.epochs`` times); evaluation reads each held-out sample once, so
    a batch past their end is refused (:func:`embbench.data.sources.eval_batches` counts the
    batches they hold)."""
    if Stream(stream) == Stream.EVAL and (index + 1) * batch_size > samples:
        raise ValueError(f"evaluation batch {index} of {batch_size} samples reads past the {samples:,} held-out rows "
                         "(each is evaluated once)")
    return (index * batch_size) % samples


def _mix(*values: int) -> int:
    """A 63-bit seed from a few integers (splitmix64 steps), stable across runs."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


def _zipf_ranks(u: Tensor, head_cdf: Tensor, alpha: float, tail: "_Tail | None", n) -> Tensor:
    """0-based ranks for uniforms ``u`` scaled to ``[0, total mass)``.

    One table (1-D ``u`` and ``head_cdf``, scalar ``tail`` fields and ``n``) or several
    (``u`` ``[tables, ids]``, ``head_cdf`` ``[tables, head]``, per-table fields ``[tables, 1]``):
    the same element-wise operations either way, so both give the same ranks.
    """
    ranks = torch.searchsorted(head_cdf, u, right=True)
    if tail is not None:
        v = (u - tail.start).clamp_min(0)
        if abs(alpha - 1.0) < 1e-12:
            x = tail.lo * torch.exp(v)
        else:
            e = 1.0 - alpha
            x = (tail.lo_pow + v * e).clamp_min(1e-300).pow(1.0 / e)
        tail_ranks = torch.floor(x + 0.5).long().clamp(tail.first, n) - 1
        ranks = torch.where(u >= tail.start, tail_ranks, ranks)
    return ranks.clamp_max(n - 1)


@dataclass
class _Tail:
    """Where the tail's inverse integral starts: its mass offset, ``lo`` (= head + 0.5),
    ``lo ** (1 - alpha)`` and its first 1-based rank."""

    start: float | Tensor
    lo: float | Tensor
    lo_pow: float | Tensor
    first: int | Tensor


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
        lo_pow = self.tail_lo ** (1.0 - alpha) if abs(alpha - 1.0) >= 1e-12 else None
        self.tail = _Tail(self.head_mass, self.tail_lo, lo_pow, self.head + 1) if self.tail_mass > 0 else None

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
        u = torch.rand(count, dtype=torch.float64, device=self.head_cdf.device, generator=generator) * self.total
        return _zipf_ranks(u, self.head_cdf, self.alpha, self.tail, self.n)


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


@dataclass(frozen=True)
class CoAccess:
    """Samples drawn from latent entities, whose rows recur together.

    A ``share`` of the samples (each sample chosen at random) take every id from one entity
    instead of drawing each table's ids on its own. The entity is drawn from a Zipf law of
    exponent ``alpha`` over ``entities`` entities; id ``j`` of entity ``e``'s bag in table
    ``t`` is the table's ``(e * bag + j) mod rows``-th place under a bijection of the table's
    own (not the one that places the independent draws' popular ids). So an entity's rows are
    fixed: whenever it is drawn its rows are used together, in every table and within a bag.
    Entities do not drift.
    """

    share: float
    entities: int
    alpha: float = 1.15

    def __post_init__(self):
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"CoAccess: share must lie in (0, 1], got {self.share}")
        if self.entities < 1:
            raise ValueError(f"CoAccess: entities must be at least 1, got {self.entities}")
        if not self.alpha >= 0:
            raise ValueError(f"CoAccess: alpha must be >= 0, got {self.alpha}")


def _phase(table_seed: int) -> float:
    return (table_seed % 10007) / 10007.0 * 2 * math.pi


def _hash_effect(ids: Tensor, phase: float | Tensor) -> Tensor:
    """A fixed pseudo-random effect in [-1, 1) per id: the hidden teacher's embedding."""
    x = torch.sin(ids.double() * 12.9898 + phase) * 43758.5453
    return (x - torch.floor(x)) * 2 - 1


class _Group:
    """Tables with the same bag size and Zipf exponent, all with a tail or all without,
    sampled as one ``[tables, ids]`` block: every per-table constant is a ``[tables, 1]``
    column, and the head CDFs are rows padded with +inf, which no draw reaches (so each row's
    search finds what its own CDF would)."""

    def __init__(self, indices: list[int], bag: int, samplers: list[ZipfSampler], scatters: list[_Scatter],
                 phases: list[float], weights: Tensor, device: torch.device, entity_maps: list[_Scatter] | None = None):
        self.indices, self.bag = indices, bag
        self.term_rows = torch.tensor(indices, device=device) + 1  # where the logit's terms go
        self.alpha = samplers[0].alpha

        def column(values, dtype=torch.float64) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device).view(-1, 1)

        width = max(s.head for s in samplers)
        self.head_cdf = torch.full((len(samplers), width), math.inf, dtype=torch.float64, device=device)
        for row, s in enumerate(samplers):
            self.head_cdf[row, : s.head] = s.head_cdf
        self.total = column([s.total for s in samplers])
        self.n = column([s.n for s in samplers], torch.long)
        tails = [s.tail for s in samplers]
        self.tail = None if tails[0] is None else _Tail(
            column([t.start for t in tails]), column([t.lo for t in tails]),
            column([1.0 if t.lo_pow is None else t.lo_pow for t in tails]), column([t.first for t in tails], torch.long))
        self.scatter_a = column([s.a for s in scatters], torch.long)
        self.scatter_b = column([s.b for s in scatters], torch.long)
        self.phase = column(phases)
        self.weights = weights[self.term_rows - 1].view(-1, 1)
        self.entity_a = column([e.a for e in entity_maps], torch.long) if entity_maps else None
        self.entity_b = column([e.b for e in entity_maps], torch.long) if entity_maps else None

    def ids_and_terms(self, uniforms: Tensor, remap, entities: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The group's ids ``[tables, B * bag]`` from its draws (``[tables, B * bag]`` in
        ``[0, 1)``), and each table's term of the logit ``[tables, B]``. ``remap`` turns
        popularity ranks into base ranks (drift); None keeps them. ``entities`` (``[B]``, -1
        for an independent sample): the samples whose ids are their entity's."""
        ranks = _zipf_ranks(uniforms * self.total, self.head_cdf, self.alpha, self.tail, self.n)
        if remap is not None:
            ranks = remap(ranks)
        ids = (ranks * self.scatter_a + self.scatter_b) % self.n
        if entities is not None:
            # id j of an entity's bag: its (entity * bag + j)-th place, scattered by the table's
            # own bijection (reduced first: no product overflows)
            slots = (entities.clamp_min(0) * self.bag).repeat_interleave(self.bag) + \
                torch.arange(self.bag, device=ids.device).repeat(entities.numel())
            own = ((slots.view(1, -1) % self.n) * self.entity_a + self.entity_b) % self.n
            ids = torch.where((entities >= 0).repeat_interleave(self.bag).view(1, -1), own, ids)
        effect = _hash_effect(ids, self.phase).view(len(self.indices), -1, self.bag).mean(2)
        return ids, self.weights * effect


class _Drift:
    """Which base rank sits at each popularity rank, drift epoch by drift epoch.

    At each epoch every table swaps ``round(fraction * hot)`` randomly chosen hot ranks
    (the first ``hot = max(1, DRIFT_HOT_SHARE * rows)``) with as many random colder ranks,
    on top of the previous epoch's arrangement: hot ids go cold, cold ids turn hot, and the
    change accumulates. An epoch's arrangement is a sorted map (moved rank -> base rank);
    ranks not in it are where they started. Epochs are computed forward from the last one
    asked for (from the start when an earlier one is asked for), on the host.
    """

    def __init__(self, tables: list[TableSpec], seed: int, fraction: float):
        self.tables, self.seed, self.fraction = tables, seed, fraction
        self._epoch, self._maps = 0, self._start()

    def _start(self) -> list[tuple[Tensor, Tensor]]:
        empty = torch.empty(0, dtype=torch.long)
        return [(empty, empty)] * len(self.tables)

    @staticmethod
    def lookup(keys: Tensor, values: Tensor, ranks: Tensor) -> Tensor:
        """Base ranks of ``ranks`` under the map ``keys -> values`` (rows of keys padded with
        a key larger than any rank)."""
        if keys.shape[-1] == 0:
            return ranks
        at = torch.searchsorted(keys, ranks).clamp_max(keys.shape[-1] - 1)
        return torch.where(keys.gather(-1, at) == ranks, values.gather(-1, at), ranks)

    def maps(self, epoch: int) -> list[tuple[Tensor, Tensor]]:
        """Per table, the sorted (moved rank, base rank) pairs of this epoch."""
        if epoch < self._epoch:
            self._epoch, self._maps = 0, self._start()
        while self._epoch < epoch:
            self._epoch += 1
            self._maps = [self._step(t, keys, values) for t, (keys, values) in enumerate(self._maps)]
        return self._maps

    def _step(self, table: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        n = self.tables[table].num_rows
        hot = max(1, int(n * DRIFT_HOT_SHARE))
        count = min(round(self.fraction * hot), n - hot)
        if count <= 0:
            return keys, values
        g = torch.Generator().manual_seed(_mix(self.seed, 5, table, self._epoch))
        moved = torch.cat([torch.randperm(hot, generator=g)[:count], hot + _distinct(n - hot, count, g)])
        base = self.lookup(keys, values, moved)
        swapped = torch.cat([base[count:], base[:count]])  # each hot rank takes its partner's id
        keep = ~torch.isin(keys, moved)
        keys, values = torch.cat([keys[keep], moved]), torch.cat([values[keep], swapped])
        order = torch.argsort(keys)
        return keys[order], values[order]


def _distinct(n: int, count: int, g: torch.Generator) -> Tensor:
    """``count`` distinct uniform integers in ``[0, n)`` (a uniformly random subset, in random order)."""
    if n <= 4 * count + 4096:
        return torch.randperm(n, generator=g)[:count]
    drawn = torch.empty(0, dtype=torch.long)
    while True:  # rejection: almost always one round, as count <= n / 4
        drawn = torch.cat([drawn, torch.randint(0, n, (2 * count,), generator=g)])
        unique, inverse = torch.unique(drawn, return_inverse=True)
        if unique.numel() >= count:
            break
    # the first draw of each value, in draw order: sequential sampling without replacement
    first = torch.full((unique.numel(),), drawn.numel()).scatter_reduce(0, inverse, torch.arange(drawn.numel()), "amin")
    return drawn[first.sort().values[:count]]


def _sum_rows_in_order(terms: Tensor) -> Tensor:
    """``terms[0] + terms[1] + ...``, added in row order (the logit summed in table order, as
    when each table added its term in turn). On CUDA one cumulative sum along the outer dim,
    which adds row after row in each column (a single column would take a parallel scan);
    on the CPU a loop of adds, cheaper there."""
    if terms.device.type == "cuda" and terms.shape[1] > 1:
        return terms.cumsum(0)[-1]
    total = terms[0].clone()
    for row in terms[1:]:
        total += row
    return total


class SyntheticCriteo:
    """Criteo-shaped batches: dense features, one bag of ids per table, labels.

    Args:
        tables: the tables (cardinality, bag size, Zipf exponent each).
        seed: everything (ids, the id scatter, the teacher, the drift) derives from it.
        device: where batches are generated.
        drift_every: with ``drift_fraction``, the popular ids change every this many batches
            (batch ``index`` of either stream sees the popularity of epoch
            ``index // drift_every``, see :class:`_Drift`); None: never.
        drift_fraction: the share of each table's hot ids remapped at each drift epoch.
        coaccess: samples drawn from entities (:class:`CoAccess`); None: every id drawn on
            its own (the batches are then exactly those of a generator without the option).
    """

    def __init__(self, tables: list[TableSpec], seed: int, device: torch.device | str = "cpu",
                 drift_every: int | None = None, drift_fraction: float = 0.0, coaccess: CoAccess | None = None):
        if drift_every is not None and drift_every < 1:
            raise ValueError(f"SyntheticCriteo: drift_every must be a positive number of batches, got {drift_every}")
        if not 0.0 <= drift_fraction <= 1.0:
            raise ValueError(f"SyntheticCriteo: drift_fraction must lie in [0, 1], got {drift_fraction}")
        if drift_fraction > 0 and drift_every is None:
            raise ValueError("SyntheticCriteo: drift_fraction needs drift_every (how many batches between changes)")
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
        # Tables without a tail (at most 4096 rows) skip its arithmetic, as before.
        self.coaccess = coaccess
        self._entity_sampler = ZipfSampler(coaccess.entities, coaccess.alpha, self.device) if coaccess else None
        entity_maps = [_Scatter(t.num_rows, _mix(seed, 7, i)) for i, t in enumerate(tables)] if coaccess else None
        by_key: dict[tuple[int, float, bool], list[int]] = {}
        for i, t in enumerate(tables):
            by_key.setdefault((t.bag_size, t.alpha, self.samplers[i].tail is None), []).append(i)
        self.groups = [
            _Group(idx, tables[idx[0]].bag_size, [self.samplers[i] for i in idx], [self.scatters[i] for i in idx],
                   [_phase(_mix(seed, 4, i)) for i in idx], self.table_weights, self.device,
                   [entity_maps[i] for i in idx] if entity_maps else None)
            for idx in by_key.values()
        ]
        self.drift_every = drift_every
        self._drift = _Drift(tables, seed, drift_fraction) if drift_every and drift_fraction > 0 else None
        self._drift_maps: tuple[int, list[tuple[Tensor, Tensor]]] | None = None
        self._bags = torch.tensor([t.bag_size for t in tables], device=self.device)
        self._row_of_table: list[tuple[int, int]] = [(0, 0)] * len(tables)  # (group, row) of each table
        for k, group in enumerate(self.groups):
            for row, i in enumerate(group.indices):
                self._row_of_table[i] = (k, row)
        self._generator = torch.Generator(self.device)
        self._graphs: dict[int, _GraphedBatch | None] = {}

    def _remaps(self, index: int) -> list:
        """Per group, the drift remap of batch ``index`` (None before the first change)."""
        epoch = index // self.drift_every if self._drift is not None else 0
        if epoch == 0:
            return [None] * len(self.groups)
        if self._drift_maps is None or self._drift_maps[0] != epoch:
            maps = self._drift.maps(epoch)
            padded = []
            for group in self.groups:
                width = max(maps[i][0].numel() for i in group.indices)
                keys = torch.full((len(group.indices), width), torch.iinfo(torch.long).max, dtype=torch.long)
                values = torch.zeros_like(keys)
                for row, i in enumerate(group.indices):
                    k, v = maps[i]
                    keys[row, : k.numel()], values[row, : v.numel()] = k, v
                padded.append((keys.to(self.device), values.to(self.device)))
            self._drift_maps = (epoch, padded)
        return [lambda ranks, k=k, v=v: _Drift.lookup(k, v, ranks) for k, v in self._drift_maps[1]]

    def hot_ids(self, table: int, count: int, index: int = 0) -> Tensor:
        """The ``count`` most popular ids of a table's independent draws at batch ``index``,
        hottest first (co-access's entities place theirs elsewhere)."""
        count = min(count, self.tables[table].num_rows)
        ranks = torch.arange(count)
        if self._drift is not None and index // self.drift_every > 0:
            ranks = _Drift.lookup(*self._drift.maps(index // self.drift_every)[table], ranks)
        return self.scatters[table](ranks.to(self.device))

    def batch(self, stream: Stream, index: int, batch_size: int) -> Batch:
        """Batch ``index`` of ``stream``: the same seed and address give the same batch."""
        seed = _mix(self.seed, 3, int(stream), index)
        remaps = self._remaps(index)
        if self.device.type == "cuda" and not any(remaps):
            if batch_size not in self._graphs:
                self._graphs[batch_size] = _GraphedBatch.capture(self, batch_size)
            if self._graphs[batch_size] is not None:
                return self._graphs[batch_size](seed)
        self._generator.manual_seed(seed)
        return self._make(batch_size, remaps)

    def uses_cuda_graph(self, batch_size: int) -> bool:
        """Whether batches of this size are replayed from a CUDA graph (see :class:`_GraphedBatch`;
        batches after a drift change never are)."""
        return self._graphs.get(batch_size) is not None

    def _entities(self, batch_size: int) -> Tensor:
        """Each sample's entity (-1: its ids are drawn independently), from the generator."""
        g = self._generator
        chosen = torch.rand(batch_size, generator=g, device=self.device, dtype=torch.float64) < self.coaccess.share
        return torch.where(chosen, self._entity_sampler.sample(batch_size, g), -1)

    def _make(self, batch_size: int, remaps: list) -> Batch:
        """A batch from the generator as seeded (no host synchronisation: CUDA graphs can hold it)."""
        g = self._generator
        # The draws, table by table in table order, then dense, then labels: the random
        # stream every batch has always used (each table's draw lands in its group's row);
        # co-access draws after them, so without it the batches are unchanged.
        uniforms = [torch.empty(len(grp.indices), batch_size * grp.bag, dtype=torch.float64, device=self.device)
                    for grp in self.groups]
        rows = [u.unbind(0) for u in uniforms]
        for group, row in self._row_of_table:
            rows[group][row].uniform_(generator=g)
        dense = torch.randn(batch_size, NUM_DENSE_FEATURES, generator=g, device=self.device)
        label_draws = torch.rand(batch_size, generator=g, device=self.device, dtype=torch.float64)
        entities = self._entities(batch_size) if self.coaccess else None  # drawn after all the above
        # Row 0 the bias, row 1 + i table i's term of the logit.
        terms = torch.empty(len(self.tables) + 1, batch_size, dtype=torch.float64, device=self.device)
        terms[0] = self.bias
        ids = []
        for group, u, remap in zip(self.groups, uniforms, remaps):
            group_ids, group_terms = group.ids_and_terms(u, remap, entities)
            terms.index_copy_(0, group.term_rows, group_terms)
            ids.append(group_ids)
        logit = _sum_rows_in_order(terms)
        logit += dense.double() @ self.dense_weights
        labels = (label_draws < torch.sigmoid(logit)).float()
        rows = [i.unbind(0) for i in ids]
        values = torch.cat([rows[group][row] for group, row in self._row_of_table])
        lengths = self._bags.view(-1, 1).expand(-1, batch_size).reshape(-1)
        return Batch(dense, SparseFeatures(values, lengths, len(self.tables)), labels)


class _GraphedBatch:
    """One batch size's work recorded as a CUDA graph and replayed: one launch instead of ~100.

    The replay runs the very kernels of the eager batch; its random numbers come from the
    generator's seed and offset as they are at replay (the generator is registered with the
    graph), so they are the eager ones. That is checked on a probe batch before the graph is
    used; where capture fails or the probe differs, batches are made eagerly (with a warning).
    Drifted batches are always made eagerly (their remaps change between epochs).
    """

    def __init__(self, data: SyntheticCriteo, graph, out: Batch):
        self.data, self.graph, self.out = data, graph, out

    def __call__(self, seed: int) -> Batch:
        self.data._generator.manual_seed(seed)
        self.graph.replay()
        out = self.out  # the graph's own buffers, overwritten by the next replay: copied out
        return Batch(out.dense.clone(), SparseFeatures(out.sparse.values.clone(), out.sparse.lengths.clone(),
                                                       out.sparse.num_tables), out.labels.clone())

    @staticmethod
    def capture(data: SyntheticCriteo, batch_size: int) -> "_GraphedBatch | None":
        import warnings

        no_remaps = [None] * len(data.groups)
        try:
            graph = torch.cuda.CUDAGraph()
            graph.register_generator_state(data._generator)
            side = torch.cuda.Stream(data.device)
            side.wait_stream(torch.cuda.current_stream(data.device))
            with torch.cuda.stream(side):  # warm-up outside the graph (lazy initialisation)
                data._make(batch_size, no_remaps)
            torch.cuda.current_stream(data.device).wait_stream(side)
            # thread_local: a capture never makes another thread's CUDA calls fail
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = data._make(batch_size, no_remaps)
            graphed = _GraphedBatch(data, graph, out)
            probe = _mix(data.seed, 6, batch_size)
            got = graphed(probe)
            data._generator.manual_seed(probe)
            want = data._make(batch_size, no_remaps)
            same = (torch.equal(got.sparse.values, want.sparse.values) and torch.equal(got.dense, want.dense)
                    and torch.equal(got.labels, want.labels) and torch.equal(got.sparse.lengths, want.sparse.lengths))
            if same:
                return graphed
            reason = "its probe batch differs from the eager one"
        except Exception as exc:  # any failure: the eager path is always there
            reason = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"SyntheticCriteo: batches of {batch_size} are made without a CUDA graph ({reason})", stacklevel=3)
        return None

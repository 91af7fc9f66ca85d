"""The grouped generator against a frozen copy of the per-table generator it replaced (ids,
lengths, dense features and labels must be bit-identical), and its rate in every record."""

import math
from contextlib import nullcontext

import pytest
import torch
from hypothesis import given, settings, strategies as st

from embbench.data import Stream, SyntheticCriteo, TableSpec, make_tables
from embbench.data.presets import NUM_DENSE_FEATURES
from embbench.data.synthetic import _GraphedBatch, _mix
from embbench.runner import run_cell
from embbench.scenario import Cell, parse_scenario
from embbench.strategy import RuntimeEnv

from tests.conftest import tiny_scenario


# --- frozen: the generator as of commit 7d35393 (one table after another, everything on the
# --- target device), kept verbatim in its arithmetic. Do not edit: it is what "the same
# --- batches as before" means.
class _FrozenZipf:
    def __init__(self, n, alpha, device, head=4096):
        self.n, self.alpha = n, alpha
        self.head = min(n, head)
        ranks = torch.arange(1, self.head + 1, dtype=torch.float64, device=device)
        self.head_cdf = torch.cumsum(ranks.pow(-alpha), 0)
        self.head_mass = float(self.head_cdf[-1])
        self.tail_lo = self.head + 0.5
        if n > self.head:
            if abs(alpha - 1.0) < 1e-12:
                self.tail_mass = math.log((n + 0.5) / self.tail_lo)
            else:
                e = 1.0 - alpha
                self.tail_mass = ((n + 0.5) ** e - self.tail_lo**e) / e
        else:
            self.tail_mass = 0.0
        self.total = self.head_mass + self.tail_mass

    def sample(self, count, generator):
        u = torch.rand(count, dtype=torch.float64, device=self.head_cdf.device, generator=generator) * self.total
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


def _frozen_scatter(n, seed):
    g = torch.Generator().manual_seed(seed)
    a = int(torch.randint(1, max(2, n), (1,), generator=g)) if n > 1 else 1
    while math.gcd(a, n) != 1:
        a += 1
    b = int(torch.randint(0, n, (1,), generator=g))
    return lambda ranks: (ranks * a + b) % n


def _frozen_effect(ids, table_seed):
    phase = (table_seed % 10007) / 10007.0 * 2 * math.pi
    x = torch.sin(ids.double() * 12.9898 + phase) * 43758.5453
    return (x - torch.floor(x)) * 2 - 1


def _frozen_batch(tables, seed, stream, index, batch_size, device="cpu"):
    samplers = [_FrozenZipf(t.num_rows, t.alpha, device) for t in tables]
    scatters = [_frozen_scatter(t.num_rows, _mix(seed, 1, i)) for i, t in enumerate(tables)]
    g0 = torch.Generator().manual_seed(_mix(seed, 2))
    n = len(tables)
    table_weights = (torch.randn(n, generator=g0, dtype=torch.float64) * 2.5 / math.sqrt(n)).to(device)
    dense_weights = (torch.randn(NUM_DENSE_FEATURES, generator=g0, dtype=torch.float64) * 0.3).to(device)
    g = torch.Generator(device).manual_seed(_mix(seed, 3, int(stream), index))
    values, lengths = [], []
    logit = torch.full((batch_size,), -1.0, dtype=torch.float64, device=device)
    for i, (table, sampler, scatter) in enumerate(zip(tables, samplers, scatters)):
        ids = scatter(sampler.sample(batch_size * table.bag_size, g))
        values.append(ids)
        lengths.append(torch.full((batch_size,), table.bag_size, dtype=torch.long, device=device))
        effect = _frozen_effect(ids, _mix(seed, 4, i)).view(batch_size, table.bag_size).mean(1)
        logit += table_weights[i] * effect
    dense = torch.randn(batch_size, NUM_DENSE_FEATURES, generator=g, device=device)
    logit += dense.double() @ dense_weights
    labels = (torch.rand(batch_size, generator=g, device=device, dtype=torch.float64) < torch.sigmoid(logit)).float()
    return torch.cat(values), torch.cat(lengths), dense, labels
# --- end of the frozen copy


def _assert_identical(tables, seed, stream, index, batch_size, data=None, **drift):
    data = data or SyntheticCriteo(tables, seed, **drift)
    got = data.batch(stream, index, batch_size)
    values, lengths, dense, labels = _frozen_batch(tables, seed, stream, index, batch_size, data.device)
    assert torch.equal(got.sparse.values, values)
    assert torch.equal(got.sparse.lengths, lengths) and got.sparse.lengths.dtype == lengths.dtype
    assert torch.equal(got.dense, dense) and got.dense.dtype == dense.dtype
    assert torch.equal(got.labels, labels) and got.labels.dtype == labels.dtype


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # on CUDA: the graph replays too


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset,scale,batch_size", [
    ("criteo_kaggle", 0.001, 512),    # a group with tails and one without
    ("criteo_1tb_freq3", 0.0005, 77), # a batch size no vector width divides
    ("mlperf_dcnv2", 0.0001, 64),     # many bag sizes: many groups
])
def test_batches_are_those_of_the_per_table_generator(preset, scale, batch_size, device):
    tables = make_tables(preset, 8, scale)
    data = SyntheticCriteo(tables, 11, device)  # one generator object for all: no state leaks between batches
    for stream, index, size in [(Stream.TRAIN, 0, batch_size), (Stream.TRAIN, 7, batch_size), (Stream.EVAL, 3, batch_size),
                                (Stream.TRAIN, 7, 1), (Stream.TRAIN, 0, batch_size)]:
        _assert_identical(tables, 11, stream, index, size, data)
    assert data.uses_cuda_graph(batch_size) == (device == "cuda")


def test_drift_off_by_default_and_with_a_zero_fraction():
    tables = make_tables("criteo_kaggle", 8, 0.001)
    _assert_identical(tables, 2, Stream.TRAIN, 25, 128, drift_every=10, drift_fraction=0.0)


@settings(max_examples=25, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 30_000), st.integers(1, 4), st.sampled_from([0.0, 0.5, 0.9, 1.0, 1.15, 1.5, 2.0])),
                      min_size=1, max_size=5),
       batch_size=st.integers(1, 40), index=st.integers(0, 10**6), seed=st.integers(0, 2**31))
def test_any_tables_give_the_per_table_generator_batches(specs, batch_size, index, seed):
    tables = [TableSpec(f"t{i}", n, 4, bag, alpha) for i, (n, bag, alpha) in enumerate(specs)]
    _assert_identical(tables, seed, Stream.TRAIN, index, batch_size)


def test_every_record_carries_the_generators_warm_rate():
    scenario, _ = parse_scenario(tiny_scenario(), "t")
    metrics = run_cell(scenario, Cell("device"), RuntimeEnv(torch.device("cpu")))
    assert metrics["generator_samples_per_s"] > 0 and metrics["warmup_steps_run"] >= 1
    assert metrics["generator_cuda_graph"] is False  # on the CPU batches are made eagerly


class _Stub:
    def wait_stream(self, other):
        pass


def _fake_cuda(monkeypatch, graph_class):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", graph_class)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stub())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stub())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **options: nullcontext())


def test_a_cuda_graph_that_does_not_reproduce_the_eager_batch_is_never_used(monkeypatch):
    class ReplaysNothing:  # its output stays the batch made while "capturing"
        def register_generator_state(self, generator):
            pass

        def replay(self):
            pass

    _fake_cuda(monkeypatch, ReplaysNothing)
    data = SyntheticCriteo(make_tables("criteo_kaggle", 8, 0.001), 0)
    with pytest.warns(UserWarning, match="batches of 32 are made without a CUDA graph .its probe batch differs"):
        assert _GraphedBatch.capture(data, 32) is None


def test_a_cuda_graph_that_cannot_be_made_leaves_the_eager_batches(monkeypatch):
    class NoGenerators:
        def register_generator_state(self, generator):
            raise RuntimeError("no graph-safe generators here")

    _fake_cuda(monkeypatch, NoGenerators)
    data = SyntheticCriteo(make_tables("criteo_kaggle", 8, 0.001), 0)
    with pytest.warns(UserWarning, match="RuntimeError: no graph-safe generators here"):
        assert _GraphedBatch.capture(data, 32) is None
    _assert_identical(data.tables, 0, Stream.TRAIN, 4, 32, data)

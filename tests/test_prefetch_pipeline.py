"""uvm_cache with fbgemm's prefetch pipeline: the driving (hook order, no second prefetch,
per-batch counts) on the CPU through the real runner, with a miniature of fbgemm's TBE
contract in place of its CUDA cache kernels; the real thing on CUDA."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from baselines.torchrec_prefetch import PrefetchPipeline
from baselines.torchrec_tables import (CACHE_FIELDS, UvmCacheParams, UvmCacheStrategy, _UvmCacheTables,
                                       linear_cache_indices)
from embbench.runner import run_cell
from embbench.scenario import Cell, parse_scenario
from embbench.strategy import MemoryFootprint, RuntimeEnv, SparseModule, Strategy
from tests.conftest import requires_cuda, tiny_scenario

CPU = RuntimeEnv(torch.device("cpu"))


def _key(indices: torch.Tensor) -> tuple[int, ...]:
    return tuple(indices.tolist())


class _Done:
    """An awaitable that is already done (torchrec's input_dist with one rank, in effect)."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class _MiniTbe(torch.nn.Module):
    """fbgemm's TBE built with ``prefetch_pipeline=True``, in miniature on the CPU (the contract
    of split_table_batched_embeddings_ops_training.py, 1.6 and 1.8): ``prefetch()`` fills a
    direct-mapped cache and queues the batch; ``forward`` prefetches by itself only when
    nothing is queued; a backward pre-hook (fbgemm waits for the prefetch stream there)."""

    def __init__(self, rows: list[int], dim: int, slots: int, log: list):
        super().__init__()
        self.cache_hash_size_cumsum = torch.tensor([0, *itertools.accumulate(rows)])
        self.cache_index_table_map = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int32),
                                                             torch.tensor(rows))
        self.lxu_cache_state = torch.full((slots,), -1)
        self.lxu_cache_weights = torch.zeros(slots, dim)
        self.D_offsets = torch.arange(len(rows) + 1, dtype=torch.int32) * dim
        self.weight = torch.nn.Parameter(torch.rand(sum(rows), dim) * 0.01)
        self.timesteps_prefetched: list[tuple[int, ...]] = []
        self.linear_of: dict[tuple[int, ...], list[int]] = {}  # each batch's linear cache indices
        self.log = log
        self._training_batch: tuple[int, ...] | None = None
        self.register_full_backward_pre_hook(lambda module, grad: log.append(("backward", self._training_batch)))

    def _linear(self, indices, offsets):
        return linear_cache_indices(indices, offsets, self.cache_hash_size_cumsum, self.cache_index_table_map.numel())

    def prefetch(self, indices, offsets, forward_stream=None):
        self.log.append(("prefetch", _key(indices)))
        self._prefetch(indices, offsets)

    def _prefetch(self, indices, offsets):
        slots = self.lxu_cache_state.numel()
        self.linear_of[_key(indices)] = self._linear(indices, offsets).tolist()
        for row in dict.fromkeys(self.linear_of[_key(indices)]):
            self.lxu_cache_state[row % slots] = row
        self.timesteps_prefetched.append(_key(indices))

    def forward(self, indices, offsets):
        by_itself = not self.timesteps_prefetched
        if by_itself:
            self._prefetch(indices, offsets)
        queued = self.timesteps_prefetched.pop(0)
        self.log.append(("forward", _key(indices), by_itself, queued == _key(indices), torch.is_grad_enabled()))
        if torch.is_grad_enabled():
            self._training_batch = _key(indices)
        features, dim = self.D_offsets.numel() - 1, self.weight.shape[1]
        bags = F.embedding_bag(self._linear(indices, offsets), self.weight, offsets[:-1], mode="sum")
        return bags.view(features, -1, dim).permute(1, 0, 2).reshape(-1, features * dim)


class _MiniSharded(torch.nn.Module):
    """torchrec's ShardedModule API on one rank over one :class:`_MiniTbe`."""

    def __init__(self, tbe: _MiniTbe, keys: list[str], dim: int):
        super().__init__()
        self.tbe, self.keys, self.dim = tbe, keys, dim

    @property
    def module(self):  # DistributedModelParallel.module
        return self

    def create_context(self):
        return SimpleNamespace(record_stream=lambda stream: None)

    def input_dist(self, ctx, kjt):
        return _Done(_Done(kjt))

    def prefetch(self, dist_input, forward_stream=None, ctx=None):
        self.tbe.prefetch(indices=dist_input.values(), offsets=dist_input.offsets(), forward_stream=forward_stream)

    def compute_and_output_dist(self, ctx, dist_input):
        from torchrec.sparse.jagged_tensor import KeyedTensor

        values = self.tbe(dist_input.values(), dist_input.offsets())
        return _Done(KeyedTensor(keys=self.keys, length_per_key=[self.dim] * len(self.keys), values=values))

    def forward(self, kjt):
        ctx = self.create_context()
        return self.compute_and_output_dist(ctx, self.input_dist(ctx, kjt).wait().wait()).wait()


class _MiniUvmCache(_UvmCacheTables):
    """uvm_cache's module (its hooks, pipeline and counting as they are) over the miniature."""

    def __init__(self, ctx, log: list, slots: int, prefetch_pipeline: bool = True):
        SparseModule.__init__(self)
        self.tables, self.keys = ctx.tables, [t.name for t in ctx.tables]
        self.tbe = _MiniTbe([t.num_rows for t in ctx.tables], ctx.tables[0].dim, slots, log)
        self.dmp = _MiniSharded(self.tbe, self.keys, ctx.tables[0].dim)
        self.plan = SimpleNamespace(plan={})
        self._accesses = 0
        self._observe(prefetch_pipeline, ctx.env.device)

    def _tbes(self):
        return [self.tbe]

    def memory(self):
        return MemoryFootprint()

    def flush(self):
        return list(self.tbe.weight.detach().split([t.num_rows for t in self.tables]))


def _run_mini(monkeypatch, slots=64, prefetch_pipeline=True):
    log: list = []
    modules: list = []

    class Mini(Strategy):
        name = "mini_uvm_cache"

        def build(self, ctx):
            modules.append(_MiniUvmCache(ctx, log, slots, prefetch_pipeline))
            return modules[0]

    monkeypatch.setattr(Cell, "make_strategy", lambda cell: Mini())
    raw = tiny_scenario(run={"warmup_steps": 1, "steps": 3, "repeats": 2, "eval_batches": 2})
    scenario, _ = parse_scenario(raw, "test")
    metrics = run_cell(scenario, Cell("mini_uvm_cache"), CPU)
    return log, metrics, modules[0]


def test_prefetch_pipeline_drives_the_tbe_as_torchrec_does(monkeypatch):
    log, metrics, module = _run_mini(monkeypatch)
    trained = [e[1] for e in log if e[0] == "forward" and e[4]]
    prefetched = [e[1] for e in log if e[0] == "prefetch"]
    # 1 warm-up + 2 x 3 measured + 3 counted + 2 operator-counting steps; every step prefetched
    # the next batch once, and the last one (never trained) was drained before evaluation
    assert len(trained) == 12 and prefetched == trained + [prefetched[-1]] and prefetched[-1] not in trained
    for event in log:
        if event[0] == "forward" and event[4]:
            assert event[2] is False, "a training forward prefetched again"
            assert event[3] is True, "a training forward used another batch's prefetched cache locations"
    for i, batch in enumerate(trained[:-1]):
        forward = log.index(("forward", batch, False, True, True))
        backward = log.index(("backward", batch))
        prefetch_next = log.index(("prefetch", trained[i + 1]))
        assert forward < prefetch_next < backward  # batch i+1's prefetch overlaps batch i's backward
    drained = [e for e in log if e[0] == "forward" and e[1] == prefetched[-1]]
    assert drained == [("forward", prefetched[-1], False, True, False)]
    evaluation = [e for e in log if e[0] == "forward" and not e[4] and e[1] != prefetched[-1]]
    assert len(evaluation) == 2 and all(e[2] and e[3] for e in evaluation)  # fbgemm's own prefetch in forward

    # The counters: per prefetched batch, from cache-state snapshots around each prefetch, in
    # the counted steps only (7..9, after the timed 1..6), which prefetched batches 8..10 (0
    # before step 0, then step k prefetched k + 1): the timed steps' prefetches are not counted.
    tbe = module.tbe
    state = torch.full_like(tbe.lxu_cache_state, -1)
    expected = {f: 0 for f in CACHE_FIELDS}
    for index, batch in enumerate(prefetched[:-1]):
        linear = tbe.linear_of[batch]
        before = state.clone()
        for row in dict.fromkeys(linear):
            state[row % state.numel()] = row
        if 8 <= index <= 10:
            resident = set(before.tolist())
            expected["accesses"] += len(linear)
            expected["unique_accesses"] += len(set(linear))
            expected["hits"] += sum(r in resident for r in linear)
            expected["misses"] += sum(r not in resident for r in linear)
            expected["unique_misses"] += len(set(linear) - resident)
            changed = before != state
            expected["rows_admitted"] += int(changed.sum())
            expected["rows_evicted"] += int((changed & (before >= 0)).sum())
    counted = metrics["counters"]["total"]
    assert {f: counted[f] for f in CACHE_FIELDS} == expected
    assert expected["hits"] > 0 and expected["rows_evicted"] > 0  # the check has teeth


def test_without_the_pipeline_the_tbe_prefetches_inside_forward(monkeypatch):
    log, metrics, _ = _run_mini(monkeypatch, prefetch_pipeline=False)
    assert not [e for e in log if e[0] == "prefetch"]
    assert all(e[2] for e in log if e[0] == "forward")
    assert metrics["counters"]["total"]["accesses"] > 0


def test_a_second_prefetch_before_a_forward_is_refused():
    class Sharded:
        def create_context(self):
            return None

        def input_dist(self, ctx, kjt):
            return _Done(_Done(kjt))

        def prefetch(self, **kwargs):
            pass

    pipeline = PrefetchPipeline(Sharded(), torch.device("cpu"))
    pipeline.prefetch(object(), None)
    with pytest.raises(RuntimeError, match="second batch prefetched"):
        pipeline.prefetch(object(), None)


def test_prefetch_pipeline_is_a_parameter_off_by_default_and_lru_only():
    assert UvmCacheParams().prefetch_pipeline is False
    assert "needs CUDA" in UvmCacheStrategy(UvmCacheParams(prefetch_pipeline=True)).unsupported_reason(CPU)
    reason = UvmCacheStrategy(UvmCacheParams(prefetch_pipeline=True, algorithm="lfu")).unsupported_reason(CPU)
    assert "LRU cache only" in reason


@requires_cuda
def test_prefetch_pipeline_trains_like_device_on_cuda(tmp_path):
    """fbgemm's real prefetch pipeline: the same weights as device (exact semantics), each
    batch counted once, nothing left queued in the TBEs after evaluation."""
    raw = tiny_scenario(run={"device": "cuda", "warmup_steps": 2, "steps": 4, "repeats": 2})
    scenario, _ = parse_scenario(raw, "test")
    cuda = RuntimeEnv(torch.device("cuda", 0))
    run_cell(scenario, Cell("device"), cuda, tmp_path / "device.pt")
    metrics = run_cell(scenario, Cell("uvm_cache", {"cache_ratio": 0.05, "prefetch_pipeline": True}), cuda,
                       tmp_path / "pipelined.pt")
    for a, b in zip(torch.load(tmp_path / "pipelined.pt"), torch.load(tmp_path / "device.pt")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    total = metrics["counters"]["total"]
    assert total["accesses"] == total["hits"] + total["misses"] == 8 * 64 * 26


def test_the_pipeline_speaks_torchrecs_sharded_module_api():
    """On torchrec's real sharded collection (the CPU's fused kernel, whose prefetch does
    nothing): the pipelined forward gives what DistributedModelParallel's forward gives, and
    gradients flow back through it."""
    from baselines.torchrec_tables import GpuShardedStrategy
    from embbench.data import TableSpec
    from embbench.optim import EmbeddingOptimizer
    from embbench.runner import initial_weights
    from embbench.strategy import BuildContext
    from tests.test_hooks import _features

    tables = [TableSpec("t0", 50, 4, 1, 1.0), TableSpec("t1", 30, 4, 1, 1.0)]
    ctx = BuildContext(tables=tables, env=CPU, optimizer=EmbeddingOptimizer(type="sgd", lr=0.1), local_batch_size=3,
                       init_weights=lambda t, a, b: initial_weights(tables[t], t, 0, a, b), train_batches=lambda n: iter(()))
    module = GpuShardedStrategy().build(ctx)
    pipeline = PrefetchPipeline(module.dmp.module, torch.device("cpu"))
    features = [_features([[[1], [2, 3], [49]], [[0], [], [29, 7]]]), _features([[[4], [4], [5]], [[1], [2], [3]]])]
    with torch.no_grad():
        expected = [module(f) for f in features]
    pipeline.prefetch(features[0], features[0].to_kjt(module.keys))
    first = module._pooled_values(pipeline.forward(features[0], features[0].to_kjt(module.keys)))
    second = module._pooled_values(pipeline.forward(features[1], features[1].to_kjt(module.keys)))  # not prefetched
    torch.testing.assert_close(first, expected[0])
    torch.testing.assert_close(second, expected[1])
    assert first.requires_grad

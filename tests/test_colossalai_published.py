"""baselines/colossalai.py against the published ColossalAI 0.5.0 ``CachedParamMgr`` itself, fed
the same batches: the same slot of every id, rows admitted and evicted per batch, rows moved,
the same cached rows (and LFU counts); on CUDA, the same host synchronisations.

Skipped where colossalai is not importable (it pins torch <= 2.5.1, so it is never a
dependency): see docs/colossalai-reference.md for the side-directory install it runs with.
On the CPU the published code's CUDA calls (``torch.cuda.current_device``, ``synchronize``,
``Tensor.cuda``, ``pin_memory``) are pointed at the CPU for the test's duration; nothing
else of it is changed."""

from __future__ import annotations

import sys

import pytest
import torch

from baselines.colossalai import ColossalAICache
from embbench.metrics import OpCounter
from tests.test_colossalai import _cache, _ids

published = pytest.importorskip(
    "colossalai.legacy.nn.parallel.layers.cache_embedding.cache_mgr",
    reason="colossalai 0.5.0 is not importable: install it into a side directory and put that on PYTHONPATH "
           "(docs/colossalai-reference.md)")

ROWS, CAPACITY_RATIO, WARMUP, BATCH = 200, 0.1, 0.7, 12


@pytest.fixture
def device(monkeypatch):
    """CUDA where there is one; else the CPU, with the published code's CUDA calls pointed at it."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    return torch.device("cpu")


def _profile() -> tuple[list, torch.Tensor]:
    """Id k seen ROWS - k times: every count distinct, so both rankings agree without ties."""
    counts = torch.arange(ROWS, 0, -1)
    ids = torch.repeat_interleave(torch.arange(ROWS), counts)
    return [_ids(*ids.tolist())], counts


def _stream(seed: int, batches: int = 40) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(BATCH, generator=g) ** 4 * ROWS).long() for _ in range(batches)]  # skewed to low ids


def _pair(policy: str, device: torch.device):
    profile, counts = _profile()
    ref = _cache(ROWS, profile=profile, cache_ratio=CAPACITY_RATIO, warmup_ratio=WARMUP, evict_policy=policy)
    if device.type == "cuda":
        ref = ref.to(device)  # (the reference's CUDA run goes through BuildContext; here its maps only)
    strategy = {"dataset": published.EvictionStrategy.DATASET, "lfu": published.EvictionStrategy.LFU}[policy]
    mgr = published.CachedParamMgr(ref.host[:, : ref.dim].clone(), cuda_row_num=ref.capacity, buffer_size=0,
                                   pin_weight=False, evict_strategy=strategy)
    mgr.reorder(ids_freq_mapping=counts, warmup_ratio=WARMUP)
    return ref, mgr


def _evicted_counts(rows_before: torch.Tensor, rows_after: torch.Tensor, counts_before: torch.Tensor) -> list[int]:
    """The LFU counts of the rows a batch evicted (slots whose row left the cache)."""
    left = ~torch.isin(rows_before, rows_after) & (rows_before >= 0)
    return sorted(counts_before[left].tolist())


def _take_state(mgr, ref: ColossalAICache) -> None:
    """Give the published manager the reference's cache state (after a tie the two broke apart)."""
    mgr.cached_idx_map.copy_(ref.slot_row)
    mgr.inverted_cached_idx.copy_(ref.row_slot)
    mgr.freq_cnter.copy_(ref.slot_count)
    mgr.cuda_cached_weight.data.copy_(ref.cache_weights)
    mgr._cuda_available_row_num = ref.free_slots


@pytest.mark.parametrize("policy", ["dataset", "lfu"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_reference_moves_the_rows_the_published_cache_moves(policy, seed, device):
    """Batch by batch from the same state: the same counts, and (dataset always; lfu unless
    equal counts decided) the same slots, victims and cached rows. LFU's equal counts: the
    reference takes the lowest slot, the published ``topk`` the kernel's order; there the
    victims' counts are the same, and the published manager continues from the reference's state."""
    ref, mgr = _pair(policy, device)
    assert ref.capacity == mgr.cuda_row_num == 20 and ref.preloaded == 14
    assert mgr.idx_map.tolist() == ref.idx_map.tolist()
    assert mgr.cached_idx_map.tolist() == ref.slot_row.tolist()  # the same warm-up
    dim, evictions, ties = ref.dim, 0, 0
    for ids in _stream(seed):
        before, h2d, d2h = ref.counters(), mgr._cpu_to_cuda_numel, mgr._cuda_to_cpu_numel
        rows_before = ref.slot_row.clone()
        counts_before = ref.slot_count.clone() if policy == "lfu" else None
        slots_ref = ref._prepare(ref.idx_map[ids.to(ref.idx_map.device)])
        slots_pub = mgr.prepare_ids(ids.to(mgr.idx_map.device))
        after = ref.counters()
        assert mgr.num_miss_history[-1] == after["rows_admitted"] - before["rows_admitted"]
        assert (mgr._cuda_to_cpu_numel - d2h) // dim == after["rows_evicted"] - before["rows_evicted"]
        assert (mgr._cpu_to_cuda_numel - h2d) // dim * ref.row_bytes == after["bytes_h2d"] - before["bytes_h2d"]
        evictions += after["rows_evicted"] - before["rows_evicted"]
        if policy == "lfu" and mgr.cached_idx_map.tolist() != ref.slot_row.tolist():
            assert (_evicted_counts(rows_before, mgr.cached_idx_map, counts_before)
                    == _evicted_counts(rows_before, ref.slot_row, counts_before))  # a tie, nothing else
            ties += 1
            _take_state(mgr, ref)
            continue
        assert slots_pub.tolist() == slots_ref.tolist()  # every id in the same slot
        assert mgr.cached_idx_map.tolist() == ref.slot_row.tolist()
        occupied = ref.slot_row >= 0
        assert torch.equal(mgr.cuda_cached_weight.detach()[occupied], ref.cache_weights[occupied])
        if policy == "lfu":
            assert mgr.freq_cnter.tolist() == ref.slot_count.tolist()
    assert evictions > 0 and ties < 40  # the stream evicted, and most batches compared slot by slot


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisations are observable on CUDA only")
@pytest.mark.parametrize("policy", ["dataset", "lfu"])
def test_the_reference_waits_for_the_device_where_the_published_cache_does(policy, device):
    """torch.cuda's sync debug mode counts the waits of both, batch by batch (the explicit
    synchronize calls of the published timers are not among them)."""
    ref, mgr = _pair(policy, device)
    for ids in _stream(2, batches=10):
        ids = ids.to(device)
        with OpCounter(device) as theirs:
            mgr.prepare_ids(ids)
        with OpCounter(device) as ours:
            ref._prepare(ref.idx_map[ids])
        assert ours.host_syncs == theirs.host_syncs

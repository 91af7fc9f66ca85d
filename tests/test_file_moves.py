"""store: file's moves on the device side (embbench/cache/file_moves.py; issue 48, item 4): the
training thread reads no device value and does none of the store's bookkeeping in a step, the
write-back ring keeps a row exact when it is loaded again before the host applied it, and the
training thread's host time is counted."""

import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from embbench.cache import file_moves, row_copy
from embbench.cache.file_rows import FileRows
from embbench.cache.slot_lru import SlotLru
from embbench.data import TableSpec
from embbench.host_reads import HostReadCheck
from embbench.optim import EmbeddingOptimizer
from tests.test_file_store import _batches, _pair
from tests.test_freqcache import _train

TABLES = [TableSpec("a", 120_000, 16, 2, 1.0), TableSpec("b", 60_000, 16, 1, 1.0)]


def _on_training_thread(monkeypatch, calls: list[str]) -> None:
    """Record the calls, on the calling thread, that read a tensor on the host (.numpy(),
    .tolist(), .item(), .cpu(): on CUDA each waits for the device, and a CPU's dispatch never
    sees them) or do the store's bookkeeping over a batch (np.unique, the eviction's SlotLru.victims)."""
    me = threading.current_thread()

    def spy(owner, name):
        real = getattr(owner, name)

        def call(*args, **kw):
            if threading.current_thread() is me:
                calls.append(name)
            return real(*args, **kw)

        monkeypatch.setattr(owner, name, call)

    for name in ("numpy", "tolist", "item", "cpu"):
        spy(torch.Tensor, name)
    for name in ("unique", "argpartition"):
        spy(np, name)
    spy(SlotLru, "victims")  # (the eviction's choice)


def _step(module, batches, i) -> torch.Tensor:
    """One training step as the runner drives it (look-ahead, forward, prefetch, backward, end)."""
    module.look_ahead(batches[i + 1: i + 4])
    out = module(batches[i])
    if i + 1 < len(batches):
        module.prefetch(batches[i + 1])
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(i))).sum().backward()
    module.end_step()
    return out.detach()


def test_a_file_store_s_step_reads_no_device_value_and_keeps_the_bookkeeping_off_the_training_thread(monkeypatch):
    """Timed steps (instruments off) of a store whose host memory holds a fifth of the file,
    so that reads, evictions and write-backs happen in them: no operator reads a device value,
    no tensor is read on the host, and np.unique / argpartition run on the bookkeeping thread
    only; the weights are the memory store's, bit for bit."""
    batches = _batches(TABLES, 24, 32, seed=3, hot_share=0.3)
    opt = EmbeddingOptimizer(type="rowwise_adagrad", lr=0.1)
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as folder:
        memory, on_file = _pair(TABLES, batches, opt, folder, cache_ratio=0.002, dram_ratio=0.2)
        for module in (memory, on_file):
            module.store.padded_aggregation = True  # (as on CUDA: on a CPU the backward takes torch.unique)
        on_file.file_moves.compact = False  # (as on CUDA: on a CPU the moves drop their padding first)
        expected = [_step(memory, batches, i) for i in range(len(batches))]
        on_file.set_counting("off")
        got = [_step(on_file, batches, i) for i in range(8)]
        before = on_file.file_rows.counters()
        calls: list[str] = []
        _on_training_thread(monkeypatch, calls)
        with HostReadCheck():
            got += [_step(on_file, batches, i) for i in range(8, len(batches))]
        monkeypatch.undo()
        assert calls == []
        after = on_file.file_rows.counters()
        assert after["nvme_pages_read"] > before["nvme_pages_read"]
        assert after["dram_write_backs"] > before["dram_write_backs"]
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert all(torch.equal(a, b) for a, b in zip(on_file.flush(), memory.flush()))
        on_file.file_rows.close()


@pytest.mark.parametrize("ring", ["searched", "not searched"])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_a_row_written_back_and_loaded_before_the_host_applied_it_comes_from_the_ring(tmp_path, monkeypatch, ring,
                                                                                     kernel):
    """A move writes row 7 back from slot 0; the host has not applied it (the bookkeeping
    thread is held) when the next move loads row 7 into slot 1: the load takes the ring's value,
    not host memory's older one. Without the ring's search it would load the file's value: the
    test sees the ring's work. Host memory has the row once the hold is released. The moves run
    as torch copies (a CPU) and as the Triton kernel CUDA runs (here in Triton's interpreter),
    which addresses a row file's slots by block and row."""
    if kernel == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(row_copy, "_kernel", None)  # (built afresh under the interpreter, and after)
        monkeypatch.setattr(row_copy, "triton_problem", lambda device: None)
    rows = FileRows(tmp_path / "t.rows", 1000, 6, torch.float32, dram_ratio=1.0, batch_blocks=4)
    hold = threading.Event()
    real_apply = file_moves.FileMoves._apply
    monkeypatch.setattr(file_moves.FileMoves, "_apply", lambda self, entry: hold.wait() and real_apply(self, entry))
    if ring == "not searched":
        monkeypatch.setattr(file_moves.FileMoves, "_ring_entries", lambda self: [])
    try:
        rows.fill(lambda a, b: torch.arange(a, b, dtype=torch.float32)[:, None].repeat(1, 6))
        weights, extras = torch.zeros(3, 4), torch.zeros(3, 2)  # slots 0, 1 and the sink (2)
        weights[0], extras[0] = 70.0, 71.0  # row 7 in slot 0, trained
        moves = file_moves.FileMoves(rows, weights, extras, max_ids=4, sink=2, pad_row=1000)
        assert moves.triton == (kernel == "triton") and rows.rows_per_block > 1
        pad_slots, pad_rows, live = torch.full((4,), 2), torch.full((4,), 1000), torch.tensor([4])
        moves.announce(1, torch.tensor([7, -1, -1, -1]))
        moves.move(torch.tensor([0, 2, 2, 2]), torch.tensor([7, 1000, 1000, 1000]), pad_slots, pad_rows, live,
                   number=0, count=False)
        moves.move(pad_slots, pad_rows, torch.tensor([1, 2, 2, 2]), torch.tensor([7, 1000, 1000, 1000]), live,
                   number=1, count=False)
        loaded = (weights[1].tolist(), extras[1].tolist())
        hold.set()
        moves.drain()
        assert rows.gather(np.array([7]))[0].tolist() == [70.0] * 4 + [71.0] * 2
        if ring == "searched":
            assert loaded == ([70.0] * 4, [71.0] * 2)
        else:
            assert loaded == ([7.0] * 4, [7.0] * 2)
    finally:
        hold.set()
        rows.close()
        row_copy._kernel = None


def test_the_training_thread_s_host_time_is_counted():
    batches = _batches(TABLES[:1], 6, 16, seed=1)
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as folder:
        memory, on_file = _pair(TABLES[:1], batches, EmbeddingOptimizer(type="sgd", lr=0.1), folder)
        for module in (memory, on_file):
            first = module.counters()["host_step_us"]
            _train(module, batches, prefetch=True, lookahead=2)
            assert module.counters()["host_step_us"] > first >= 0
        on_file.file_rows.close()


def test_with_a_row_file_the_plan_s_graph_holds_no_move_and_the_late_moves_are_never_captured(monkeypatch, tmp_path):
    """CUDA graphs stay on with a row file: the plan is captured without its moves, which run
    after each replay, and the late moves (host waits for reads) are never captured. On the CPU
    a stand-in graph runs the captured step at each replay; the weights stay the memory store's."""
    from embbench.cache import freqcache

    captured: dict[str, object] = {}

    class Replay:  # a graph's stand-in: replays run the captured step again
        def __init__(self, step, inputs, static_inputs=False):
            self.step, self.shapes = step, [t.shape for t in inputs]
            captured[getattr(step, "__name__", repr(step))] = step

        def fits(self, inputs):
            return [t.shape for t in inputs] == self.shapes

        def __call__(self, *inputs):
            return self.step(*inputs)

    monkeypatch.setattr(freqcache, "CapturedStep", Replay)
    batches = _batches(TABLES, 12, 32, seed=4, hot_share=0.3)
    opt = EmbeddingOptimizer(type="sgd", lr=0.3)
    with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
        memory, on_file = _pair(TABLES, batches, opt, folder, cache_ratio=0.002, dram_ratio=0.2)
        on_file._graphs_on = True
        monkeypatch.setattr(on_file, "_check_first_replay", lambda slots, rows: None)
        expected = [_step(memory, batches, i) for i in range(len(batches))]
        got = [_step(on_file, batches, i) for i in range(len(batches))]
        assert sorted(captured) == ["_steady_planned", "device_enter"]
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert all(torch.equal(a, b) for a, b in zip(on_file.flush(), memory.flush()))
        on_file.file_rows.close()


def test_the_record_has_the_training_thread_s_host_time_a_timed_step(tmp_path):
    """host_step_us over the timed steps (instruments off), per step: positive, and within the
    step's own time (the calls run inside the timed step)."""
    from tests.conftest import tiny_scenario, train_and_flush

    _, metrics = train_and_flush(tiny_scenario(run={"warmup_steps": 2, "steps": 4, "repeats": 2}), "freqcache",
                                 {"cache_ratio": 0.05}, tmp_path=tmp_path)
    assert 0 < metrics["host_step_us_per_step"] <= 1e6 * metrics["step_time_s"]["mean"]


def test_a_batch_s_reads_are_counted_when_its_rows_load_with_the_misses_they_bring(tmp_path):
    """Pages read for a batch and the rows they bring (host memory's misses) are counted at the
    batch's loads, in the same step: a window of counted steps sees both or neither, so its read
    amplification never counts pages without their rows (it did at the window's edges when pages
    were counted at the release, two batches later)."""
    rows = FileRows(tmp_path / "t.rows", 4000, 6, torch.float32, dram_ratio=1.0, batch_blocks=8)
    try:
        rows.fill(lambda a, b: torch.zeros(b - a, 6))
        batch = np.array([5, 400, 900])  # three pages of 170 rows
        rows.announce(0, batch)
        rows.ready_for(0)
        rows.count_loads(batch, 0)
        c = rows.counters()
        assert (c["nvme_pages_read"], c["dram_load_misses"]) == (3, 3)
        rows.release(0)
        assert rows.counters()["nvme_pages_read"] == 3  # (not counted again)
    finally:
        rows.close()


def test_a_row_read_for_a_later_batch_and_first_loaded_by_an_earlier_one_is_that_one_s_miss(tmp_path):
    """Batch 1 is announced with row 5 and its page is read; batch 0 is then announced with row 5
    too (the device evicted it after batch 0 entered the window) and loads it first: host memory
    lacked it when batch 0 needed it, so it is batch 0's miss. Every page read then has its
    useful row: read amplification is one row a page, not more."""
    rows = FileRows(tmp_path / "t.rows", 4000, 6, torch.float32, dram_ratio=1.0, batch_blocks=8)
    try:
        rows.fill(lambda a, b: torch.zeros(b - a, 6))
        rows.announce(0, np.array([900]))
        rows.announce(1, np.array([5]))
        rows.announce(0, np.array([5]))  # (again, with the row the device has evicted since)
        rows.ready_for(0)
        rows.count_loads(np.array([900, 5]), 0)
        rows.ready_for(1)
        rows.count_loads(np.array([], dtype=np.int64), 1)  # (batch 1 finds row 5 on the device)
        c = rows.counters()
        assert (c["nvme_pages_read"], c["dram_loads"], c["dram_load_misses"]) == (2, 2, 2)
    finally:
        rows.close()


def test_a_batch_s_pages_are_used_when_its_rows_load_not_only_when_announced(tmp_path):
    """Batch 0 (page A) is announced before batch 1 (page B), but loads after it was announced:
    host memory evicts B first, as the host path did when it gathered the rows. (Announced
    pages counted as used only when announced made the rows the device writes back later find
    their page evicted: 8x the merge reads at dram_ratio 0.05.)"""
    rows = FileRows(tmp_path / "t.rows", 170 * 6, 6, torch.float32, dram_ratio=0.5, batch_blocks=1)  # 3 of 6 pages
    try:
        rows.fill(lambda a, b: torch.zeros(b - a, 6))
        rows.announce(0, np.array([0]))  # page 0
        rows.announce(1, np.array([170]))  # page 1
        rows.ready_for(0)
        rows.ready_for(1)
        rows.ready_for(0)  # (batch 0's rows load after batch 1 was announced and loaded)
        rows.release(0)
        rows.release(1)
        rows.announce(2, np.array([340, 510]))  # pages 2 and 3: one of pages 0 and 1 must go
        rows.ready_for(2)
        assert rows.block_slot[0] >= 0 and rows.block_slot[1] < 0
    finally:
        rows.close()

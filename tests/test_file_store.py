"""freqcache with its rows in a file (store: file, issue 43): it trains exactly what the host
table trains, in every row precision; its host memory, reads and stalls are counted; a store
left by a killed run is removed, one a live run holds is refused; bad store settings are
errors that name them."""

import errno
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from embbench import owned
from embbench.cache import FreqCache, FreqCacheParams
from embbench.cache.file_rows import FileRows
from embbench.data import SparseFeatures, TableSpec
from embbench.disk.pagefile import PageFile
from embbench.optim import EmbeddingOptimizer
from embbench.row_precision import ROW_PRECISIONS, row_type
from tests.conftest import tiny_scenario, train_and_flush
from tests.test_freqcache import _context, _train


def _batches(tables, steps, batch, seed, hot_share=0.5):
    """Batches whose ids are half from a small hot set (cache hits) and half spread (misses)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        values = []
        for t in tables:
            n = batch * t.bag_size
            hot = torch.randint(0, min(t.num_rows, 20), (n,), generator=g)
            cold = torch.randint(0, t.num_rows, (n,), generator=g)
            values.append(torch.where(torch.rand(n, generator=g) < hot_share, hot, cold))
        lengths = torch.tensor([t.bag_size for t in tables for _ in range(batch)])
        out.append(SparseFeatures(torch.cat(values), lengths, len(tables)))
    return out


def _pair(tables, batches, opt, folder, precision="fp32", cache_ratio=0.01, **file_params):
    ctx = _context(tables, opt, batches)
    ctx.row_precision = precision
    common = dict(cache_ratio=cache_ratio, lookahead=3, belady_steps=0)
    memory = FreqCache(ctx, FreqCacheParams(**common))
    file_params.setdefault("dram_ratio", 1.0)
    file_params.setdefault("drive_probe_s", 0)
    on_file = FreqCache(ctx, FreqCacheParams(**common, store="file", store_dir=str(folder), **file_params))
    return memory, on_file


@settings(max_examples=8, deadline=None)
@given(opt_type=st.sampled_from(["sgd", "rowwise_adagrad"]), dram_ratio=st.sampled_from([0.45, 0.7, 1.0]),
       prefetch_depth=st.integers(0, 3), seed=st.integers(0, 1000), dim=st.sampled_from([4, 8, 40]),
       precision=st.sampled_from(ROW_PRECISIONS), layout=st.sampled_from(["id", "frequency", "table_frequency", "coaccess"]))
@pytest.mark.slow
def test_rows_in_a_file_train_bit_for_bit_what_the_host_table_trains(opt_type, dram_ratio, prefetch_depth, seed, dim,
                                                                    precision, layout):
    per_page = 4096 // row_type(precision).row_bytes(dim, int(opt_type == "rowwise_adagrad"))
    tables = [TableSpec("a", 300 * per_page, dim, 2, 1.0), TableSpec("b", 150 * per_page, dim, 1, 1.0)]
    batches = _batches(tables, 10, 16, seed)
    opt = EmbeddingOptimizer(type=opt_type, lr=0.2)
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as folder:
        memory, on_file = _pair(tables, batches, opt, folder, precision, dram_ratio=dram_ratio, store_layout=layout)
        assert (on_file.file_rows.order.name, len(on_file.file_rows.order.moved) > 0) == (layout, layout != "id")
        expected = _train(memory, batches, prefetch=True, lookahead=prefetch_depth)
        got = _train(on_file, batches, prefetch=True, lookahead=prefetch_depth)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert all(torch.equal(a, b) for a, b in zip(on_file.flush(), memory.flush()))
        c = on_file.counters()
        assert c["nvme_pages_read"] > 0 and c["dram_loads"] >= c["dram_load_misses"] > 0
        assert c["nvme_pages_read_on_demand"] <= c["nvme_pages_read"]
        assert on_file.memory().host_bytes < on_file.file_rows.layout.file_bytes or dram_ratio == 1.0
        path = on_file.file_rows.path
        on_file.file_rows.close()
        assert not path.exists()


# fp32, and fp8 (rows with a scale beside them); fp16 and bf16 pack as fp32 does, and every
# precision is held bit for bit to the memory store above (which test_row_precision holds to device)
@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp8", marks=pytest.mark.slow)])
def test_in_the_runner_a_file_store_trains_device_s_weights_in_every_row_precision(tmp_path, precision):
    raw = tiny_scenario(run={"warmup_steps": 2, "steps": 4, "repeats": 2})
    reference, _ = train_and_flush(raw, "device", tmp_path=tmp_path / "device", row_precision=precision)
    store = tmp_path / "store"
    store.mkdir()
    weights, metrics = train_and_flush(raw, "freqcache", {"cache_ratio": 0.05, "store": "file", "store_dir": str(store),
                                                         "dram_ratio": 1.0}, tmp_path=tmp_path / "file",
                                       row_precision=precision)
    for a, b in zip(weights, reference):
        assert torch.equal(a, b), precision
    extra = metrics["extra"]
    assert extra["store"] == "file" and extra["store_direct"] is True
    assert extra["drive"]["drive"][0]["reads_per_s"] > 0 and extra["drive"]["reader_ceiling_reads_per_s"] > 0
    tiers = {t["tier"]: t for t in metrics["tiers"]}
    assert list(tiers) == ["hbm", "dram", "nvme"]
    first, end = metrics["counters"]["steps"]  # the counted steps
    steps = end - first
    total = metrics["counters"]["total"]
    assert tiers["nvme"]["pages_read_per_step"] == pytest.approx(total["nvme_pages_read"] / steps)
    # the shares over all accesses add up: each distinct row of a batch is found in one tier
    assert sum(t["hit_rate"] for t in tiers.values()) == pytest.approx(1.0)
    # per table too (issue 48, item 5): the tables' counts add up to the whole
    by_table = metrics["tiers_by_table"]
    assert len(by_table) > 1
    for field in ("unique_accesses", "rows_loaded", "rows_written_back", "dram_loads", "dram_load_misses",
                  "dram_write_backs"):
        assert sum(v for k, v in total.items() if k.startswith("table.") and k.endswith("." + field)) == \
            total[{"rows_loaded": "bytes_h2d"}.get(field, field)] // (metrics["row_bytes"] if field == "rows_loaded" else 1)
    for name, table_tiers in by_table.items():
        assert [t["tier"] for t in table_tiers] == ["hbm", "dram", "nvme"]
        assert sum(t["hit_rate"] or 0 for t in table_tiers) == pytest.approx(1.0), name


def test_host_memory_smaller_than_two_batches_is_refused_naming_the_ratio_needed(tmp_path):
    tables = [TableSpec("a", 4000, 8, 2, 1.0)]
    batches = _batches(tables, 4, 64, 0, hot_share=0.0)
    with pytest.raises(ValueError, match=r"dram_ratio 0.01 holds 1 of the store's 32 blocks .* dram_ratio >= 1.00 is needed"):
        _pair(tables, batches, EmbeddingOptimizer(type="sgd", lr=0.1), tmp_path, dram_ratio=0.01)


@pytest.mark.parametrize("bad, message", [
    ({"store": "file", "dram_ratio": 0}, "dram_ratio"),
    ({"store": "file", "dram_ratio": 1.5}, "dram_ratio"),
    ({"store": "file", "io_depth": 0}, "io_depth"),
    ({"dram_ratio": 0.5}, "dram_ratio: only for store: file"),
    ({"store_dir": "/tmp"}, "store_dir: only for store: file"),
    ({"store": "disk"}, "store"),
])
def test_bad_store_parameters_are_errors_that_name_them(bad, message):
    with pytest.raises(ValidationError, match=message):
        FreqCacheParams(**bad)


def test_a_store_dir_that_is_missing_or_a_file_is_named(tmp_path):
    tables = [TableSpec("a", 4000, 8, 1, 1.0)]
    batches = _batches(tables, 2, 8, 0)
    opt = EmbeddingOptimizer(type="sgd", lr=0.1)
    with pytest.raises(ValueError, match=f"store_dir {tmp_path / 'nope'}: does not exist"):
        _pair(tables, batches, opt, tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        _pair(tables, batches, opt, tmp_path / "file")


def _noted(path, run, pid):
    """A row file with the owner note a run writes beside it (embbench.owned)."""
    path.write_bytes(b"\0" * 4096)
    Path(str(path) + owned.NOTE_SUFFIX).write_text(json.dumps({"file": path.name, "run": run, "pids": [pid]}))
    return path


def _dead_pid():
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_killed_run_s_store_is_removed_and_another_live_run_s_refused(tmp_path):
    abandoned = _noted(tmp_path / "embbench-999999-rank0-0.rows", "999999-dead", _dead_pid())
    live = _noted(tmp_path / "embbench-1-rank0-0.rows", "1-other", os.getppid())  # a live process, another run
    tables = [TableSpec("a", 4000, 8, 1, 1.0)]
    batches = _batches(tables, 2, 8, 0)
    opt = EmbeddingOptimizer(type="sgd", lr=0.1)
    with pytest.raises(ValueError, match=r"embbench-1-rank0-0.rows belongs to another run still going"):
        _pair(tables, batches, opt, tmp_path)
    assert live.exists()
    assert not abandoned.exists() and not Path(str(abandoned) + owned.NOTE_SUFFIX).exists()
    os.unlink(str(live) + owned.NOTE_SUFFIX)  # no note: not ours, never touched again
    again = _noted(tmp_path / "embbench-999998-rank0-0.rows", "999998-dead", _dead_pid())
    _, on_file = _pair(tables, batches, opt, tmp_path)
    assert live.exists() and not again.exists()
    assert on_file.extra_metrics()["store_files_removed"] == [str(again)]
    path = on_file.file_rows.path
    assert owned.owner_of(path).run == owned.run_id()  # its own file proves it ours
    on_file.file_rows.close()
    assert not path.exists() and not Path(str(path) + owned.NOTE_SUFFIX).exists()


def test_a_user_s_files_that_only_look_like_row_files_are_never_opened_nor_removed(tmp_path):
    """Issue 50, 1: a name is no proof; a FIFO of that name would block an open for ever."""
    notes = tmp_path / "embbench-notes.rows"
    notes.write_text("mine")
    backup = tmp_path / "embbench-backup-2026.rows"
    backup.write_text("mine too")
    os.mkfifo(tmp_path / "embbench-fifo.rows")
    (tmp_path / ("embbench-fifo.rows" + owned.NOTE_SUFFIX)).write_text(
        json.dumps({"file": "embbench-fifo.rows", "run": "1-x", "pids": [_dead_pid()]}))
    (tmp_path / ("embbench-other.rows" + owned.NOTE_SUFFIX)).write_text(  # a note that names another file
        json.dumps({"file": "embbench-notes.rows", "run": "1-x", "pids": [_dead_pid()]}))
    (tmp_path / "embbench-other.rows").write_text("mine as well")
    tables = [TableSpec("a", 4000, 8, 1, 1.0)]
    _, on_file = _pair(tables, _batches(tables, 2, 8, 0), EmbeddingOptimizer(type="sgd", lr=0.1), tmp_path)
    assert notes.read_text() == "mine" and backup.read_text() == "mine too"
    assert (tmp_path / "embbench-other.rows").read_text() == "mine as well"
    assert (tmp_path / "embbench-fifo.rows").exists()  # not a regular file: left where it is, never opened
    assert on_file.extra_metrics()["store_files_removed"] == []


def test_sibling_ranks_of_one_run_share_a_store_dir(tmp_path):
    """Issue 50, 3: rank 1's file, alive and of this run, is neither taken for another run's nor removed."""
    sibling = _noted(tmp_path / "embbench-1-rank1-0.rows", owned.run_id(), os.getppid())
    tables = [TableSpec("a", 4000, 8, 1, 1.0)]
    _, on_file = _pair(tables, _batches(tables, 2, 8, 0), EmbeddingOptimizer(type="sgd", lr=0.1), tmp_path)
    assert sibling.exists() and on_file.extra_metrics()["store_files_removed"] == []


def test_a_full_disk_fails_the_step_naming_the_file(tmp_path, monkeypatch):
    tables = [TableSpec("a", 60000, 8, 2, 1.0)]
    batches = _batches(tables, 8, 32, 1, hot_share=0.0)
    _, on_file = _pair(tables, batches, EmbeddingOptimizer(type="sgd", lr=0.5), tmp_path, dram_ratio=0.5)
    path = on_file.file_rows.path

    def full(self, pages, data):
        raise OSError(errno.ENOSPC, f"no space left on /dev/x writing {self.path}")

    monkeypatch.setattr(PageFile, "write", full)
    with pytest.raises(OSError, match=f"no space left .* writing {path}"):
        _train(on_file, batches, prefetch=True, lookahead=2)
        on_file.flush()


def test_reads_are_issued_batches_ahead_so_announced_batches_do_not_read_on_demand(tmp_path):
    tables = [TableSpec("a", 100000, 8, 2, 1.0)]
    batches = _batches(tables, 12, 32, 3, hot_share=0.0)
    opt = EmbeddingOptimizer(type="sgd", lr=0.1)
    _, ahead = _pair(tables, batches, opt, tmp_path, dram_ratio=0.5, profile_batches=1)  # the rest are misses
    before = ahead.counters()["nvme_pages_read_on_demand"]  # the preload's
    _train(ahead, batches, prefetch=True, lookahead=3)
    after = ahead.counters()
    # every training batch after the first was announced before it was planned: its loads
    # found their blocks read (or in flight); only write-backs into absent blocks patch the file
    assert after["nvme_pages_read_on_demand"] - before <= len(np.unique(batches[0].values.numpy() // ahead.file_rows.rows_per_block))
    assert after["nvme_pages_read"] - after["nvme_pages_read_on_demand"] > 0  # the announcements' reads


def test_a_table_larger_than_host_memory_never_holds_more_than_its_share(tmp_path):
    rows = FileRows(tmp_path / "t.rows", 100_000, 10, torch.float32, dram_ratio=0.1, batch_blocks=40)
    try:
        rows.fill(lambda a, b: torch.arange(a, b, dtype=torch.float32)[:, None].repeat(1, 10))
        assert rows.buffer.nbytes == rows.capacity * 4096 <= 0.1 * rows.layout.file_bytes + 4096
        wanted = np.random.default_rng(0).choice(100_000, 5000, replace=False)
        got = rows.gather(wanted)  # more blocks than host memory holds: read a part at a time
        assert torch.equal(got[:, 0], torch.from_numpy(wanted).float())
        rows.scatter(wanted[:10], torch.full((10, 10), -1.0))
        rows.gather(np.arange(0, 100_000, 7))  # evicts every block: the dirty ones are written
        assert rows.counters()["nvme_pages_written"] > 0
        table = rows.table()
        assert torch.equal(table[wanted[:10]], torch.full((10, 10), -1.0))
        others = np.setdiff1d(np.arange(100_000), wanted[:10])
        assert torch.equal(table[others, 0], torch.from_numpy(others).float())
    finally:
        rows.close()


def _file_cell(store_dir=None, dram_ratio=0.1):
    from embbench.launch import memory_preflight
    from embbench.scenario import Cell, parse_scenario

    # tables large enough that a tenth of the row file holds two batches' blocks
    scenario, _ = parse_scenario(tiny_scenario(data={"scale": 0.2}), "t.yaml")
    params = {"store": "file", "dram_ratio": dram_ratio, **({"store_dir": str(store_dir)} if store_dir else {})}
    return scenario, Cell("freqcache", params, 1), memory_preflight


def test_the_preflight_holds_the_row_file_to_its_drive_and_host_memory_to_the_cached_share(tmp_path, monkeypatch):
    import shutil

    scenario, cell, preflight = _file_cell(tmp_path, dram_ratio=0.1)
    est = cell.make_strategy().estimate_memory(scenario.tables(), scenario.optimizer.embedding, 1, local_batch_size=64,
                                               train_steps=10)
    assert est.disk_bytes > 0 and est.disk_dir == str(tmp_path)
    from embbench.scenario import Cell

    memory = Cell("freqcache", {}, 1).make_strategy().estimate_memory(
        scenario.tables(), scenario.optimizer.embedding, 1, local_batch_size=64, train_steps=10)
    assert est.host_bytes < 0.5 * memory.host_bytes  # the cached share of the file, not the table
    assert preflight(scenario, cell, torch.device("cpu"))[1] is None
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=est.disk_bytes - 1))
    reason = preflight(scenario, cell, torch.device("cpu"))[1]
    assert reason.startswith(f"not attempted: estimated") and f"files in {tmp_path}" in reason and "GiB free" in reason


def test_the_preflight_names_a_store_dir_that_is_missing(tmp_path):
    scenario, cell, preflight = _file_cell(tmp_path / "gone")
    assert preflight(scenario, cell, torch.device("cpu"))[1] == f"not attempted: store_dir {tmp_path / 'gone'} does not exist"


def test_embbench_disk_measures_a_folder_and_names_a_missing_one(tmp_path, capsys):
    from embbench.cli import main

    assert main(["disk", str(tmp_path), "--seconds", "0.05", "--depths", "1,4", "--file-size", "4MiB", "--json"]) == 0
    import json

    probe = json.loads(capsys.readouterr().out)
    assert [d["depth"] for d in probe["drive"]] == [1, 4]
    assert main(["disk", str(tmp_path / "nope")]) == 2
    assert str(tmp_path / "nope") in capsys.readouterr().err


def test_reads_issued_ahead_are_counted_in_the_step_whose_rows_they_bring(tmp_path):
    """A timed window's counters must hold the reads of the batches it trains, even when the
    look-ahead issued them before the window began (and not those it issues for later ones)."""
    rows = FileRows(tmp_path / "t.rows", 50_000, 10, torch.float32, dram_ratio=1.0, batch_blocks=100)
    try:
        rows.fill(lambda a, b: torch.zeros(b - a, 10))
        batches = [np.arange(k * 4000, k * 4000 + 400, 7) for k in range(6)]
        for number, batch in enumerate(batches):
            rows.announce(number, batch)  # all issued now: host memory holds the whole file
        assert rows.counters()["nvme_pages_read"] == 0  # nothing consumed yet
        per_batch = []
        for number, batch in enumerate(batches):
            before = rows.counters()["nvme_pages_read"]
            rows.gather(batch, number)
            rows.release(number)
            per_batch.append(rows.counters()["nvme_pages_read"] - before)
        assert per_batch == [len(np.unique(b // rows.rows_per_block)) for b in batches]
        c = rows.counters()
        assert c["nvme_pages_read_ahead"] == c["nvme_pages_read"] and c["nvme_read_ns"] > 0
    finally:
        rows.close()


def test_a_read_on_demand_never_evicts_a_block_the_same_lookup_uses(tmp_path):
    """No look-ahead and a small host memory: every plan reads on demand, and the victims it
    picks must not be the blocks its other rows sit in (they read another block's bytes: found
    by hypothesis as fp16 and bf16 rows diverging at the fifth step)."""
    dim = 40
    tables = [TableSpec("a", 300 * 25, dim, 2, 1.0), TableSpec("b", 150 * 25, dim, 1, 1.0)]
    batches = _batches(tables, 10, 16, 0)
    opt = EmbeddingOptimizer(type="sgd", lr=0.2)
    memory, on_file = _pair(tables, batches, opt, tmp_path, "fp16", dram_ratio=0.45)
    expected = _train(memory, batches, prefetch=True, lookahead=0)
    got = _train(on_file, batches, prefetch=True, lookahead=0)
    assert on_file.counters()["nvme_pages_read_on_demand"] > 0
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_preflight_counts_the_drive_probe_s_scratch_and_a_dead_run_s_leftovers(tmp_path, monkeypatch):
    """Issue 50, 5 and 2: the probe's 256 MiB scratch file is held to the drive with the rows; a
    dead run's row file (proved by its owner note) is space the next run frees."""
    import shutil

    from embbench.scenario import Cell

    scenario, cell, preflight = _file_cell(tmp_path, dram_ratio=0.1)
    est = cell.make_strategy().estimate_memory(scenario.tables(), scenario.optimizer.embedding, 1)
    assert est.scratch_bytes == 256 << 20
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=est.disk_bytes + (100 << 20)))
    reason = preflight(scenario, cell, torch.device("cpu"))[1]
    assert "0.25 GiB of scratch" in reason and reason.cause == "drive"
    no_probe = Cell("freqcache", {**cell.params, "drive_probe_s": 0}, 1)
    assert preflight(scenario, no_probe, torch.device("cpu"))[1] is None
    leftover = _noted(tmp_path / "embbench-999999-rank0-0.rows", "999999-dead", _dead_pid())
    with open(leftover, "r+b") as f:
        os.posix_fallocate(f.fileno(), 0, 200 << 20)
    assert preflight(scenario, cell, torch.device("cpu"))[1] is None


def test_a_store_dir_refusal_is_not_called_a_memory_one(tmp_path, capsys):
    """Issue 50, 5: the closing line names the store_dir, and searches no --scale."""
    import yaml

    from embbench.cli import main

    raw = tiny_scenario(strategies=[{"name": "freqcache", "params": {"store": "file", "store_dir": str(tmp_path / "no")}}],
                        baseline="freqcache")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["run", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "1 cell(s) cannot use their store_dir" in out
    assert "would not fit" not in out and "scale" not in out


def test_a_drive_without_room_for_the_probe_skips_the_probe_not_the_cell(tmp_path, monkeypatch):
    """Issue 50, 5: the probe is optional; a drive filled since the preflight costs its figures only."""
    from embbench.cache import freqcache

    def full(folder, *args, **kw):
        raise OSError(errno.ENOSPC, f"not enough space for the probe's scratch file in {folder}: needs 256 MiB")

    monkeypatch.setattr(freqcache, "measure_drive", full)
    tables = [TableSpec("a", 4000, 8, 1, 1.0)]
    _, on_file = _pair(tables, _batches(tables, 2, 8, 0), EmbeddingOptimizer(type="sgd", lr=0.1), tmp_path,
                       drive_probe_s=0.1)
    drive = on_file.extra_metrics()["drive"]
    assert drive["problem"].startswith("not measured: not enough space for the probe's scratch file")


def test_the_preflight_refuses_from_the_profile_what_the_build_would_and_says_it_the_same_way(tmp_path):
    """Issue 49, 2: host memory for two batches' blocks depends on the batches' shape and data only:
    the preflight makes them as the rank does and refuses with the rank's own words, so --dry-run
    shows it; a ratio that holds them passes."""
    from embbench.runner import run_cell
    from embbench.scenario import Cell, parse_scenario
    from embbench.strategy import RuntimeEnv

    scenario, cell, preflight = _file_cell(tmp_path, dram_ratio=0.002)
    cell = Cell("freqcache", {**cell.params, "drive_probe_s": 0}, 1)
    reason = preflight(scenario, cell, torch.device("cpu"))[1]
    assert reason is not None and reason.cause == "shape" and "host memory must hold two batches'" in reason
    with pytest.raises(ValueError) as built:
        run_cell(scenario, cell, RuntimeEnv(torch.device("cpu")), None)
    assert reason == f"not attempted: {built.value}"
    needed = float(reason.rsplit("dram_ratio >= ", 1)[1].split()[0])
    enough = Cell("freqcache", {**cell.params, "dram_ratio": needed}, 1)
    assert preflight(scenario, enough, torch.device("cpu"))[1] is None


class _HeldEngine:
    """An engine whose submissions wait until the test lets them run (through a real engine):
    shows what the store keeps in flight at once."""

    def __init__(self, real):
        self.real, self.held, self.name = real, [], "held"

    def submit(self, fd, pages, buf, buf_pages, write, urgent=False):
        engine = self

        class Held:
            ticket = None

            def done(self):
                return self.ticket is not None and self.ticket.done()

            def wait(self):
                if self.ticket is None:
                    self.ticket = engine.real.submit(fd, pages, buf, buf_pages, write, urgent)
                self.ticket.wait()

        held = Held()
        self.held.append((len(pages), write, urgent, held))
        return held

    def stats(self):
        return self.real.stats()

    def close(self):
        self.real.close()


def test_announced_batches_are_in_flight_together_and_read_straight_into_their_slots(tmp_path, monkeypatch):
    import embbench.cache.file_rows as file_rows_module

    rows = FileRows(tmp_path / "t.rows", 50_000, 10, torch.float32, dram_ratio=1.0, batch_blocks=100)
    try:
        rows.fill(lambda a, b: torch.arange(a, b, dtype=torch.float32)[:, None].repeat(1, 10))
        rows.engine = _HeldEngine(rows.engine)
        staged = []
        real_aligned = file_rows_module.aligned_pages
        monkeypatch.setattr(file_rows_module, "aligned_pages", lambda n: staged.append(n) or real_aligned(n))
        batches = [np.arange(k * 5000, k * 5000 + 600, 7) for k in range(3)]
        for number, batch in enumerate(batches):
            rows.announce(number, batch)
        rows.counters()  # (waits for the announcements' bookkeeping, not for their reads)
        # three batches' reads queued at once, none waited for: the engine keeps them in flight together
        assert [(n, write, urgent) for n, write, urgent, _ in rows.engine.held] == \
            [(len(np.unique(b // rows.rows_per_block)), False, False) for b in batches]
        for number, batch in enumerate(batches):
            assert torch.equal(rows.gather(batch, number)[:, 0], torch.from_numpy(batch).float())
            rows.release(number)
        assert staged == []  # no staging buffer: the pages landed in their slots
        assert rows.counters()["nvme_pages_read_on_demand"] == 0
    finally:
        rows.close()


def test_a_dirty_block_evicted_and_read_again_at_once_reads_what_was_written(tmp_path):
    """The write-back goes from a copy while the slot is read into; a read of the same block
    later must wait for that write (else it reads the old bytes). Transfers run only when
    waited for here, so a read that does not wait for its block's write reads old bytes."""
    rows = FileRows(tmp_path / "t.rows", 30_000, 10, torch.float32, dram_ratio=0.1, batch_blocks=12)
    try:
        rows.fill(lambda a, b: torch.zeros(b - a, 10))
        rows.engine = _HeldEngine(rows.engine)
        rng = np.random.default_rng(0)
        expected = torch.zeros(30_000, 10)
        for step in range(60):  # 10 rows of the first 40 blocks a step, in host memory of 30
            batch = np.unique(rng.integers(0, 40 * rows.rows_per_block, 10))
            rows.announce(step, batch)
            got = rows.gather(batch, step)
            assert torch.equal(got, expected[batch])
            new = got + 1
            rows.scatter(batch, new)
            expected[batch] = new
            rows.release(step)
        assert rows.counters()["nvme_pages_written"] > 0
        assert torch.equal(rows.table(), expected)
    finally:
        rows.close()


def _spread_batches(steps, batch, pool, seed, rows=100_000):
    """Batches of ids among ``pool`` rows, each in its own page (one table of ``rows``)."""
    g = torch.Generator().manual_seed(seed)
    return [SparseFeatures(torch.randint(0, pool, (2 * batch,), generator=g) * (rows // pool),
                           torch.full((batch,), 2), 1) for _ in range(steps)]


def test_rows_the_device_holds_are_not_read_from_the_drive(tmp_path):
    """Issue 50, 12: every batch's rows are in the device cache (the profile preloads them all),
    and host memory holds fewer of their pages than the device holds rows: the store reads no
    page for them (it read them again and again, a batch's announcement at a time)."""
    tables = [TableSpec("a", 100_000, 8, 2, 1.0)]
    batches = _spread_batches(12, 32, 400, 5)
    ctx = _context(tables, EmbeddingOptimizer(type="sgd", lr=0.1), batches)
    on_file = FreqCache(ctx, FreqCacheParams(cache_ratio=0.01, lookahead=3, belady_steps=0, store="file",
                                             store_dir=str(tmp_path), dram_ratio=0.25, drive_probe_s=0))
    before = on_file.counters()
    _train(on_file, batches, prefetch=True, lookahead=3)
    after = on_file.counters()
    assert after["hits"] == after["accesses"] > 0  # a 100 % device hit rate
    assert after["nvme_pages_read"] == before["nvme_pages_read"]


def test_rows_the_device_evicts_after_their_batch_is_announced_are_read_before_its_plan(tmp_path):
    """A small device cache that churns: rows it held when their batch was announced and has
    evicted since are announced again before the plan, so that no plan reads on demand."""
    tables = [TableSpec("a", 100_000, 8, 2, 1.0)]
    batches = _spread_batches(24, 32, 600, 3)
    ctx = _context(tables, EmbeddingOptimizer(type="sgd", lr=0.1), batches)
    on_file = FreqCache(ctx, FreqCacheParams(cache_ratio=0.001, lookahead=6, belady_steps=0, store="file",
                                             store_dir=str(tmp_path), dram_ratio=0.45, drive_probe_s=0,
                                             profile_batches=1))
    before = on_file.counters()
    _train(on_file, batches, prefetch=True, lookahead=6)
    after = on_file.counters()
    assert after["rows_evicted"] > 0 and after["nvme_pages_read"] > before["nvme_pages_read"]
    assert after["nvme_pages_read_on_demand"] == before["nvme_pages_read_on_demand"]


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 400), seed=st.integers(0, 10_000), batches=st.integers(0, 6))
def test_the_frequency_order_is_a_permutation_with_the_most_used_rows_first(rows, seed, batches):
    from embbench.disk.layout import RowOrder

    rng = np.random.default_rng(seed)
    profiled = [rng.zipf(1.3, 30) % rows for _ in range(batches)]
    order = RowOrder.by_frequency(rows, profiled)
    places = order.place(np.arange(rows))
    assert sorted(places.tolist()) == list(range(rows))
    assert np.array_equal(order.row_at(places), np.arange(rows))
    used = np.bincount(np.concatenate([np.unique(b) for b in profiled]).astype(np.int64), minlength=rows) \
        if batches else np.zeros(rows, np.int64)
    hot = np.flatnonzero(used >= 2)
    expected = hot[np.lexsort((hot, -used[hot]))]
    assert np.array_equal(order.row_at(np.arange(len(hot))), expected)  # most used first, at the first places
    assert len(order.moved) <= 2 * len(hot)
    starts = sorted({0, *rng.integers(1, rows, 2).tolist()}) if rows > 1 else [0]
    by_table = RowOrder.by_table_frequency(rows, profiled, starts)
    places = by_table.place(np.arange(rows))
    assert sorted(places.tolist()) == list(range(rows))
    for lo, hi in zip(starts, [*starts[1:], rows]):  # each table's rows stay in its range, the seen ones first
        assert ((places[lo:hi] >= lo) & (places[lo:hi] < hi)).all()
        seen = np.flatnonzero(used[lo:hi] >= 1) + lo
        assert set(by_table.row_at(np.arange(lo, lo + len(seen))).tolist()) == set(seen.tolist())


@pytest.mark.parametrize("layout", ["frequency", "coaccess"])
def test_a_file_in_another_order_holds_and_returns_every_row_where_the_caller_asks(tmp_path, layout):
    from embbench.disk.layout import RowOrder

    rng = np.random.default_rng(0)
    profiled = [rng.integers(0, 20_000, 3000) for _ in range(4)]
    order = RowOrder.by_frequency(20_000, profiled) if layout == "frequency" else \
        RowOrder.by_coaccess(20_000, profiled, [np.arange(3000) // 3 for _ in profiled], 102, 500)
    assert len(order.moved) > 1000
    rows = FileRows(tmp_path / "t.rows", 20_000, 10, torch.float32, dram_ratio=0.5, batch_blocks=40, order=order)
    try:
        rows.fill(lambda a, b: torch.arange(a, b, dtype=torch.float32)[:, None].repeat(1, 10), chunk_blocks=16)
        wanted = rng.choice(20_000, 90, replace=False)
        assert torch.equal(rows.gather(wanted)[:, 0], torch.from_numpy(wanted).float())
        rows.scatter(wanted[:5], torch.full((5, 10), -1.0))
        expected = torch.arange(20_000, dtype=torch.float32)[:, None].repeat(1, 10)
        expected[wanted[:5]] = -1
        assert torch.equal(rows.table(), expected)
        assert rows.describe()["store_layout"] == layout
    finally:
        rows.close()


def test_each_table_s_counts_add_up_to_the_whole_in_both_stores(tmp_path):
    from embbench.metrics import memory_tiers, tiers_by_table

    tables = [TableSpec("a", 30_000, 8, 2, 1.0), TableSpec("b", 9000, 8, 1, 1.0), TableSpec("c", 40, 8, 1, 1.0)]
    batches = _batches(tables, 8, 32, 2)
    memory, on_file = _pair(tables, batches, EmbeddingOptimizer(type="sgd", lr=0.1), tmp_path, dram_ratio=0.6)
    for cache in (memory, on_file):
        cache.set_counting("counted")  # per-table counts are an instrument: counted steps only
        before = cache.counters()
        _train(cache, batches, prefetch=True, lookahead=2)
        c = {k: v - before.get(k, 0) for k, v in cache.counters().items()}
        per = {name: {k.rsplit(".", 1)[1]: v for k, v in c.items() if k.startswith(f"table.{name}.")} for name in "abc"}
        assert sum(p["unique_accesses"] for p in per.values()) == c["unique_accesses"] > 0
        assert sum(p["rows_loaded"] for p in per.values()) * cache.row_bytes == c["bytes_h2d"] > 0
        assert sum(p["rows_written_back"] for p in per.values()) == c["rows_written_back"]
        if cache is on_file:
            assert sum(p["dram_loads"] for p in per.values()) == c["dram_loads"]
            assert sum(p["dram_load_misses"] for p in per.values()) == c["dram_load_misses"]
        by_table = tiers_by_table(c, 8, cache.row_bytes)
        whole = memory_tiers(c, 8, cache.row_bytes)
        assert [t["tier"] for t in by_table["a"]] == [t["tier"] for t in whole]
        for tier in range(len(whole)):  # the tables' rows a step add up to the whole's
            assert sum(by_table[n][tier]["reaching_per_step"] for n in "abc") == pytest.approx(whole[tier]["reaching_per_step"])


def test_an_announcement_s_bookkeeping_runs_off_the_caller_s_thread(tmp_path, monkeypatch):
    """Issue 48, item 4 (the part built): np.unique over an announced batch, and the eviction's
    choice of victims, run on the store's bookkeeping thread; the caller only hands the rows over."""
    import threading

    from embbench.cache.slot_lru import SlotLru

    rows = FileRows(tmp_path / "t.rows", 50_000, 10, torch.float32, dram_ratio=0.3, batch_blocks=60)
    try:
        rows.fill(lambda a, b: torch.arange(a, b, dtype=torch.float32)[:, None].repeat(1, 10))
        callers = []
        for owner, name in ((np, "unique"), (SlotLru, "victims")):
            real = getattr(owner, name)
            monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **kw:
                                callers.append((_name, threading.current_thread().name)) or _real(*a, **kw))
        me = threading.current_thread().name
        batches = [np.random.default_rng(k).choice(50_000, 40, replace=False) for k in range(12)]
        for number, batch in enumerate(batches):
            rows.announce(number, batch)
            assert [c for c in callers if c[1] == me] == []
        rows.counters()  # (waits for the announcements' bookkeeping)
        monkeypatch.undo()
        assert {name for name, _ in callers} == {"unique", "victims"}  # (done, on the other thread)
        for number, batch in enumerate(batches):
            assert torch.equal(rows.gather(batch, number)[:, 0], torch.from_numpy(batch).float())
            rows.release(number)
    finally:
        rows.close()


def test_the_per_table_counts_are_off_while_the_store_is_not_counting(tmp_path):
    """Per-table counts are an instrument (FreqCache.set_counting switches them): off, a gather
    and a scatter count nothing per table; on, they count every row."""
    rows = FileRows(tmp_path / "t.rows", 4000, 10, torch.float32, dram_ratio=1.0, batch_blocks=40,
                    table_starts=np.array([0, 2000]))
    try:
        rows.fill(lambda a, b: torch.zeros(b - a, 10))
        batch = np.array([1, 2, 2500, 3999])
        rows.counting = False
        rows.scatter(batch, rows.gather(batch))
        assert rows.table_counts.sum() == 0
        rows.counting = True
        rows.scatter(batch, rows.gather(batch))
        assert rows.table_counts[:, 0].tolist() == [2, 2] and rows.table_counts[:, 2].tolist() == [2, 2]
    finally:
        rows.close()

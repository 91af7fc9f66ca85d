"""The memory preflight: a cell is checked against the host and GPU memory free now, before
any rank pins host memory or allocates managed memory (readings monkeypatched: no GPU here)."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import torch

from embbench import launch
from embbench.launch import memory_preflight, run_cells
from embbench.scenario import Cell, parse_scenario
from tests.conftest import tiny_scenario

GiB = 1 << 30


def _one_tb(dim: int) -> dict:
    """The 1TB shape's tables (nothing is generated: only their sizes are read)."""
    return tiny_scenario(data={"preset": "criteo_1tb_freq3", "scale": 1.0, "embedding_dim": dim, "batch_size": 16384},
                         model={"bottom_mlp": [dim], "top_mlp": [16, 1]}, run={"device": "cuda"})


def _h100(monkeypatch, free_gib: float, total_gib: float = 79.2):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(launch, "_free_device_bytes", lambda device: (int(free_gib * GiB), int(total_gib * GiB)))
    monkeypatch.setattr(launch, "_free_host_bytes", lambda: (120 * GiB, "MemAvailable"))


def test_the_1tb_device_cell_fits_an_h100_at_dim_64_and_is_refused_at_dim_128(monkeypatch):
    _h100(monkeypatch, free_gib=78.0)
    scenario, _ = parse_scenario(_one_tb(64), "1tb64.yaml")
    estimate, refused = memory_preflight(scenario, Cell("device"), torch.device("cuda"))
    assert refused is None and 45e9 < estimate["device"] < 47e9  # 177.9M rows x (64 + 1 state) x 4 B
    scenario, _ = parse_scenario(_one_tb(128), "1tb128.yaml")
    estimate, refused = memory_preflight(scenario, Cell("device"), torch.device("cuda"))
    assert 91e9 < estimate["device"] < 93e9
    assert refused.startswith("not attempted: estimated 85.5 GiB of device memory per rank, GPU 0 has 78.0 GiB free "
                              "of 79.2 GiB")


def test_free_gpu_memory_not_its_size_decides(monkeypatch):
    _h100(monkeypatch, free_gib=30.0)  # another process holds most of the GPU
    scenario, _ = parse_scenario(_one_tb(64), "1tb64.yaml")
    _, refused = memory_preflight(scenario, Cell("device"), torch.device("cuda"))
    assert "GPU 0 has 30.0 GiB free of 79.2 GiB" in refused


def test_free_host_memory_decides_for_host_resident_placements(monkeypatch, tmp_path):
    _h100(monkeypatch, free_gib=78.0)
    monkeypatch.setattr(launch, "_free_host_bytes", lambda: (60 * GiB, "room under the cgroup's memory limit"))
    monkeypatch.setattr(launch, "_host_memory_bytes", lambda: 128 * GiB)
    raw = _one_tb(128)
    raw["strategies"] = [{"name": "device"}, {"name": "cpu"}]
    scenario, cells = parse_scenario(raw, "1tb128.yaml")
    _, refused = memory_preflight(scenario, Cell("cpu"), torch.device("cuda"))
    assert refused.startswith("not attempted: estimated 87.5 GiB of host memory (1 rank(s) x 85.51 GiB + 2.00 GiB a "
                              "rank's process), this machine has 60.0 GiB free (room under the cgroup's memory limit; "
                              "128.0 GiB in all), of which a cell may take 90%")
    # run_cells records both as oom with the numbers, launching nothing
    monkeypatch.setattr(launch, "resolve_device", lambda requested: torch.device("cuda"))
    monkeypatch.setattr(launch, "_plugin_refusal", lambda cell, env: None)
    monkeypatch.setattr(launch, "provenance", lambda strategy: {})  # it would ask the (absent) GPU
    launched = []
    monkeypatch.setattr(launch, "run_isolated", lambda *a, **k: launched.append(a))
    records = run_cells(scenario, "1tb128.yaml", cells, tmp_path)
    assert [r.status for r in records] == ["skipped", "skipped"] and not launched
    assert "GiB free" in records[0].message and "GiB free" in records[1].message


def test_gpu_memory_is_read_with_nvidia_smi_without_a_cuda_context(monkeypatch):
    props = SimpleNamespace(uuid="1234-abcd", total_memory=80 * GiB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    calls = []

    def fake_run(argv, **kwargs):
        calls.append(argv)
        return SimpleNamespace(stdout="61440, 81559\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert launch._free_device_bytes(torch.device("cuda", 0)) == (61440 << 20, 81559 << 20)
    assert calls[0][1] == "--id=GPU-1234-abcd"

    def no_smi(argv, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", no_smi)
    assert launch._free_device_bytes(torch.device("cuda", 0)) == (80 * GiB, 80 * GiB)


def test_free_host_memory_is_at_most_the_machine():
    free, source = launch._free_host_bytes()
    assert 0 < free <= launch._host_memory_bytes() and source


def test_managed_memory_beyond_the_gpu_s_free_memory_is_refused_with_the_numbers(monkeypatch):
    """uvm and uvm_cache keep their tables in CUDA managed memory: at the 1TB shape, dim 128,
    that is 85.5 GiB, more than an H100 holds; oversubscribed, it can hang the GPU."""
    _h100(monkeypatch, free_gib=78.0)
    for dim, fits in ((64, True), (128, False)):
        raw = _one_tb(dim)
        raw["strategies"] = [{"name": "device"}, {"name": "uvm"}, {"name": "uvm_cache"}]
        scenario, _ = parse_scenario(raw, f"1tb{dim}.yaml")
        for strategy in ("uvm", "uvm_cache"):
            _, refused = memory_preflight(scenario, Cell(strategy), torch.device("cuda"))
            assert (refused is None) == fits, (dim, strategy, refused)
            if not fits:
                assert refused.startswith("not attempted: estimated 85.5 GiB of managed (unified) memory per rank beside "), refused
                assert "GPU 0 has 78.0 GiB free of 79.2 GiB: managed memory beyond the GPU's free memory can hang it" in refused


def test_pinned_host_memory_beyond_the_host_s_free_memory_is_refused_with_the_numbers(monkeypatch):
    """freqcache's host table is pinned (host-mapped) on CUDA: it must fit the host's free memory."""
    from embbench.strategy import MemoryFootprint

    _h100(monkeypatch, free_gib=78.0)
    monkeypatch.setattr(launch, "_free_host_bytes", lambda: (40 * GiB, "MemAvailable"))
    monkeypatch.setattr(launch, "_host_memory_bytes", lambda: 64 * GiB)
    scenario, _ = parse_scenario(_one_tb(64), "1tb64.yaml")
    cell = Cell("device")
    monkeypatch.setattr(Cell, "make_strategy", lambda self: SimpleNamespace(
        estimate_memory=lambda *a: MemoryFootprint(device_bytes=GiB, pinned_bytes=50 * GiB)))
    _, refused = memory_preflight(scenario, cell, torch.device("cuda"))
    assert refused.startswith("not attempted: estimated 52.0 GiB of host memory (1 rank(s) x 50.00 GiB, 50.00 GiB of "
                              "it pinned + 2.00 GiB a rank's process), this machine has 40.0 GiB free (MemAvailable; "
                              "64.0 GiB in all)"), refused


def test_each_ranks_process_and_the_headroom_count_against_free_host_memory(monkeypatch):
    """Issue 49, point 3: 8 ranks whose tables alone fit would fill the machine with their
    interpreters and libraries; a cell leaves :data:`launch.HOST_HEADROOM` of the free memory."""
    from embbench.strategy import MemoryFootprint

    monkeypatch.setattr(Cell, "make_strategy", lambda self: SimpleNamespace(
        estimate_memory=lambda *a: MemoryFootprint(device_bytes=0, host_bytes=2 * GiB)))
    scenario, _ = parse_scenario(tiny_scenario(run={"world_size": 8}), "t.yaml")
    process = launch.RANK_PROCESS_BYTES["cpu"]
    need = 8 * (2 * GiB + process)
    for free, fits in ((8 * 2 * GiB + 1, False), (need, False), (int(need / 0.9) + 1, True)):
        monkeypatch.setattr(launch, "_free_host_bytes", lambda free=free: (free, "MemAvailable"))
        _, refused = memory_preflight(scenario, Cell("device", world_size=8), torch.device("cpu"))
        assert (refused is None) == fits, (free, refused)

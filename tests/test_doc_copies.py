"""What documents and scenario files show of the commands' output or of other files is that
output or that file (issue 49, points 3 and 9): each copy is checked against its source."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from embbench import estimate, launch
from embbench.cli import main

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def _printed_hint(scenario: str, free_gib: float, tmp_path: Path, monkeypatch, capsys) -> str:
    """The ``--scale`` command ``run --dry-run`` prints on a CPU-only machine with ``free_gib`` free."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launch, "_free_host_bytes", lambda: (int(free_gib * GiB), "a test's reading"))
    monkeypatch.setattr(launch, "_host_memory_bytes", lambda: 24 * GiB)
    monkeypatch.setattr(estimate, "_calibrated_step", lambda *a: (0.1, 0.01, (0.1, 0.1)))  # the time is not checked
    monkeypatch.setattr(estimate, "_rough_step", lambda *a: 0.1)
    monkeypatch.setattr(estimate, "_CALIBRATIONS", {})
    monkeypatch.chdir(ROOT)
    assert main(["run", scenario, "--dry-run", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    return re.search(r"at a scale that fits them all, run\n\s+(embbench run .*)", out).group(1)


def test_the_8gpu_scenarios_comment_is_the_hint_run_prints(tmp_path, monkeypatch, capsys):
    comment = (ROOT / "scenarios/criteo_8gpu.yaml").read_text().split("\nname:")[0]
    free = float(re.search(r"with ([\d.]+) GiB\s*#?\s*free", comment).group(1))
    shown = re.search(r"^#\s+(embbench run scenarios/criteo_8gpu\.yaml --scale \S+)$", comment, re.M).group(1)
    assert _printed_hint("scenarios/criteo_8gpu.yaml", free, tmp_path, monkeypatch, capsys) == shown

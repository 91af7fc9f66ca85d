"""What documents and scenario files show of the commands' output or of other files is that
output or that file (issue 49, points 3 and 9): each copy is checked against its source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from embbench import estimate, launch
from embbench.cli import main
from embbench.scenario import parse_scenario

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


@pytest.mark.parametrize("page", ["README.md", "docs/data.md"])
def test_a_documents_copy_of_the_smoke_scenario_is_the_file(page):
    """The copy may write defaults out and show fewer strategies; what it shows is the file's."""
    copy_text = re.search(r"```yaml\n(name: smoke\n.*?)```", (ROOT / page).read_text(), re.S).group(1)
    copy, _ = parse_scenario(yaml.safe_load(copy_text), page)
    shipped, _ = parse_scenario(yaml.safe_load((ROOT / "scenarios/smoke.yaml").read_text()), "smoke.yaml")
    for section in ("data", "model", "optimizer", "run"):
        assert getattr(copy, section) == getattr(shipped, section), f"{page}: its smoke scenario's {section} differs"
    assert copy.baseline == shipped.baseline
    theirs = {s.name: s for s in shipped.strategies}
    for strategy in copy.strategies:
        assert strategy == theirs[strategy.name], f"{page}: strategy {strategy.name} differs from the file's"


def _rows(scenario: str, **flags) -> int:
    from embbench.scenario import load_scenario

    loaded, _ = load_scenario(ROOT / scenario, **flags)
    return sum(t.num_rows for t in loaded.tables())


def _thousands(text: str, pattern: str) -> float:
    return float(re.search(pattern, text).group(1))


def test_the_row_counts_the_docs_and_scenarios_state_are_the_scenarios():
    smoke = _rows("scenarios/smoke.yaml") / 1e3
    assert _thousands((ROOT / "scenarios/smoke.yaml").read_text(), r"# ([\d.]+)k rows instead") == round(smoke, 1)
    assert _thousands((ROOT / "docs/cache-curves.md").read_text(), r"\| smoke \(([\d.]+)k rows") == round(smoke, 1)
    nvme = (ROOT / "scenarios/criteo_1tb_nvme.yaml").read_text()
    flags = re.search(r"Sized for a test: `--scale ([\d.]+) --batch-size (\d+)` \(([\d.]+)k rows", nvme)
    assert float(flags[3]) == round(_rows("scenarios/criteo_1tb_nvme.yaml", scale=float(flags[1]),
                                          batch_size=int(flags[2])) / 1e3, 1)


def test_the_readme_states_the_test_tiers_times_in_one_place():
    """The fast tier's and the whole suite's times are measured once and written once (under
    "Two commands"); the test section's commands point there instead of carrying their own."""
    readme = (ROOT / "README.md").read_text()
    sections = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", readme, re.S | re.M))
    timed = r"\d+\s*(min|minutes)\b"
    assert re.search(timed, sections["Two commands"]) and "fast tier" in sections["Two commands"]
    commands = [line for line in sections["Tests and benchmarks"].splitlines() if "pytest" in line and "benchmarks" not in line]
    assert commands and not any(re.search(timed, line) for line in commands), commands

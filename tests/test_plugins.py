"""A third party's strategy, end to end: the example plugin package (examples/embbench-plugin-example)
installed as a user installs one, listed by ``embbench strategies``, run by ``embbench run``, and
training the same weights as ``device``; and the parameter types that listing shows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Literal, Optional

import pytest
import torch
import yaml
from pydantic import Field

from embbench.strategy import load_strategies, parameter_type
from tests.conftest import tiny_scenario, train_and_flush

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "embbench-plugin-example"


def _installed() -> bool:
    return any(ep.name == "hot_copy" for ep in entry_points(group="embbench.strategies"))


@pytest.fixture(scope="module")
def example_plugin(tmp_path_factory):
    """The example plugin, installed: in the environment (scripts/setup_env.sh puts it there;
    with EMBBENCH_REQUIRE_PLUGIN_EXAMPLE=1, as CI sets, it must be), or else by pip into a
    temporary folder on the path of this process and of the cells it starts."""
    if _installed():
        yield
        return
    if os.environ.get("EMBBENCH_REQUIRE_PLUGIN_EXAMPLE") == "1":
        pytest.fail("the example plugin is not installed in this environment: scripts/setup_env.sh installs it "
                    f"(.venv/bin/pip install -e {EXAMPLE.relative_to(ROOT)})")
    source, site = tmp_path_factory.mktemp("example-source"), tmp_path_factory.mktemp("example-site")
    shutil.copytree(EXAMPLE, source, dirs_exist_ok=True)  # the build's leftovers stay out of the checkout
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(source)], check=True, timeout=300)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(site))
        patch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        load_strategies.cache_clear()
        assert _installed()
        yield
    load_strategies.cache_clear()


def _embbench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "250"}  # rich wraps at the terminal's width: one parameter a line
    return subprocess.run([sys.executable, "-m", "embbench.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.mark.slow
def test_strategies_lists_the_example_plugin_and_parameter_types_a_person_reads(example_plugin):
    proc = _embbench("strategies")
    assert proc.returncode == 0, proc.stderr
    assert "hot_copy" in proc.stdout and "hot_ratio: float = 0.05" in proc.stdout
    assert "lookahead: int | 'auto' = 'auto'" in proc.stdout  # freqcache's
    assert "compile: bool | 'auto' = 'auto'" in proc.stdout
    assert "Union" not in proc.stdout and "Literal" not in proc.stdout and "Annotated" not in proc.stdout


def test_the_example_plugin_trains_the_same_weights_as_device(example_plugin, tmp_path):
    raw = tiny_scenario(run={"steps": 6})
    device, _ = train_and_flush(raw, "device", tmp_path=tmp_path)
    hot_copy, metrics = train_and_flush(raw, "hot_copy", {"hot_ratio": 0.02}, tmp_path=tmp_path)
    counters = metrics["counters"]["total"]
    assert 0 < counters["hits"] < counters["accesses"], counters  # both the device copy and the host trained
    initial = train_and_flush(tiny_scenario(run={"warmup_steps": 0, "steps": 1, "repeats": 1}), "device",
                              tmp_path=tmp_path)[0]
    assert any(not torch.equal(a, b) for a, b in zip(device, initial)), "training changed nothing"
    for a, b in zip(device, hot_copy):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_embbench_run_runs_the_example_plugin_beside_device(example_plugin, tmp_path):
    scenario = tmp_path / "plugin.yaml"
    scenario.write_text(yaml.safe_dump(tiny_scenario(
        name="plugin", strategies=[{"name": "device"}, {"name": "hot_copy", "params": {"hot_ratio": 0.02}}])))
    proc = _embbench("run", str(scenario), "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(next((tmp_path / "run").glob("hot_copy*.json")).read_text())
    assert record["status"] == "ok", record.get("error")
    assert record["metrics"]["max_weight_diff_vs_baseline"] <= 1e-6


@pytest.mark.parametrize("annotation, shown", [
    (Annotated[int, Field(ge=0)] | Literal["auto"], "int | 'auto'"),
    (bool | Literal["auto"], "bool | 'auto'"),
    (Literal["static", "lfu"], "'static' | 'lfu'"),
    (Optional[float], "float | None"),
    (list[Literal["slot", "row"]], "list['slot' | 'row']"),
    (str, "str"),
])
def test_parameter_types_read_as_written(annotation, shown):
    assert parameter_type(annotation) == shown


def test_the_readme_s_plugin_skeleton_is_a_working_strategy(tmp_path, monkeypatch):
    """The skeleton of the README's "Add a strategy", installed as its entry point says, trains
    what ``device`` trains."""
    from tests.conftest import _install_plugin

    section = (ROOT / "README.md").read_text().split("## Add a strategy\n", 1)[1].split("\n## ", 1)[0]
    toml, python = (block.split("\n", 1)[1] for block in section.split("```")[1::2])
    name, target = (part.strip().strip('"') for part in toml.splitlines()[1].split("="))
    attribute = target.partition(":")[2]
    _install_plugin(tmp_path / "site", "readme_plugin", {name: f"readme_plugin:{attribute}"}, python, monkeypatch)
    raw = tiny_scenario(run={"steps": 4})
    device, _ = train_and_flush(raw, "device", tmp_path=tmp_path)
    mine, _ = train_and_flush(raw, name, tmp_path=tmp_path)
    for a, b in zip(device, mine, strict=True):
        assert torch.equal(a, b)
    load_strategies.cache_clear()


@pytest.fixture
def misbehaving_plugins(tmp_path, monkeypatch):
    """Plugins that exit at import, print at import, and take a built-in's name (issue 50, 10)."""
    from tests.conftest import _install_plugin

    _install_plugin(tmp_path / "exits", "exits_plugin", {"exits": "exits_plugin:Exits"}, """
        import sys
        sys.exit(7)
        """, monkeypatch)
    _install_plugin(tmp_path / "prints", "prints_plugin", {"prints": "prints_plugin:Prints"}, """
        from baselines.tables import DeviceStrategy
        print("hello from a plugin's import")

        class Prints(DeviceStrategy):
            name = "prints"
            summary = "prints at import"
        """, monkeypatch)
    _install_plugin(tmp_path / "shadow", "shadow_plugin", {"device": "shadow_plugin:Device"}, """
        from baselines.tables import DeviceStrategy

        class Device(DeviceStrategy):
            summary = "claims the built-in's name"
        """, monkeypatch)
    yield
    load_strategies.cache_clear()


def test_a_plugin_that_exits_prints_or_shadows_a_built_in_breaks_itself_only(misbehaving_plugins, capsys):
    from embbench.strategy import broken_strategies, get_strategy

    strategies, broken = load_strategies(), broken_strategies()  # no SystemExit(7) ends this
    assert broken["exits"] == "strategy 'exits' (exits_plugin:Exits) cannot be loaded: SystemExit: 7"
    assert "prints" in strategies and "hello from a plugin's import" in capsys.readouterr().err
    assert get_strategy("device").__module__ == "baselines.tables"  # the built-in stays
    (shadowed,) = [reason for key, reason in broken.items() if key.startswith("device")]
    assert "baselines.tables:DeviceStrategy (embbench " in shadowed and "shadow_plugin:Device (shadow_plugin 0.0)" in shadowed
    assert "the plugin's is ignored" in shadowed
    load_strategies.cache_clear()  # discovery again, importing the plugin afresh, as a command's does
    sys.modules.pop("prints_plugin")
    capsys.readouterr()
    assert "prints" in load_strategies()
    out, err = capsys.readouterr()
    assert out == "" and "hello from a plugin's import" in err  # stdout is a command's (recommend --json's)

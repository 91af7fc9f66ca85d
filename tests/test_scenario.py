from pathlib import Path

import pytest
import yaml

from embbench.scenario import ScenarioError, load_scenario, parse_scenario
from tests.conftest import tiny_scenario

SCENARIOS = sorted(Path(__file__).resolve().parents[1].joinpath("scenarios").glob("*.yaml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_every_shipped_scenario_validates_and_names_its_command(path):
    scenario, cells = load_scenario(path)
    assert cells and cells[0].strategy == scenario.baseline
    assert path.read_text().startswith(f"# .venv/bin/embbench run scenarios/{path.name}")


def _write(tmp_path, raw) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("mutate, key", [
    (lambda r: r["run"].update(stepz=3), "run.stepz: unknown key"),
    (lambda r: r.update(baselin="device"), "baselin: unknown key"),
    (lambda r: r["data"].update(batch_size="big"), "data.batch_size"),
    (lambda r: r["data"].update(preset="criteo_2tb"), "data.preset"),
    (lambda r: r["optimizer"]["embedding"].update(type="adam"), "optimizer.embedding.type"),
    (lambda r: r["strategies"].append({"name": "devcie"}), "strategies[2].name: unknown strategy 'devcie'"),
    (lambda r: r["strategies"][0].update(params={"ratio": 1}), "strategies[0].params.ratio: unknown parameter of device"),
    (lambda r: r.update(baseline="gpu"), "baseline: 'gpu' is not among the strategies"),
    (lambda r: r["data"].update(tables=[{"rows": 0}]), "data.tables[0].rows"),
    (lambda r: r["data"].update(tables=[{"rows": 10, "alfa": 1.1}]), "data.tables[0].alfa: unknown key"),
    (lambda r: r["data"].update(tables=[]), "data.tables"),
    (lambda r: r["data"].update(tables=[{"rows": 10, "alpha": float("nan")}]), "data.tables[0].alpha"),
    (lambda r: r["data"].update(tables=[{"rows": 10}], preset="criteo_1tb_freq3"),
     "data.preset: data.tables names the tables in place of a preset"),
    (lambda r: r["data"].update(tables=[{"rows": 10}], alpha=[1.0] * 26), "data.alpha: with data.tables, each table"),
    (lambda r: r["data"].update(tables=[{"rows": 10}], source="trace", path="t.npz", scale=1.0),
     "data.tables: only for source synthetic"),
])
def test_errors_name_the_file_and_the_key(tmp_path, mutate, key):
    raw = tiny_scenario()
    mutate(raw)
    path = _write(tmp_path, raw)
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_yaml_syntax_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nrun: {steps: 3\n")
    with pytest.raises(ScenarioError, match=r"bad.yaml: line \d+, column \d+: invalid YAML"):
        load_scenario(path)


def test_world_sizes_and_list_params_expand_into_cells():
    raw = tiny_scenario(run={"world_size": [1, 2]})
    scenario, cells = parse_scenario(raw)
    assert [c.id for c in cells] == ["device@w1", "device@w2", "cpu@w1", "cpu@w2"]


def test_command_line_overrides_and_strategy_filter(tmp_path):
    path = _write(tmp_path, tiny_scenario())
    scenario, cells = load_scenario(path, steps=7, scale=0.5, strategies=["cpu"])
    assert scenario.run.steps == 7 and scenario.data.scale == 0.5
    assert [c.id for c in cells] == ["cpu@w1"]
    with pytest.raises(ScenarioError, match="--strategies: nope"):
        load_scenario(path, strategies=["nope"])
    assert scenario.digest() != load_scenario(path)[0].digest()


def test_a_scenario_may_name_its_tables_instead_of_a_preset():
    raw = tiny_scenario(data={"tables": [{"rows": 1000, "alpha": 1.05}, {"rows": 50, "bag_size": 3}], "scale": 0.5,
                              "alpha": 0.9})
    scenario, _ = parse_scenario(raw, "t")
    tables = scenario.tables()  # a table without its own alpha takes data.alpha
    assert [(t.num_rows, t.alpha, t.bag_size, t.dim) for t in tables] == [(500, 1.05, 1, 8), (25, 0.9, 3, 8)]
    batch = scenario.data_source("cpu").batch(0, 0, 4)
    assert batch.sparse.num_tables == 2 and batch.sparse.values.numel() == 4 + 12

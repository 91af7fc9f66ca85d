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


@pytest.mark.parametrize("data, key", [
    ({"min_rows_per_table": 0}, "data.min_rows_per_table: Input should be greater than or equal to 1"),
    ({"min_rows_per_table": True}, "data.min_rows_per_table"),
    ({"min_rows_per_table": 2.5}, "data.min_rows_per_table"),
    ({"min_rows_per_table": 64, "source": "trace", "path": "t.npz", "scale": 1.0},
     "data.min_rows_per_table: only for source synthetic"),
])
def test_the_floor_on_rows_per_table_is_validated(tmp_path, data, key):
    raw = tiny_scenario(data=data)
    path = _write(tmp_path, raw)
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_the_floor_keeps_scaled_tables_and_leaves_small_ones_their_size():
    plain, _ = parse_scenario(tiny_scenario(), "test")
    floored, _ = parse_scenario(tiny_scenario(data={"min_rows_per_table": 100}), "test")
    named, _ = parse_scenario(tiny_scenario(data={"tables": [{"rows": 50}, {"rows": 10**6}], "min_rows_per_table": 100}),
                              "test")
    from embbench.data.presets import PRESETS

    full = PRESETS["criteo_kaggle"][0]
    rows = [t.num_rows for t in floored.tables()]
    assert rows == [min(n, max(100, t.num_rows)) for n, t in zip(full, plain.tables())]
    assert rows[8] == 3 and min(rows[2], rows[3]) > 100  # a 3-row feature stays 3; large ones scale
    assert [t.num_rows for t in named.tables()] == [50, 200]  # scale 0.0002 of a million: above the floor


def test_the_smoke_tables_are_larger_than_one_batch_s_distinct_rows():
    """Issue 41: at scale 0.001, 16 of the smoke's 26 tables had 1-5 rows, every one always hit.
    A table scaled below its own cardinality now holds more rows than the first training batches
    ever put on it, and the floor that makes it so is said in the scenario."""
    from embbench.data import Stream, SyntheticCriteo
    from embbench.data.presets import PRESETS

    scenario, _ = load_scenario(Path(__file__).resolve().parents[1] / "scenarios" / "smoke.yaml")
    data, tables = scenario.data, scenario.tables()
    assert data.min_rows_per_table >= data.batch_size
    generator = SyntheticCriteo(tables, seed=scenario.run.seed)
    distinct = [0] * len(tables)
    for index in range(8):
        features = generator.batch(Stream.TRAIN, index, data.batch_size).sparse
        table_of_id = features.table_of_each_id()
        for t in range(len(tables)):
            distinct[t] = max(distinct[t], features.values[table_of_id == t].unique().numel())
    for t, (table, full) in enumerate(zip(tables, PRESETS[data.preset][0])):
        if table.num_rows < full:
            assert table.num_rows >= data.min_rows_per_table and table.num_rows > 2 * distinct[t], (t, table, distinct[t])
        else:
            assert table.num_rows == full


def test_warmup_max_steps_below_warmup_steps_is_refused_naming_both():
    from embbench.scenario import ScenarioError, parse_scenario

    with pytest.raises(ScenarioError, match=r"run\.warmup_max_steps: 3 is below warmup_steps \(5\)"):
        parse_scenario(tiny_scenario(run={"warmup_steps": 5, "warmup_max_steps": 3}), "t.yaml")
    parse_scenario(tiny_scenario(run={"warmup_steps": 5, "warmup_max_steps": 5}), "t.yaml")

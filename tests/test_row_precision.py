"""Row precision (run.row_precision): the row types, stochastic rounding, the strategies that
store rows in them, and what a record says."""

import json

import pytest
import torch
from hypothesis import assume, given, seed, settings, strategies as st

from embbench.cache import FreqCache, FreqCacheParams
from embbench.columns import flat_row
from embbench.data import Batch, SparseFeatures, TableSpec
from embbench.data.weights import initial_weights
from embbench.embedding import RoundedRowStore, pooled_lookup
from embbench.launch import CellOutcome, outcome_without_launch, run_cells
from embbench.optim import EmbeddingOptimizer
from embbench.report import comparison_grid
from embbench.row_precision import ROW_PRECISIONS, row_type, stochastic_round, uniform_keyed
from embbench.runner import run_cell
from embbench.scenario import ScenarioError, parse_scenario
from embbench.strategy import BuildContext, RuntimeEnv
from tests.conftest import tiny_scenario, train_and_flush

CPU = RuntimeEnv(torch.device("cpu"))
LOW = [p for p in ROW_PRECISIONS if p != "fp32"]


# --- the row types ---------------------------------------------------------------------------


def _freqcache(precision: str, rows: int = 40, dim: int = 8) -> FreqCache:
    tables = [TableSpec("t0", rows, dim, 1, 1.0)]
    features = SparseFeatures(torch.arange(4), torch.ones(4, dtype=torch.long), 1)

    def train_batches(n):
        return (Batch(torch.zeros(4, 13), features, torch.zeros(4)) for _ in range(n))

    ctx = BuildContext(tables=tables, env=CPU, optimizer=EmbeddingOptimizer(), local_batch_size=4,
                       init_weights=lambda t, a, b: initial_weights(tables[t], t, 0, a, b) * 1000,
                       train_batches=train_batches, row_precision=precision)
    return FreqCache(ctx, FreqCacheParams(cache_ratio=0.25, profile_batches=1, belady_steps=0))


@pytest.mark.parametrize("precision", ROW_PRECISIONS)
def test_a_row_moved_to_the_cache_and_back_keeps_its_bytes_scale_and_state(precision):
    cache = _freqcache(precision)
    kind, dim = cache.kind, cache.dim
    assert cache.host.dtype == kind.carrier and cache.host.element_size() * cache.host.shape[1] == cache.row_bytes
    weights, extras = kind.unpack(cache.host, dim)
    extras[:, -1] = torch.arange(len(extras), dtype=torch.float32)  # an optimizer state to carry along
    before = cache.host[7].clone()
    sink, pad = torch.tensor([cache.planner.sink]), torch.tensor([cache.planner.pad_row])
    early, live = torch.tensor([False]), torch.tensor(1)  # one early move
    cache._move(sink, pad, torch.tensor([3]), torch.tensor([7]), early, live, late_part=False)  # host row 7 into slot 3
    cache._move(torch.tensor([3]), torch.tensor([11]), sink, pad, early, live, late_part=False)  # slot 3 out to row 11
    assert torch.equal(cache.host[11], before)
    # the stored row decodes to its initial weights within the type's rounding (fp8 through its scale)
    initial = initial_weights(TableSpec("t0", 40, dim, 1, 1.0), 0, 0, 7, 8) * 1000
    scale = extras[7:8, :1] if kind.scaled else None
    decoded = kind.decode(weights[7:8], scale)
    half_ulp = {"fp32": 0, "fp16": 2**-11, "bf16": 2**-8, "fp8": 2**-4}[precision]
    assert (decoded - initial).abs().max() <= half_ulp * initial.abs().max()
    if kind.scaled:  # one scale per row: the row's largest value maps to fp8's largest
        assert torch.isclose(scale, initial.abs().max() / 448).all()


def test_fp8_rows_keep_their_range_whatever_their_magnitude():
    kind = row_type("fp8")
    rows = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)) * torch.tensor([[1e-6], [1.0], [1e4]])
    stored, scale = kind.encode(rows, None)
    relative = (kind.decode(stored, scale) - rows).abs().amax(1) / rows.abs().amax(1)
    assert (relative <= 2**-4).all() and stored.dtype == torch.uint8 and scale.shape == (3, 1)


@seed(0)
@settings(max_examples=40, deadline=None)
@given(st.floats(-1000, 1000, allow_nan=False, width=32), st.sampled_from(LOW))
def test_stochastic_rounding_is_unbiased(x, precision):
    kind, draws = row_type(precision), 4096
    assume(abs(x) <= kind.max_value)  # beyond it: saturated, by design
    values = torch.full((draws, 1), x)
    uniform = uniform_keyed(3, 0, torch.arange(draws), 1)
    rounded = stochastic_round(values, uniform, kind.mantissa_bits, kind.min_exponent, kind.max_value)
    # the format's spacing at x: at most |x| * 2**-mantissa_bits, and that of the smallest normal
    spacing = max(abs(x) * 2.0**-kind.mantissa_bits, 2.0 ** (kind.min_exponent - kind.mantissa_bits))
    assert len(rounded.unique()) <= 2 and float((rounded - x).abs().max()) < spacing  # x's two neighbours only
    assert abs(float(rounded.double().mean()) - x) <= 5 * spacing / draws**0.5


@pytest.mark.parametrize("precision", LOW)
def test_many_updates_below_half_an_ulp_add_up(precision):
    """Round to nearest would drop every one of them; stochastic rounding keeps their sum on average."""
    opt = EmbeddingOptimizer(type="sgd", lr=1.0)
    kind, rows, steps, step = row_type(precision), 512, 200, 2.0**-14
    start = torch.ones(rows, 4)
    stored, scale = kind.encode(start, None)
    extras = torch.zeros(rows, kind.extras(0))
    if scale is not None:
        extras[:, :1] = scale
    store = RoundedRowStore(stored, extras, opt, kind, seed=0)
    ids, offsets = torch.arange(rows), torch.arange(rows + 1)
    for _ in range(steps):  # each row gets -lr * (-step) per update
        pooled_lookup(store, ids, offsets, torch.device("cpu")).sum().mul(-step).backward()
    moved = store.rows32(slice(None)) - start
    assert abs(float(moved.mean()) - steps * step) < 0.1 * steps * step
    if precision != "fp8":  # fp8's rows are rescaled at each update: nearest rounding would move them too
        nearest = kind.decode(kind.encode(start + step, None)[0], None)
        assert torch.equal(nearest, start)


def test_rounding_repeats_for_a_seed_and_changes_with_it():
    rows = torch.tensor([5, 1, 9])
    assert torch.equal(uniform_keyed(7, 3, rows, 4), uniform_keyed(7, 3, rows, 4))
    assert torch.equal(uniform_keyed(7, 3, rows, 4)[[1, 0, 2]], uniform_keyed(7, 3, rows[[1, 0, 2]], 4))
    assert not torch.equal(uniform_keyed(7, 3, rows, 4), uniform_keyed(8, 3, rows, 4))
    assert not torch.equal(uniform_keyed(7, 3, rows, 4), uniform_keyed(7, 4, rows, 4))
    assert not torch.equal(uniform_keyed(2**40 + 7, 2**33, rows, 4), uniform_keyed(-7, 3, rows, 4))  # any int seed
    draws = uniform_keyed(0, 0, torch.arange(20000), 8)
    assert 0 <= float(draws.min()) and float(draws.max()) < 1 and abs(float(draws.mean()) - 0.5) < 0.01


# --- strategies --------------------------------------------------------------------------------

SHORT = tiny_scenario(run={"warmup_steps": 1, "steps": 3, "repeats": 1, "eval_batches": 1})


@pytest.mark.parametrize("precision", LOW)
@pytest.mark.slow
def test_freqcache_trains_the_same_weights_as_device_in_every_row_type(precision, tmp_path):
    """Both round the same update of a row with the same draws (keyed by its global row), so
    the cache's moves change nothing: equal to the bit, not within a bound."""
    device, metrics = train_and_flush(SHORT, "device", tmp_path=tmp_path, row_precision=precision)
    cached, cache_metrics = train_and_flush(SHORT, "freqcache", {"cache_ratio": 0.1}, tmp_path, row_precision=precision)
    for a, b in zip(device, cached):
        assert torch.equal(a, b)
    again, _ = train_and_flush(SHORT, "device", tmp_path=tmp_path / "again", row_precision=precision)
    assert all(torch.equal(a, b) for a, b in zip(device, again))  # repeats exactly
    kind = row_type(precision)
    assert metrics["row_bytes"] == cache_metrics["row_bytes"] == kind.row_bytes(8, 1) < 36
    moved = cache_metrics["counters"]["total"]
    assert moved["bytes_h2d"] > 0 and moved["bytes_h2d"] % kind.row_bytes(8, 1) == 0


def _in_process(scenario):
    def execute(cell, weights):
        return outcome_without_launch(scenario, cell) or CellOutcome("ok", None, run_cell(scenario, cell, CPU, weights))
    return execute


@pytest.mark.slow
def test_records_carry_the_precision_bytes_and_distance_from_fp32_and_refuse_what_a_strategy_cannot_store(tmp_path):
    raw = {**SHORT, "run": {**SHORT["run"], "row_precision": ["fp16", "fp32", "bf16"]},
           "strategies": [{"name": "device"}, {"name": "fae", "params": {"hot_bytes": 4096}}]}
    scenario, cells = parse_scenario(raw, "t.yaml")
    assert [c.id for c in cells] == ["device@w1", "device@w1@fp16", "device@w1@bf16",
                                     "fae[hot_bytes=4096]@w1", "fae[hot_bytes=4096]@w1@fp16",
                                     "fae[hot_bytes=4096]@w1@bf16"]
    records = {r.cell_id: r for r in run_cells(scenario, "t.yaml", cells, tmp_path, execute=_in_process(scenario))}
    fp32, fp16 = records["device@w1"], records["device@w1@fp16"]
    assert (fp32.row_precision, fp32.metrics["row_bytes"]) == ("fp32", 36)
    assert (fp16.row_precision, fp16.metrics["row_bytes"]) == ("fp16", 20)
    assert "weight_diff_vs_fp32" not in fp32.metrics
    distance = fp16.metrics["weight_diff_vs_fp32"]
    assert 0 < distance["mean"] <= distance["max"] and distance["rows_trained"] > 0
    row = flat_row(fp16)  # show --csv / --json
    assert (row["row_precision"], row["row_bytes"], row["max_weight_diff_vs_fp32"]) == ("fp16", 20, distance["max"])
    refused = records["fae[hot_bytes=4096]@w1@fp16"]
    assert refused.status == "unsupported" and refused.metrics is None
    assert refused.message == "row_precision fp16: fae stores rows in fp32 only"
    assert records["fae[hot_bytes=4096]@w1"].status == "ok"
    assert (tmp_path / "device@w1@fp16.json").exists()  # the id is the file name


@pytest.mark.slow  # four cells of a scenario
def test_a_rounded_cell_s_weights_are_compared_with_the_baseline_in_its_own_precision(tmp_path):
    """max_weight_diff_vs_baseline of a fp16 cell is from the fp32 baseline (rounding); the
    exactness of freqcache against device in fp16 shows in its own field: 0, as it trains
    device's fp16 weights to the bit. Where the baseline has no weights in that precision, the
    record says why (issue 50, point 12); report's max |Δw| column shows it."""
    raw = {**SHORT, "run": {**SHORT["run"], "row_precision": ["fp32", "fp16"]},
           "strategies": [{"name": "device"}, {"name": "freqcache", "params": {"cache_ratio": 0.1}}]}
    scenario, cells = parse_scenario(raw, "t.yaml")
    records = {r.cell_id: r for r in run_cells(scenario, "t.yaml", cells, tmp_path, execute=_in_process(scenario))}
    cache = records["freqcache[cache_ratio=0.1]@w1@fp16"]
    assert cache.metrics["max_weight_diff_vs_baseline"] > 0  # from device in fp32
    assert cache.metrics["max_weight_diff_vs_baseline_same_precision"] == 0.0
    assert flat_row(cache)["max_weight_diff_vs_baseline_same_precision"] == 0.0
    for cell_id in ("device@w1", "device@w1@fp16", "freqcache[cache_ratio=0.1]@w1"):  # the reference, or fp32
        assert not {"max_weight_diff_vs_baseline_same_precision", "weights_not_compared_same_precision"} & set(
            records[cell_id].metrics)
    assert comparison_grid([cache]).rows[0].sort["max_dw"] == 0.0
    from embbench.launch import _same_precision_diff

    assert _same_precision_diff(cache, None, "device in bf16", tmp_path) == {
        "weights_not_compared_same_precision": "no flushed weights of device in bf16 in this run (not among its cells, "
                                               "or it did not end ok)"}


def test_fp32_ids_and_digests_do_not_change_and_bad_precisions_are_named():
    plain, cells = parse_scenario(tiny_scenario(), "t.yaml")
    listed, _ = parse_scenario(tiny_scenario(run={"row_precision": ["fp32", "fp8"]}), "t.yaml")
    assert [c.id for c in cells] == ["device@w1", "cpu@w1"] and plain.digest() == listed.digest()
    with pytest.raises(ScenarioError, match=r"t.yaml: run.row_precision.*'fp64' is not one of fp32, fp16, bf16, fp8"):
        parse_scenario(tiny_scenario(run={"row_precision": ["fp16", "fp64"]}), "t.yaml")
    with pytest.raises(ScenarioError, match=r"run.row_precision.*distinct"):
        parse_scenario(tiny_scenario(run={"row_precision": ["fp16", "fp16"]}), "t.yaml")


@pytest.mark.parametrize("precision", LOW)
def test_fbgemms_cpu_kernels_are_refused_exactly_where_they_cannot_train(precision, tmp_path):
    """The probe behind ``unsupported`` tells the truth: a refused precision fails to train when
    built anyway (fbgemm-gpu-cpu 1.8: bf16 and fp8), an accepted one trains, rows stored in it."""
    from baselines.tables import CpuStrategy, HostTables

    reason = CpuStrategy().refusal(CPU, precision)
    scenario, _ = parse_scenario(SHORT, "t.yaml")
    tables = scenario.tables()
    ctx = BuildContext(tables=tables, env=CPU, optimizer=scenario.optimizer.embedding, local_batch_size=64,
                       init_weights=lambda t, a, b: initial_weights(tables[t], t, 0, a, b),
                       train_batches=lambda n: iter(()), row_precision=precision)
    module = HostTables(ctx)
    features = SparseFeatures(torch.zeros(len(tables), dtype=torch.long), torch.ones(len(tables), dtype=torch.long),
                              len(tables))
    if reason is None:
        module(features).sum().backward()
        assert module.tbe.weights_host.dtype == row_type(precision).dtype
    else:
        assert reason.startswith(f"row_precision {precision}: fbgemm") and "CPU kernels cannot train" in reason
        with pytest.raises(NotImplementedError):
            module(features).sum().backward()


# --- compare and recommend across precisions --------------------------------------------------


def _precision_run():
    from record_factory import make_record

    return [make_record("device", auc=0.75, step_times=[0.02] * 12),
            make_record("device", auc=0.7496, step_times=[0.01] * 12, row_precision="fp16", device_bytes=1 << 29),
            make_record("device", auc=0.74, step_times=[0.005] * 12, row_precision="fp8", device_bytes=1 << 28),
            make_record("freqcache", {"cache_ratio": 0.1}, auc=0.75, step_times=[0.015] * 12, row_precision="bf16")]


def test_compare_matches_each_reduced_precision_with_the_same_cell_in_fp32(tmp_path, capsys):
    from record_factory import write_run

    from embbench.cli import main
    from embbench.compare import compare_precisions

    cells = {c.cell_id: c for c in compare_precisions(_precision_run())}
    assert sorted(cells) == ["device@w1@fp16", "device@w1@fp8", "freqcache[cache_ratio=0.1]@w1@bf16"]
    fp16 = cells["device@w1@fp16"]
    assert fp16.comparable and fp16.deltas["throughput"].relative == pytest.approx(1.0)
    assert fp16.deltas["auc"].direction == "worse" and fp16.deltas["device_bytes"].relative == pytest.approx(-0.5)
    assert cells["freqcache[cache_ratio=0.1]@w1@bf16"].status_before is None  # no fp32 cell to match
    run = write_run(tmp_path / "run", _precision_run())
    assert main(["compare", str(run), "--match-on", "strategy", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["cell_id"] for c in out["runs"][0]["cells"] if c["comparable"]] == ["device@w1@fp16", "device@w1@fp8"]
    only_fp32 = write_run(tmp_path / "fp32", _precision_run()[:1])
    assert main(["compare", str(only_fp32), "--match-on", "strategy"]) == 2
    assert "no cell with rows in fp16, bf16 or fp8" in capsys.readouterr().err


def test_recommend_holds_every_precision_to_the_fp32_baselines_auc_and_names_the_precision():
    from embbench.recommend import Budget, recommend

    records = _precision_run()
    (rec,) = recommend(records[::-1], Budget(1 << 30), auc_tolerance=0.001)  # the fp32 baseline listed last
    assert (rec.best.cell_id, rec.best.row_precision) == ("device@w1@fp16", "fp16")
    assert "below the baseline's 0.7500" in rec.excluded["device@w1@fp8"]
    (loose,) = recommend(records, Budget(1 << 30), auc_tolerance=0.02)
    assert (loose.best.cell_id, loose.best.row_precision) == ("device@w1@fp8", "fp8")


@pytest.mark.parametrize("strategy, params", [("device", {}), ("cpu", {}), ("gpu_sharded", {}), ("uvm", {}),
                                              ("uvm_cache", {"cache_ratio": 0.1}), ("freqcache", {"cache_ratio": 0.1})])
def test_memory_estimates_count_rows_in_the_cell_s_precision(strategy, params):
    """The preflight and --dry-run (launch.memory_estimate) count a row's bytes in its precision:
    an fp32 estimate for fp16 rows would refuse cells that fit (the 1TB shape at dim 128 in fp16
    on an 80 GB card)."""
    from embbench.launch import memory_estimate
    from embbench.row_precision import table_bytes

    scenario, cells = parse_scenario(tiny_scenario(strategies=[{"name": strategy, "params": params}], baseline=strategy,
                                                   run={"row_precision": ["fp32", "fp16", "fp8"]}), "t.yaml")
    total = {c.row_precision: sum(vars(memory_estimate(scenario, c)).get(k) or 0
                                  for k in ("device_bytes", "host_bytes", "pinned_bytes")) for c in cells}
    tables, width = scenario.tables(), scenario.optimizer.embedding.state_width
    assert total["fp32"] > total["fp16"] > total["fp8"] > 0
    if strategy in ("device", "cpu", "gpu_sharded", "uvm"):  # the tables and nothing else
        assert {p: total[p] for p in total} == {p: table_bytes(tables, width, p) for p in total}


def test_the_precision_compare_keeps_accuracy_at_any_width(tmp_path, capsys, monkeypatch):
    """Where accuracy is the point (rows in fp16, bf16, fp8 against fp32) the AUC column is not
    the one a narrow terminal drops (issue 41, item 8)."""
    from record_factory import write_run

    from embbench.cli import main
    from embbench.cli.shared import console

    run = write_run(tmp_path / "run", _precision_run())
    monkeypatch.setattr(console, "width", 110)
    assert main(["compare", str(run), "--match-on", "strategy"]) == 0
    table = capsys.readouterr().out
    assert "AUC" in table and "0.7496" in table  # fp16's AUC beside fp32's
    hidden = next(line for line in table.splitlines() if line.startswith("hidden:"))
    assert "auc" not in hidden and "logloss" not in hidden

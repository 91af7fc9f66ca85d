"""The public hooks a strategy may use: a training schedule with side data, lookahead, the
`semantics` of a record; and what the runner measures around them (steady warm-up, operator
counts, divergence, progress, profiles)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from embbench.data.batch import SparseFeatures
from embbench.launch import run_cells
from embbench.metrics import warmed_up
from embbench.runner import Diverged, StrategyOutputError, run_cell
from embbench.scenario import OPS_STEPS, Cell, parse_scenario
from embbench.strategy import RuntimeEnv, Schedule
from tests.conftest import _install_plugin, tiny_scenario, train_and_flush

CPU = RuntimeEnv(torch.device("cpu"))


def _features(bags: list[list[list[int]]]) -> SparseFeatures:
    """bags[t][b]: the ids of sample b in table t."""
    values = [i for table in bags for bag in table for i in bag]
    lengths = [len(bag) for table in bags for bag in table]
    return SparseFeatures(torch.tensor(values, dtype=torch.long), torch.tensor(lengths, dtype=torch.long), len(bags))


def _bags(f: SparseFeatures) -> list[list[list[int]]]:
    lengths = f.lengths.view(f.num_tables, -1).tolist()
    it = iter(f.values.tolist())
    return [[[next(it) for _ in range(n)] for n in table] for table in lengths]


jagged = st.integers(1, 3).flatmap(lambda tables: st.integers(1, 6).flatmap(lambda batch: st.lists(
    st.lists(st.lists(st.integers(0, 99), max_size=3), min_size=batch, max_size=batch),
    min_size=tables, max_size=tables)))


@settings(max_examples=60, deadline=None)
@given(bags=jagged, data=st.data())
def test_select_and_cat_keep_every_sample_intact(bags, data):
    f = _features(bags)
    batch = len(bags[0])
    samples = data.draw(st.lists(st.integers(0, batch - 1), max_size=8))
    picked = f.select(torch.tensor(samples, dtype=torch.long))
    assert _bags(picked) == [[table[s] for s in samples] for table in bags]
    both = SparseFeatures.cat([f, picked])
    assert _bags(both) == [table + [table[s] for s in samples] for table in bags]


def test_side_data_travels_with_the_features():
    f = _features([[[1], [2, 3]], [[4], []]])
    f.side["tag"] = "hot"
    assert f.to("cpu").side == {"tag": "hot"}
    assert f.slice(1, 2).side == {"tag": "hot"} and _bags(f.slice(1, 2)) == [[[2, 3]], [[]]]
    assert f.select(torch.tensor([1])).side == {"tag": "hot"}


@pytest.fixture
def hook_plugins(tmp_path, monkeypatch):
    """`reverser`: device that trains the run's samples in reverse order, tags each batch,
    and records what lookahead, prefetch and forward receive."""
    _install_plugin(tmp_path / "hooksite", "hook_plugin", {"reverser": "hook_plugin:Reverser",
                                                           "nan_maker": "hook_plugin:NanMaker",
                                                           "nan_in_eval": "hook_plugin:NanInEval",
                                                           "nan_in_weights": "hook_plugin:NanInWeights",
                                                           "bad_shape": "hook_plugin:BadShape",
                                                           "not_a_tensor": "hook_plugin:NotATensor",
                                                           "elsewhere": "hook_plugin:Elsewhere"}, """
        import torch
        from baselines.tables import DeviceStrategy
        from embbench.strategy import Schedule

        SEEN = []

        class Reverser(DeviceStrategy):
            name = "reverser"
            semantics = "reordered"

            def schedule(self, ctx):
                n = ctx.num_batches * ctx.batch_size
                assert ctx.samples().batch_size == n
                return Schedule(torch.arange(n - 1, -1, -1), side=[{"index": i} for i in range(ctx.num_batches)])

            def build(self, ctx):
                module = super().build(ctx)
                module.lookahead = 3
                forward, prefetch = module.forward, module.prefetch

                def look_ahead(upcoming):
                    SEEN.append(("ahead", [id(u) for u in upcoming], [u.side["index"] for u in upcoming]))

                def traced_forward(features):
                    if torch.is_grad_enabled():
                        SEEN.append(("forward", id(features), features.side["index"]))
                    return forward(features)

                def traced_prefetch(features):
                    SEEN.append(("prefetch", id(features), features.side["index"]))
                    return prefetch(features)

                module.look_ahead, module.forward, module.prefetch = look_ahead, traced_forward, traced_prefetch
                return module

        class NanMaker(DeviceStrategy):
            name = "nan_maker"

            def build(self, ctx):
                module = super().build(ctx)
                forward, calls = module.forward, [0]

                def nan_after_two(features):
                    calls[0] += 1
                    out = forward(features)
                    return out * float("nan") if calls[0] > 2 else out

                module.forward = nan_after_two
                return module

        class NanInEval(DeviceStrategy):  # finite training loss, NaN evaluation outputs
            name = "nan_in_eval"

            def build(self, ctx):
                module = super().build(ctx)
                forward = module.forward
                module.forward = lambda f: forward(f) if torch.is_grad_enabled() else forward(f) * float("nan")
                return module

        class NanInWeights(DeviceStrategy):  # a poisoned row that no batch reads
            name = "nan_in_weights"

            def build(self, ctx):
                module = super().build(ctx)
                flush = module.flush

                def poisoned():
                    tables = flush()
                    tables[1][-1, 0] = float("inf")
                    return tables

                module.flush = poisoned
                return module

        class OutputChanged(DeviceStrategy):  # device, its pooled output passed through `change`
            change = staticmethod(lambda out: out)

            def build(self, ctx):
                module = super().build(ctx)
                forward = module.forward
                module.forward = lambda f: self.change(forward(f))
                return module

        class BadShape(OutputChanged):  # three numbers per sample instead of tables x dim
            name = "bad_shape"
            change = staticmethod(lambda out: out[:, :3])

        class NotATensor(OutputChanged):
            name = "not_a_tensor"
            change = staticmethod(lambda out: [out])

        class Elsewhere(OutputChanged):  # the right shape, on another device
            name = "elsewhere"
            change = staticmethod(lambda out: out.to("meta"))
        """, monkeypatch)
    import hook_plugin
    yield hook_plugin
    from embbench.strategy import load_strategies
    load_strategies.cache_clear()


def test_a_schedule_orders_the_batches_and_lookahead_sees_the_same_objects(hook_plugins):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "reverser"}])
    scenario, _ = parse_scenario(raw, "t")
    metrics = run_cell(scenario, Cell("reverser"), CPU)
    assert metrics["schedule"] == "strategy"
    seen = hook_plugins.SEEN
    forwards = [e for e in seen if e[0] == "forward"]
    # + the counted steps (one repeat's length) and the operator-counting steps
    trained = metrics["warmup_steps_run"] + metrics["measured_steps"] + scenario.run.counted_steps + 2
    assert [e[2] for e in forwards] == list(range(trained))
    # lookahead: the next three batches, then the same objects in prefetch and forward
    ahead = [e for e in seen if e[0] == "ahead"]
    assert ahead[0][2] == [1, 2, 3]
    prefetched = {e[2]: e[1] for e in seen if e[0] == "prefetch"}
    for _, ids, indices in ahead:
        for obj, index in zip(ids, indices):
            assert prefetched[index] == obj
            if index < trained:
                assert dict((e[2], e[1]) for e in forwards)[index] == obj


def test_device_trained_on_another_strategys_schedule_ends_with_its_weights(hook_plugins, tmp_path):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "reverser"}])
    scenario, _ = parse_scenario(raw, "t")
    reversed_weights, _ = train_and_flush(raw, "reverser", tmp_path=tmp_path)
    plain_weights, _ = train_and_flush(raw, "device", tmp_path=tmp_path)
    steps = scenario.run.training_batches_read(profile=False)
    n = steps * scenario.data.batch_size
    weights = tmp_path / "scheduled.pt"
    run_cell(scenario, Cell("device"), CPU, weights, schedule=Schedule(torch.arange(n - 1, -1, -1)))
    for a, b in zip(torch.load(weights), reversed_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert any(not torch.allclose(a, b) for a, b in zip(plain_weights, reversed_weights))


@pytest.mark.slow
def test_a_reordered_strategy_is_compared_by_accuracy_not_weights(hook_plugins, tmp_path):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "reverser"}])
    scenario, cells = parse_scenario(raw, "t")
    records = {r.strategy: r for r in run_cells(scenario, "t", cells, tmp_path)}
    assert records["device"].semantics == "exact" and records["reverser"].semantics == "reordered"
    assert "max_weight_diff_vs_baseline" not in records["reverser"].metrics
    assert "semantics: reordered" in records["reverser"].metrics["weights_not_compared"]
    assert records["reverser"].metrics["accuracy"]["auc"] is not None


def test_a_bad_schedule_is_a_clear_error(hook_plugins):
    scenario, _ = parse_scenario(tiny_scenario(), "t")
    with pytest.raises(ValueError, match="a schedule must order"):
        run_cell(scenario, Cell("device"), CPU, schedule=Schedule(torch.arange(5)))


@pytest.mark.slow
def test_a_nan_loss_is_recorded_as_diverged_with_its_step(hook_plugins, tmp_path):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "nan_maker"}])
    scenario, cells = parse_scenario(raw, "t")
    with pytest.raises(Diverged, match="not finite at step 2"):
        run_cell(scenario, Cell("nan_maker"), CPU)
    records = {r.strategy: r for r in run_cells(scenario, "t", cells, tmp_path)}
    assert records["nan_maker"].status == "diverged" and "step 2" in records["nan_maker"].message


@pytest.mark.parametrize("strategy, message", [("nan_in_eval", "the evaluation logits hold 64 non-finite"),
                                               ("nan_in_weights", "the trained weights of table 1 hold 1 non-finite")])
@pytest.mark.slow
def test_non_finite_outputs_or_weights_after_a_finite_loss_are_recorded_as_diverged(hook_plugins, tmp_path, strategy,
                                                                                      message):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": strategy}])
    scenario, cells = parse_scenario(raw, "t")
    records = {r.strategy: r for r in run_cells(scenario, "t", cells, tmp_path)}
    assert records["device"].status == "ok"
    assert records[strategy].status == "diverged" and message in records[strategy].message


@pytest.mark.parametrize("strategy, got", [("bad_shape", "[64, 3]"), ("not_a_tensor", "a list, not a tensor"),
                                           ("elsewhere", "a tensor on meta")])
def test_a_strategy_output_off_the_contract_is_named(hook_plugins, strategy, got):
    scenario, _ = parse_scenario(tiny_scenario(), "t")
    expected = f"strategy {strategy} returned {got}; expected float32 [64, 208] on cpu (batch, tables x dim = 26 x 8)"
    with pytest.raises(StrategyOutputError) as caught:
        run_cell(scenario, Cell(strategy), CPU)
    assert str(caught.value) == expected


@pytest.mark.slow
def test_a_wrong_shape_is_the_cells_error_and_the_other_cells_run(hook_plugins, tmp_path):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "bad_shape"}, {"name": "cpu"}])
    scenario, cells = parse_scenario(raw, "t")
    records = {r.strategy: r for r in run_cells(scenario, "t", cells, tmp_path)}
    assert records["device"].status == "ok" and records["cpu"].status == "ok"
    assert records["bad_shape"].status == "error"
    assert "strategy bad_shape returned [64, 3]; expected float32 [64, 208]" in records["bad_shape"].message


@pytest.mark.slow
def test_warm_up_runs_until_the_miss_rate_stops_falling():
    assert not warmed_up([]) and warmed_up([None])
    assert not warmed_up([0.5]) and not warmed_up([0.5, 0.3]) and warmed_up([0.5, 0.3, 0.299])
    raw = tiny_scenario(run={"warmup_steps": 2, "warmup_max_steps": 40})
    scenario, _ = parse_scenario(raw, "t")
    device = run_cell(scenario, Cell("device"), CPU)
    assert device["warmup_steps_run"] == 5  # no miss rate to watch: the first window ends it
    cache = run_cell(scenario, Cell("freqcache", {"cache_ratio": 0.02, "profile_batches": 0}), CPU)
    rates = cache["warmup_miss_rates"]
    assert 5 <= cache["warmup_steps_run"] <= 40 and len(rates) == cache["warmup_steps_run"] // 5
    if cache["warmup_steps_run"] < 40:
        assert rates[-1] >= rates[-2] - 0.002
    # (it may run on past a steady miss rate while the cache's empty slots still fill: test_freqcache)
    assert cache["empty_slots_at_timing"] >= 0


@pytest.mark.slow
def test_every_record_counts_operators_and_can_carry_a_profile(tmp_path):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "freqcache", "params": {"cache_ratio": 0.05}}])
    scenario, cells = parse_scenario(raw, "t")
    phases = []
    records = run_cells(scenario, "t", cells, tmp_path, profile_dir=tmp_path / "profiles",
                        on_progress=lambda cell, phase, step, total: phases.append((cell.strategy, phase)))
    device, cache = (r.metrics for r in records)
    assert device["ops_per_step"] > 50 and cache["ops_per_step"] > device["ops_per_step"]
    assert device["host_syncs_per_step"] is None  # counted on CUDA only
    trace = json.loads((tmp_path / "profiles" / f"{cells[0].slug}.trace.json").read_text())
    assert trace["traceEvents"]
    assert any("PooledLookup" in row["op"] for row in device["profile"]["top_host"])
    seen = [p for s, p in phases if s == "device"]
    order = ["build", "warmup", "measure", "count", "eval"]
    assert seen[-1] == "eval" and seen == sorted(seen, key=order.index)


@pytest.mark.slow
def test_every_cell_is_evaluated_after_the_same_batches_whatever_its_warm_up(tmp_path):
    """A cache that warms up longer than the baseline catches up, untimed, before the evaluation:
    both trained the same batches, so the exact one's losses and weights are compared with the
    baseline's (they were not, before: its accuracy was the result of more training)."""
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "freqcache", "params": {"cache_ratio": 0.02, "profile_batches": 0}}],
                        run={"warmup_steps": 2, "warmup_max_steps": 40})
    scenario, cells = parse_scenario(raw, "t")
    device, cache = (r.metrics for r in run_cells(scenario, "t", cells, tmp_path))
    assert device["warmup_steps_run"] < cache["warmup_steps_run"]
    assert device["trained_steps"] == cache["trained_steps"] == (40 + device["measured_steps"] + scenario.run.counted_steps
                                                                 + OPS_STEPS)
    assert cache["train_loss_last10_diff_vs_baseline"] < 1e-6 and cache["logloss_diff_vs_baseline"] < 1e-6
    assert cache["max_weight_diff_vs_baseline"] < 1e-6


def test_a_training_loss_that_spikes_is_said_under_the_table():
    from embbench.metrics import unstable_training

    assert unstable_training({"train_loss_first": 0.69, "train_loss_peak": 0.7, "train_loss_peak_step": 3}) is None
    assert unstable_training({}) is None  # an older record
    why = unstable_training({"train_loss_first": 0.69, "train_loss_peak": 1.7e6, "train_loss_peak_step": 1})
    assert why.startswith("unstable training: the loss reached 1.7e+06 at step 1 (the first was 0.69)")
    # a run whose dense optimizer overshoots records the course of its loss
    raw = tiny_scenario(strategies=[{"name": "device"}], optimizer={"dense": {"type": "adagrad", "lr": 0.5}})
    scenario, _ = parse_scenario(raw, "t")
    accuracy = run_cell(scenario, Cell("device"), CPU)["accuracy"]
    assert accuracy["train_loss_peak"] > 10 * accuracy["train_loss_first"] and accuracy["train_loss_peak_step"] > 0

"""run.dense_precision: validated like every scenario key, recorded as asked and as computed,
bf16 autocast around the dense model only (embeddings stay float32); run.deterministic: torch's
deterministic algorithms for the cell, and the operators that had none."""

from __future__ import annotations

import warnings

import pytest
import torch

from embbench.launch import run_cells
from embbench.precision import deterministic_algorithms, effective_precision, matmul_precision
from embbench.scenario import ScenarioError, parse_scenario
from tests.conftest import tiny_scenario, train_and_flush


@pytest.mark.parametrize("bad", ["fp16", "BF16", 16, None])
def test_an_unknown_dense_precision_is_refused_naming_the_value(bad):
    with pytest.raises(ScenarioError, match=rf"test: run.dense_precision: {bad!r} is not one of fp32, tf32, bf16"):
        parse_scenario(tiny_scenario(run={"dense_precision": bad}), "test")


def test_the_default_is_fp32():
    scenario, _ = parse_scenario(tiny_scenario(), "test")
    assert scenario.run.dense_precision == "fp32"


def test_tf32_is_recorded_as_fp32_on_the_cpu(tmp_path):
    _, metrics = train_and_flush(tiny_scenario(run={"dense_precision": "tf32", "repeats": 1}), "device",
                                 tmp_path=tmp_path)
    assert metrics["dense_precision"] == "tf32" and metrics["dense_precision_effective"] == "fp32"
    assert effective_precision("tf32", torch.device("cpu")) == "fp32"
    before = torch.get_float32_matmul_precision()
    with matmul_precision("tf32", torch.device("cpu")):  # nothing to switch on the CPU
        assert torch.get_float32_matmul_precision() == before


@pytest.mark.slow
def test_bf16_trains_the_dense_part_in_bfloat16_and_the_embeddings_in_float32(tmp_path):
    raw = tiny_scenario(run={"dense_precision": "bf16"})
    weights, metrics = train_and_flush(raw, "device", tmp_path=tmp_path)
    assert metrics["dense_precision"] == metrics["dense_precision_effective"] == "bf16"
    assert all(w.dtype == torch.float32 for w in weights)
    assert torch.isfinite(torch.tensor(metrics["accuracy"]["train_loss_last10"]))
    assert metrics["accuracy"]["logloss"] == pytest.approx(metrics["accuracy"]["logloss"])  # finite, not nan
    fp32_weights, _ = train_and_flush(tiny_scenario(), "device", tmp_path=tmp_path / "fp32")
    # the dense part did compute in bfloat16: the embedding gradients it sent back differ
    assert max(float((a - b).abs().max()) for a, b in zip(weights, fp32_weights)) > 1e-6
    # another exact strategy under the same precision trains the same weights, to rounding
    other, other_metrics = train_and_flush(raw, "cpu", tmp_path=tmp_path / "cpu")
    assert other_metrics["dense_precision_effective"] == "bf16"
    for a, b in zip(other, weights):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_deterministic_algorithms_are_scoped_and_name_the_operators_that_have_none():
    before = torch.are_deterministic_algorithms_enabled()
    with pytest.warns(UserWarning, match="a warning of the cell"):
        with deterministic_algorithms(True) as nondeterministic:
            assert torch.are_deterministic_algorithms_enabled()
            torch.zeros(5).put_(torch.tensor([1, 1]), torch.tensor([1.0, 2.0]))  # put_ has no deterministic kernel
            torch.zeros(5).put_(torch.tensor([2, 2]), torch.tensor([1.0, 2.0]))
            warnings.warn("a warning of the cell")  # shown as it would have been
    assert nondeterministic == ["put_"]
    assert torch.are_deterministic_algorithms_enabled() == before
    with deterministic_algorithms(False) as nothing:
        assert torch.are_deterministic_algorithms_enabled() == before
    assert nothing == []


@pytest.mark.slow
def test_a_deterministic_run_records_it_and_keeps_other_scenarios_digests(tmp_path):
    plain, _ = parse_scenario(tiny_scenario(), "test")
    off, _ = parse_scenario(tiny_scenario(run={"deterministic": False}), "test")
    on, cells = parse_scenario(tiny_scenario(run={"deterministic": True, "repeats": 1},
                                             strategies=[{"name": "device"}, {"name": "freqcache", "params": {"cache_ratio": 0.05}}]),
                               "test")
    assert plain.digest() == off.digest() != on.digest()
    device, cache = (r.metrics for r in run_cells(on, "test", cells, tmp_path))
    assert device["deterministic"] == cache["deterministic"] == {"nondeterministic_ops": []}
    assert cache["logloss_diff_vs_baseline"] == cache["train_loss_last10_diff_vs_baseline"] == 0.0
    assert not torch.are_deterministic_algorithms_enabled()

"""run.dense_precision: validated like every scenario key, recorded as asked and as computed,
bf16 autocast around the dense model only (embeddings stay float32)."""

from __future__ import annotations

import pytest
import torch

from embbench.precision import effective_precision, matmul_precision
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

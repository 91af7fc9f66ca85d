"""The embedding math: fused-in-backward updates against a plain autograd reference, and
the device and cpu strategies against each other."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from embbench.embedding import RowStore, pooled_lookup
from embbench.optim import EmbeddingOptimizer
from tests.conftest import tiny_scenario, train_and_flush

OPTIMIZERS = ["sgd", "rowwise_adagrad"]


def _reference_step(weights, acc, rows, offsets, grad_out, opt: EmbeddingOptimizer):
    """Plain autograd through embedding_bag, then the optimizer on rows with a gradient."""
    w = weights.clone().requires_grad_(True)
    out = torch.nn.functional.embedding_bag(rows, w, offsets, mode="sum", include_last_offset=True)
    (out * grad_out).sum().backward()
    g = w.grad
    touched = torch.unique(rows)
    new = weights.clone()
    if opt.type == "sgd":
        new[touched] -= opt.lr * g[touched]
    else:
        acc = acc.clone()
        acc[touched] += g[touched].pow(2).mean(1)
        new[touched] -= opt.lr * g[touched] / (acc[touched].sqrt() + opt.eps).unsqueeze(1)
    return new, acc


@settings(max_examples=30, deadline=None)
@given(
    opt_type=st.sampled_from(OPTIMIZERS),
    num_rows=st.integers(1, 40),
    bags=st.lists(st.lists(st.integers(0, 39), min_size=0, max_size=6), min_size=1, max_size=12),
    steps=st.integers(1, 3),
)
def test_fused_update_matches_autograd_reference(opt_type, num_rows, bags, steps):
    opt = EmbeddingOptimizer(type=opt_type, lr=0.3)
    bags = [[i % num_rows for i in bag] for bag in bags]
    rows = torch.tensor([i for bag in bags for i in bag], dtype=torch.long)
    offsets = torch.tensor([0] + [len(b) for b in bags]).cumsum(0)
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(num_rows, 4, generator=g)
    store = RowStore(weights.clone(), opt.new_state(num_rows, "cpu"), opt)
    ref_w, ref_acc = weights.clone(), torch.zeros(num_rows)
    for _ in range(steps):
        grad_out = torch.randn(len(bags), 4, generator=g)
        out = pooled_lookup(store, rows, offsets, torch.device("cpu"))
        (out * grad_out).sum().backward()
        ref_w, ref_acc = _reference_step(ref_w, ref_acc, rows, offsets, grad_out, opt)
        torch.testing.assert_close(store.weights, ref_w)
    if opt_type == "rowwise_adagrad":
        torch.testing.assert_close(store.state[:, 0], ref_acc)


@pytest.mark.parametrize("opt_type", OPTIMIZERS)
@pytest.mark.slow
def test_device_and_cpu_strategies_train_the_same_weights(tmp_path, opt_type):
    raw = tiny_scenario(optimizer={"embedding": {"type": opt_type, "lr": 0.1}})
    device_weights, device_metrics = train_and_flush(raw, "device", tmp_path=tmp_path)
    cpu_weights, cpu_metrics = train_and_flush(raw, "cpu", tmp_path=tmp_path)
    initial = train_and_flush(tiny_scenario(run={"warmup_steps": 0, "steps": 1, "repeats": 1}), "device", tmp_path=tmp_path)[0]
    assert any(not torch.equal(a, b) for a, b in zip(device_weights, initial)), "training changed nothing"
    for a, b in zip(device_weights, cpu_weights):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert device_metrics["accuracy"]["logloss"] == pytest.approx(cpu_metrics["accuracy"]["logloss"], rel=1e-4)


@pytest.mark.slow
def test_the_teacher_is_learnable():
    raw = tiny_scenario(
        data={"scale": 0.001, "embedding_dim": 16, "batch_size": 512},
        model={"bottom_mlp": [32, 16], "top_mlp": [32, 1]},
        run={"warmup_steps": 0, "steps": 60, "repeats": 1, "eval_batches": 8},
    )
    _, metrics = train_and_flush(raw, "device")
    assert metrics["accuracy"]["auc"] > 0.6


def test_a_cell_trains_on_a_stream_of_the_device_s_highest_priority(monkeypatch, tmp_path):
    """On CUDA the cell runs on a stream of its own at the highest priority (a strategy's side
    stream, made at the default and lowest, yields to it: issue 47, item 5); on a CPU on none.
    Every phase of the cell, the timed steps among them, runs inside it."""
    import contextlib

    from embbench import runner

    made, entered = [], []

    class Stream:
        @staticmethod
        def priority_range():
            return 0, -5

        def __init__(self, device=None, priority=0):
            made.append((device, priority))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext(entered.append(s)))
    with runner.training_stream(torch.device("cuda", 0)):
        pass
    assert made == [(torch.device("cuda", 0), -5)] and len(entered) == 1
    assert isinstance(runner.training_stream(torch.device("cpu")), contextlib.nullcontext)

    log = []

    @contextlib.contextmanager
    def logged(device):
        log.append("enter")
        yield
        log.append("exit")

    time_steps = runner._time_steps
    monkeypatch.setattr(runner, "training_stream", logged)
    monkeypatch.setattr(runner, "_time_steps", lambda *a: (log.append("timed"), time_steps(*a))[1])
    train_and_flush(tiny_scenario(), "device", tmp_path=tmp_path)
    assert log == ["enter", "timed", "exit"]

"""``cpu`` (fbgemm's CPU kernel, host tables) against ``device`` (embbench's own lookup and
update) on hypothesis-generated id streams: the same pooled rows, the same trained weights."""

import torch
from hypothesis import given, settings, strategies as st

from baselines.tables import CpuStrategy, DeviceStrategy
from embbench.data import SparseFeatures, TableSpec
from embbench.optim import EmbeddingOptimizer
from embbench.strategy import BuildContext, RuntimeEnv

DIM = 4


def _build(strategy, tables, optimizer, batch):
    weights = [torch.randn(t.num_rows, t.dim, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(tables)]
    ctx = BuildContext(tables=tables, env=RuntimeEnv(torch.device("cpu")), optimizer=optimizer, local_batch_size=batch,
                       init_weights=lambda t, a, b: weights[t][a:b].clone(), train_batches=lambda n: iter(()))
    return strategy().build(ctx)


@st.composite
def id_streams(draw):
    """A few tables, then steps of bags (some empty, ids heavily repeated) for each table."""
    rows = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    batch = draw(st.integers(1, 5))
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        lengths, values = [], []
        for n in rows:
            for _ in range(batch):
                bag = draw(st.lists(st.integers(0, n - 1), max_size=5))
                lengths.append(len(bag))
                values.extend(bag)
        steps.append(SparseFeatures(torch.tensor(values, dtype=torch.long), torch.tensor(lengths), len(rows)))
    return rows, batch, steps


@settings(max_examples=40, deadline=None)
@given(stream=id_streams(), opt_type=st.sampled_from(["sgd", "rowwise_adagrad"]), lr=st.floats(0.01, 0.5))
def test_cpu_trains_what_device_trains(stream, opt_type, lr):
    rows, batch, steps = stream
    tables = [TableSpec(f"t{i}", n, DIM, 1, 1.15) for i, n in enumerate(rows)]
    optimizer = EmbeddingOptimizer(type=opt_type, lr=lr)
    device, cpu = _build(DeviceStrategy, tables, optimizer, batch), _build(CpuStrategy, tables, optimizer, batch)
    g = torch.Generator().manual_seed(1)
    for features in steps:
        grad = torch.randn(batch, len(tables) * DIM, generator=g)
        out_device, out_cpu = device(features), cpu(features)
        torch.testing.assert_close(out_cpu, out_device, rtol=1e-5, atol=1e-6)
        (out_device * grad).sum().backward()
        (out_cpu * grad).sum().backward()
    for a, b in zip(cpu.flush(), device.flush()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert cpu.counters()["accesses"] == device.counters()["accesses"] == sum(f.values.numel() for f in steps)
    exact = sum(n * (DIM + optimizer.state_width) * 4 for n in rows)
    assert exact <= cpu.memory().host_bytes <= exact + 64  # fbgemm keeps a placeholder state for sgd

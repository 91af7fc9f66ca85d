"""The fixed-shape row-gradient aggregation of the embedding backward (no host sync on CUDA):
the same sums as ``torch.unique``'s, the same training, bit for bit, and no operator that
reads a device value on the host."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from embbench import embedding
from embbench.embedding import RoundedRowStore, RowStore, pooled_lookup
from embbench.host_reads import HostReadCheck
from embbench.optim import EmbeddingOptimizer, aggregate_rows, aggregate_rows_padded
from embbench.row_precision import row_type

CPU = torch.device("cpu")
OPTIMIZERS = ["sgd", "rowwise_adagrad"]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.one_of(
        st.lists(st.integers(0, 30), min_size=1, max_size=40),  # repeats
        st.integers(1, 40).flatmap(lambda n: st.lists(st.just(n % 7), min_size=n, max_size=n)),  # all equal
        st.permutations(list(range(25))),  # all distinct
    ),
    dim=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_the_padded_aggregation_is_the_unique_one_then_padding_that_mirrors_each_row_s_ids(rows, dim, seed):
    """Entries 0..k-1 are torch.unique's rows and sums; the padding names each row once per
    further id it has (never one row for all: issue 42's hot spot), with +0.0 gradients."""
    rows = torch.tensor(rows, dtype=torch.long)
    grads = torch.randn(len(rows), dim, generator=torch.Generator().manual_seed(seed))
    unique, summed, _, ids = aggregate_rows(rows, grads)
    agg = aggregate_rows_padded(rows, grads)
    k = len(unique)
    assert agg.rows.shape == rows.shape and agg.grads.shape == grads.shape and agg.valid.shape == rows.shape
    assert int(agg.distinct) == k and torch.equal(agg.valid, torch.arange(len(rows)) < k)
    assert torch.equal(agg.rows[:k], unique) and torch.equal(agg.grads[:k], summed)
    entries, per_row = torch.unique(agg.rows, return_counts=True)
    assert torch.equal(entries, unique) and torch.equal(per_row, ids), "a row's entries are not its ids"
    assert int(agg.ids_max_per_row) == int(ids.max())
    assert torch.equal(agg.grads[k:], torch.zeros(len(rows) - k, dim))
    assert not agg.grads[k:].signbit().any()  # +0.0: adds nothing to any weight or state
    assert torch.equal(agg.rows[agg.inverse], rows)
    assert torch.equal(agg.rows[agg.owner], agg.rows) and bool((agg.owner < k).all())


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.integers(0, 19), min_size=1, max_size=20, unique=True), seed=st.integers(0, 2**16))
def test_the_additive_adagrad_step_is_the_read_modify_write_one_bit_for_bit(rows, seed):
    """update() adds to the state (index_add_) so that padding adds nothing; on unique rows it
    computes the floats of ``acc = state[rows] + mean(g^2); state[rows] = acc``."""
    g = torch.Generator().manual_seed(seed)
    opt = EmbeddingOptimizer(lr=0.7)
    rows = torch.tensor(rows)
    weights, state = torch.randn(20, 3, generator=g), torch.rand(20, 1, generator=g)
    grad = torch.randn(len(rows), 3, generator=g)
    expected_w, expected_s = weights.clone(), state.clone()
    acc = expected_s[rows, 0] + grad.pow(2).mean(1)
    expected_s[rows, 0] = acc
    expected_w.index_add_(0, rows, grad * (opt.lr / (acc.sqrt() + opt.eps)).unsqueeze(1), alpha=-1.0)
    opt.update(weights, state, rows, grad)
    assert torch.equal(weights, expected_w) and torch.equal(state, expected_s)


def _stores(precision: str, opt: EmbeddingOptimizer, num_rows: int, dim: int, padded: bool) -> RowStore:
    g = torch.Generator().manual_seed(1)
    start = torch.randn(num_rows, dim, generator=g)
    kind = row_type(precision)
    if kind.exact:
        store = RowStore(start, opt.new_state(num_rows, CPU), opt)
    else:
        stored, scale = kind.encode(start, None)
        extras = torch.zeros(num_rows, kind.extras(opt.state_width))
        if scale is not None:
            extras[:, :1] = scale
        store = RoundedRowStore(stored, extras, opt, kind, seed=3)
    store.padded_aggregation = padded
    return store


@pytest.mark.parametrize("opt_type", OPTIMIZERS)
@pytest.mark.parametrize("precision", ["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("slots", [False, True], ids=["rows", "slots"])
def test_the_padded_path_trains_exactly_as_the_unique_path(opt_type, precision, slots):
    """Several steps of repeated ids, once through each aggregation: the same bytes of weights,
    state and scales (``slots``: rows keyed by other global rows, as a cache's slots are)."""
    opt = EmbeddingOptimizer(type=opt_type, lr=0.3)
    num_rows, dim = 30, 6
    stores = [_stores(precision, opt, num_rows, dim, padded) for padded in (False, True)]
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        rows = torch.randint(0, num_rows, (40,), generator=g) // torch.randint(1, 4, (40,), generator=g)
        offsets = torch.tensor([0, 5, 5, 17, 30, 40])
        grad_out = torch.randn(5, dim, generator=g)
        keys = rows * 7 + 100 if slots else None
        for store in stores:
            (pooled_lookup(store, rows, offsets, CPU, keys) * grad_out).sum().backward()
    unique_path, padded_path = stores
    assert torch.equal(unique_path.weights, padded_path.weights)
    assert torch.equal(unique_path.state, padded_path.state)
    if isinstance(unique_path, RoundedRowStore):
        assert torch.equal(unique_path.extras, padded_path.extras)
    assert not torch.equal(unique_path.weights, _stores(precision, opt, num_rows, dim, False).weights)  # it trained


@pytest.mark.parametrize("precision", ["fp32", "fp16", "fp8"])
def test_the_padded_backward_dispatches_no_operator_that_reads_a_device_value_on_the_host(precision, monkeypatch):
    """What set_sync_debug_mode("error") fails on CUDA (unique, nonzero, .item(), ...), seen on
    the CPU by the ATen call (embbench.host_reads); the unique path is caught, so the check bites.
    The rounding's draws are replaced: uniform_keyed mixes its (seed, update) key in a CPU
    tensor read with int(), which this check cannot tell from a device read (on CUDA: no sync)."""
    monkeypatch.setattr(embedding, "uniform_keyed", lambda seed, update, rows, columns:
                        torch.rand(rows.numel(), columns, device=rows.device))
    opt = EmbeddingOptimizer()
    rows, offsets, grad = torch.tensor([3, 1, 3, 7, 1, 1]), torch.tensor([0, 2, 6]), torch.randn(2, 4)
    for padded in (True, False):
        store = _stores(precision, opt, 10, 4, padded)
        with HostReadCheck(record=True) as check:
            store.apply_gradient(rows, offsets, grad, keys=rows + 5)
        assert (check.found == []) == padded, check.found

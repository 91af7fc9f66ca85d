"""Popularity drift in the synthetic data: which ids are hot changes every few batches."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from embbench.data import Stream, SyntheticCriteo, TableSpec
from embbench.data.synthetic import DRIFT_HOT_SHARE, _distinct

TABLES = [TableSpec("big", 50_000, 4, 1, 1.15), TableSpec("bag", 8_000, 4, 3, 1.15), TableSpec("tiny", 7, 4, 1, 1.15)]


def _rank_to_id(data, table, index):
    return data.hot_ids(table, TABLES[table].num_rows, index)


def test_batches_before_the_first_change_are_the_undrifted_ones():
    plain, drifting = SyntheticCriteo(TABLES, 5), SyntheticCriteo(TABLES, 5, drift_every=4, drift_fraction=0.5)
    for index in range(4):
        a, b = plain.batch(Stream.TRAIN, index, 64), drifting.batch(Stream.TRAIN, index, 64)
        assert torch.equal(a.sparse.values, b.sparse.values) and torch.equal(a.labels, b.labels)


def test_a_drifted_batch_is_the_same_draw_through_the_drifted_popularity():
    plain, drifting = SyntheticCriteo(TABLES, 5), SyntheticCriteo(TABLES, 5, drift_every=3, drift_fraction=0.3)
    index = 10  # epoch 3
    a, b = plain.batch(Stream.TRAIN, index, 256), drifting.batch(Stream.TRAIN, index, 256)
    assert torch.equal(a.dense, b.dense)
    table_of = a.sparse.table_of_each_id()
    changed = False
    for t in range(len(TABLES)):
        before, after = _rank_to_id(plain, t, 0), _rank_to_id(drifting, t, index)
        assert torch.equal(torch.sort(after).values, torch.arange(TABLES[t].num_rows))  # still a bijection
        rank_of = torch.empty_like(before)
        rank_of[before] = torch.arange(before.numel())
        expected = after[rank_of[a.sparse.values[table_of == t]]]
        assert torch.equal(b.sparse.values[table_of == t], expected)
        changed |= not torch.equal(expected, a.sparse.values[table_of == t])
    assert changed


def test_each_change_swaps_the_given_share_of_hot_ids_for_cold_ones_and_accumulates():
    data = SyntheticCriteo(TABLES, 9, drift_every=2, drift_fraction=0.2)
    hot = int(TABLES[0].num_rows * DRIFT_HOT_SHARE)
    sets = [set(data.hot_ids(0, hot, index).tolist()) for index in (0, 1, 2, 4, 6)]
    assert sets[0] == sets[1]  # the same epoch
    for earlier, later in zip(sets[1:], sets[2:]):
        assert len(earlier - later) == round(0.2 * hot)  # each epoch swaps exactly this many
    assert len(sets[0] - sets[-1]) > round(0.2 * hot)  # and the changes pile up


def test_drift_is_deterministic_under_the_seed_and_any_order_of_access():
    a = SyntheticCriteo(TABLES, 1, drift_every=2, drift_fraction=0.5)
    b = SyntheticCriteo(TABLES, 1, drift_every=2, drift_fraction=0.5)
    forward = [a.batch(Stream.TRAIN, i, 32).sparse.values for i in (3, 9, 5)]
    backward = [b.batch(Stream.TRAIN, i, 32).sparse.values for i in (5, 9, 3)][::-1]
    assert all(torch.equal(x, y) for x, y in zip(forward, backward))
    other = SyntheticCriteo(TABLES, 2, drift_every=2, drift_fraction=0.5)
    assert not torch.equal(a.hot_ids(0, 500, 9), other.hot_ids(0, 500, 9))


@pytest.mark.parametrize("kwargs,message", [
    ({"drift_every": 0, "drift_fraction": 0.1}, "drift_every must be a positive"),
    ({"drift_every": 5, "drift_fraction": 1.5}, r"drift_fraction must lie in \[0, 1\]"),
    ({"drift_fraction": 0.1}, "drift_fraction needs drift_every"),
])
def test_bad_drift_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticCriteo(TABLES, 0, **kwargs)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 200_000), share=st.floats(0.0, 0.25), seed=st.integers(0, 2**31))
def test_distinct_draws_a_subset_of_the_asked_size(n, share, seed):
    count = int(n * share)
    drawn = _distinct(n, count, torch.Generator().manual_seed(seed))
    assert drawn.numel() == count == torch.unique(drawn).numel()
    assert count == 0 or (int(drawn.min()) >= 0 and int(drawn.max()) < n)

import torch
from hypothesis import given, settings, strategies as st

from embbench.data import Stream, SyntheticCriteo, TableSpec, ZipfSampler, make_tables
from embbench.data.presets import PRESETS


def test_presets_have_the_real_cardinalities():
    assert sum(PRESETS["criteo_kaggle"][0]) == 33_762_577
    assert sum(PRESETS["criteo_1tb_freq3"][0]) == 177_944_275
    assert sum(PRESETS["mlperf_dcnv2"][0]) == 204_184_588
    assert all(len(rows) == 26 and len(bags) == 26 for rows, bags in PRESETS.values())
    assert [t.num_rows for t in make_tables("criteo_kaggle", 8, scale=0.001)][:3] == [1, 1, 10131]


def test_same_seed_same_batch_and_streams_differ():
    tables = make_tables("mlperf_dcnv2", 8, scale=0.0001)
    a, b = SyntheticCriteo(tables, seed=3), SyntheticCriteo(tables, seed=3)
    x, y = a.batch(Stream.TRAIN, 5, 32), b.batch(Stream.TRAIN, 5, 32)
    assert torch.equal(x.sparse.values, y.sparse.values) and torch.equal(x.dense, y.dense)
    assert torch.equal(x.labels, y.labels)
    other = a.batch(Stream.EVAL, 5, 32)
    assert not torch.equal(x.sparse.values, other.sparse.values)
    assert not torch.equal(x.sparse.values, SyntheticCriteo(tables, seed=4).batch(Stream.TRAIN, 5, 32).sparse.values)


def test_ids_in_range_and_bag_sizes_follow_the_preset():
    tables = make_tables("mlperf_dcnv2", 8, scale=0.0001)
    batch = SyntheticCriteo(tables, seed=0).batch(Stream.TRAIN, 0, 16)
    lengths = batch.sparse.lengths.view(len(tables), 16)
    assert lengths[:, 0].tolist() == PRESETS["mlperf_dcnv2"][1]
    table_of = batch.sparse.table_of_each_id()
    limits = torch.tensor([t.num_rows for t in tables])[table_of]
    assert bool((batch.sparse.values >= 0).all()) and bool((batch.sparse.values < limits).all())


def test_zipf_top_one_percent_carries_the_predicted_share():
    n, alpha = 200_000, 1.15
    data = SyntheticCriteo([TableSpec("t", n, 4, 1, alpha)], seed=1)
    ids = torch.cat([data.batch(Stream.TRAIN, i, 100_000).sparse.values for i in range(10)])
    counts = torch.bincount(ids, minlength=n).double()
    observed = float(counts.sort(descending=True).values[: n // 100].sum() / counts.sum())
    k = torch.arange(1, n + 1, dtype=torch.float64)
    exact = k.pow(-alpha)
    predicted = float(exact[: n // 100].sum() / exact.sum())
    assert abs(observed - predicted) < 0.01, (observed, predicted)
    # the hottest ids are the ones hot_ids() names, scattered through the table, not 0, 1, 2 ...
    hot = data.hot_ids(0, 5)
    assert set(hot.tolist()) <= set(counts.sort(descending=True).indices[:20].tolist())
    assert hot.tolist() != [0, 1, 2, 3, 4]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 50_000), alpha=st.floats(0.0, 2.0), head=st.integers(1, 64))
def test_zipf_sampler_stays_in_range_and_its_probabilities_sum_to_one(n, alpha, head):
    sampler = ZipfSampler(n, alpha, torch.device("cpu"), head=head)
    ranks = sampler.sample(2000, torch.Generator().manual_seed(0))
    assert int(ranks.min()) >= 0 and int(ranks.max()) < n
    total = float(sampler.probability(torch.arange(n)).sum())
    assert abs(total - 1.0) < 1e-6


def test_shards_partition_the_global_batch():
    tables = make_tables("mlperf_dcnv2", 8, scale=0.0001)
    batch = SyntheticCriteo(tables, seed=0).batch(Stream.TRAIN, 0, 12)
    shards = [batch.shard(r, 3) for r in range(3)]
    assert torch.equal(torch.cat([s.labels for s in shards]), batch.labels)
    for t in range(len(tables)):
        joined = torch.cat([s.sparse.values[s.sparse.table_of_each_id() == t] for s in shards])
        assert torch.equal(joined, batch.sparse.values[batch.sparse.table_of_each_id() == t])


def test_initial_weights_are_each_chunk_s_generator_scaled_bit_for_bit_whatever_the_range():
    """Generated in place, they are still ``rand(chunk) * (2 * bound) - bound`` of each chunk's
    own generator (the numbers every earlier record started from), for any row range."""
    import math

    import torch

    from embbench.data.synthetic import _mix
    from embbench.data.weights import _INIT_CHUNK, initial_weights

    table = TableSpec("t", 3 * _INIT_CHUNK + 17, 5, 1, 1.0)
    bound = 1.0 / math.sqrt(table.num_rows)
    chunks = [torch.rand(min(_INIT_CHUNK, table.num_rows - lo), 5, generator=torch.Generator().manual_seed(_mix(9, 10, 2, c)))
              * (2 * bound) - bound for c, lo in enumerate(range(0, table.num_rows, _INIT_CHUNK))]
    whole = torch.cat(chunks)
    for start, stop in ((0, table.num_rows), (3, _INIT_CHUNK + 5), (_INIT_CHUNK, 2 * _INIT_CHUNK), (7, 7),
                        (table.num_rows - 1, table.num_rows)):
        assert torch.equal(initial_weights(table, 2, 9, start, stop), whole[start:stop]), (start, stop)


def test_parallel_fills_run_every_job_once_and_raise_a_job_s_error():
    import pytest

    from embbench.data.weights import fill_in_parallel

    done = []
    fill_in_parallel(done.append, range(100), workers=4)
    assert sorted(done) == list(range(100))

    def fail(job):
        if job == 7:
            raise ValueError("job 7")

    with pytest.raises(ValueError, match="job 7"):
        fill_in_parallel(fail, range(10), workers=3)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 10**9), scale=st.floats(1e-9, 1.0), floor=st.integers(1, 10**6))
def test_a_scaled_table_keeps_the_floor_within_its_own_cardinality(rows, scale, floor):
    from embbench.data.presets import scaled_rows

    n = scaled_rows(rows, scale, floor)
    assert 1 <= n <= rows
    assert n >= min(rows, floor) and n >= int(rows * scale)
    assert scaled_rows(rows, scale) == max(1, int(rows * scale))  # no floor: the scale alone

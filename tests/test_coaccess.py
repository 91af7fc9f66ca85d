"""Co-access (issue 48, item 2): synthetic samples drawn from entities whose rows recur
together, and the ``coaccess`` file layout that puts a sample's rows in one page. The layout is
exact like the others; it reads fewer pages a needed row only where rows are used together,
which the default synthetic data (every id drawn on its own) never has."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from embbench.cache.tiers import TierSizes, tier_model
from embbench.data import SparseFeatures, TableSpec
from embbench.data.synthetic import CoAccess, Stream, SyntheticCriteo
from embbench.disk.layout import PAGE, RowOrder
from embbench.embedding import RowSpace
from embbench.scenario import ScenarioError, parse_scenario
from tests.conftest import tiny_scenario

TABLES = [TableSpec("a", 20_000, 8, 1, 1.05), TableSpec("b", 20_000, 8, 2, 1.05), TableSpec("c", 20_000, 8, 1, 1.05),
          TableSpec("d", 50, 8, 1, 1.05)]


def _tuples(batch, tables=TABLES) -> list[tuple]:
    """Each sample's ids, all tables (bags in order)."""
    values, lengths = batch.sparse.values.tolist(), batch.sparse.lengths.view(len(tables), -1)
    offsets = np.concatenate([[0], np.cumsum(batch.sparse.lengths.numpy())])
    B = lengths.shape[1]
    return [tuple(v for t in range(len(tables)) for v in values[offsets[t * B + b]:offsets[t * B + b + 1]])
            for b in range(B)]


def test_without_co_access_the_batches_are_unchanged_and_with_it_only_the_entity_samples_change():
    plain = SyntheticCriteo(TABLES, 5)
    co = SyntheticCriteo(TABLES, 5, coaccess=CoAccess(0.5, 300))
    for index in (0, 7):
        a, b = plain.batch(Stream.TRAIN, index, 2048), co.batch(Stream.TRAIN, index, 2048)
        assert torch.equal(a.dense, b.dense) and torch.equal(a.sparse.lengths, b.sparse.lengths)
        same = np.array([x == y for x, y in zip(_tuples(a), _tuples(b))])
        assert 0.45 < 1 - same.mean() < 0.55  # the share drawn from entities
        # the independent samples keep their ids (and labels, which depend on nothing else)
        assert torch.equal(a.labels[torch.from_numpy(same)], b.labels[torch.from_numpy(same)])


def test_an_entity_s_rows_recur_together_in_every_table_and_bag_deterministically():
    co = SyntheticCriteo(TABLES, 5, coaccess=CoAccess(1.0, 40, alpha=0.0))
    samples = [t for i in range(4) for t in _tuples(co.batch(Stream.TRAIN, i, 512))]
    assert len(set(samples)) <= 40  # every sample is one of the 40 entities' id tuples
    assert len(set(samples)) >= 35  # uniform over them: nearly all appear in 2048 draws
    assert all(len(set(t[1:3])) == 2 for t in set(samples))  # a bag holds an entity's distinct ids
    again = SyntheticCriteo(TABLES, 5, coaccess=CoAccess(1.0, 40, alpha=0.0))
    assert torch.equal(again.batch(Stream.TRAIN, 3, 512).sparse.values, co.batch(Stream.TRAIN, 3, 512).sparse.values)
    held_out = co.batch(Stream.EVAL, 3, 512)  # the held-out stream draws its own samples from the same entities
    assert set(_tuples(held_out)) <= set(samples) | set(_tuples(co.batch(Stream.TRAIN, 9, 4096)))
    assert not torch.equal(held_out.sparse.values, co.batch(Stream.TRAIN, 3, 512).sparse.values)
    other_seed = SyntheticCriteo(TABLES, 6, coaccess=CoAccess(1.0, 40, alpha=0.0))
    assert set(_tuples(other_seed.batch(Stream.TRAIN, 0, 512))).isdisjoint(samples)


def test_co_access_settings_are_checked():
    for bad, message in (({"share": 0.0, "entities": 10}, "share must lie in"),
                         ({"share": 0.5, "entities": 0}, "entities must be at least 1"),
                         ({"share": 0.5, "entities": 10, "alpha": -1.0}, "alpha must be >= 0")):
        with pytest.raises(ValueError, match=message):
            CoAccess(**bad)


def test_the_scenario_s_coaccess_key_is_the_generator_s():
    raw = tiny_scenario(data={"scale": 0.002}, run={"seed": 3})
    raw["data"]["coaccess"] = {"share": 0.7, "entities": 900, "alpha": 0.8}
    scenario, _ = parse_scenario(raw)
    reference = SyntheticCriteo(scenario.tables(), 3, "cpu", coaccess=CoAccess(0.7, 900, 0.8))
    assert torch.equal(scenario.data_source("cpu").batch(Stream.TRAIN, 2, 256).sparse.values,
                       reference.batch(Stream.TRAIN, 2, 256).sparse.values)
    for bad, message in (({"share": 0.5}, "data.coaccess.entities: Field required"),
                         ({"share": 1.5, "entities": 9}, "data.coaccess.share: Input should be less than or equal to 1"),
                         ({"share": 0.5, "entities": 9, "sessions": 2}, "data.coaccess.sessions: unknown key")):
        raw["data"]["coaccess"] = bad
        with pytest.raises(ScenarioError, match=message):
            parse_scenario(raw, "bad.yaml")
    trace = tiny_scenario(data={"source": "trace", "path": "x.npz", "coaccess": {"share": 0.5, "entities": 9}})
    trace["data"].pop("preset", None), trace["data"].pop("scale")
    with pytest.raises(ScenarioError, match="data.coaccess: only for source synthetic"):
        parse_scenario(trace, "bad.yaml")


def test_each_id_s_sample_follows_the_table_major_lengths():
    features = SparseFeatures(torch.tensor([5, 6, 7, 8, 9, 1]), torch.tensor([2, 0, 1, 1, 1, 1]), 2)
    assert features.sample_of_each_id().tolist() == [0, 0, 2, 0, 1, 2]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 600), seed=st.integers(0, 10_000), batches=st.integers(0, 5),
       per_page=st.integers(1, 20), cached=st.integers(0, 50))
def test_the_coaccess_order_is_a_permutation_that_keeps_a_sample_s_rows_in_one_page(rows, seed, batches, per_page,
                                                                                      cached):
    rng = np.random.default_rng(seed)
    profiled, samples = [], []
    for _ in range(batches):
        size = int(rng.integers(1, 12))
        samples.append(np.repeat(np.arange(size), rng.integers(1, 6, size)))
        profiled.append(rng.zipf(1.3, len(samples[-1])) % rows)
    order = RowOrder.by_coaccess(rows, profiled, samples, per_page, cached)
    places = order.place(np.arange(rows))
    assert sorted(places.tolist()) == list(range(rows))  # exact: every row at one place, every place one row
    assert np.array_equal(order.row_at(places), np.arange(rows))
    assert order.nbytes == 8 * len(order.moved)  # int32 row and place: the map counted as the others'
    assert len(order.moved) <= 3 * sum(map(len, profiled))  # what freqcache's estimate counts
    if not batches:
        return
    used = np.bincount(np.concatenate([np.unique(b) for b in profiled]).astype(np.int64), minlength=rows)
    often = np.flatnonzero(used >= 2)
    hot = often[np.lexsort((often, -used[often]))][:cached]
    assert np.array_equal(order.row_at(np.arange(len(hot))), hot)  # the device's rows first, most used first
    # the rows a sample used first, as often as each other, share a page where they fit in one
    all_rows = np.concatenate(profiled)
    first_sample = {}
    offset = 0
    for b, s in zip(profiled, samples):
        for r, k in zip(b.tolist(), (s + offset).tolist()):
            first_sample.setdefault(r, k)
        offset += int(s.max()) + 1
    groups: dict = {}
    for r in set(all_rows.tolist()) - set(hot.tolist()):
        groups.setdefault((first_sample[r], used[r]), []).append(r)
    spread_out = [g for g in groups.values() if len(g) <= per_page and len(set(order.place(np.array(g)) // per_page)) > 1]
    gaps = sum(-len(g) % per_page for g in groups.values())
    assert not spread_out or len(hot) + sum(map(len, groups.values())) + gaps > rows  # (no room: one after another)


def _tiers(coaccess, seed=3):
    """The tier model of 32 batches of 128 (16 profiled, 16 counted) of three 20k-row tables and
    two small ones, 16 rows a page, host memory 3 % of the pages, LRU at both tiers:
    {layout: (read amplification, pages read a step)}."""
    tables = [TableSpec(f"t{i}", n, 8, 1, 1.05) for i, n in enumerate([20_000, 20_000, 20_000, 50, 300])]
    space, data = RowSpace(tables), SyntheticCriteo(tables, seed, coaccess=coaccess)
    features = [data.batch(Stream.TRAIN, i, 128).sparse for i in range(32)]
    steps = [space.global_rows(f).numpy() for f in features]
    section = tier_model(steps, space.num_rows, 256, TierSizes(0.01, 0.03), ("lru",), 16, profile=16,
                         samples=[f.sample_of_each_id().numpy() for f in features[:16]])
    return {e["layout"]: (e["nvme"]["read_amplification"], e["nvme"]["pages_read_per_step"])
            for e in section["entries"] if e["dram_policy"] == "lru"}


def test_only_rows_used_together_let_a_layout_read_well_below_one_row_a_page():
    one_row_a_page = PAGE / 256
    # every id drawn on its own: the rows a batch needs from the drive share a page by chance
    # (and because a profile's warm rows sit together), never much more than one a page
    assert all(amp > 0.85 * one_row_a_page for amp, _ in _tiers(None).values())
    # rows used together (1000 entities, most seen in the profile): coaccess reads under half
    # the bytes a needed row of any other layout, and the fewest pages
    entities = _tiers(CoAccess(1.0, 1000, alpha=0.3))
    amp, pages = entities.pop("coaccess")
    assert amp < 0.5 * one_row_a_page
    assert all(amp < 0.8 * other_amp and pages <= other_pages for other_amp, other_pages in entities.values())


def test_the_tier_model_needs_the_samples_for_the_coaccess_layout():
    steps = [np.arange(10), np.arange(5, 15)]
    with pytest.raises(ValueError, match="coaccess layout needs the sample of each profiled id"):
        tier_model(steps, 100, 256, TierSizes(0.1, 0.5), ("lru",), 1, profile=1, layouts=("coaccess",))
    section = tier_model(steps, 100, 256, TierSizes(0.1, 0.5), ("lru",), 1, profile=1)
    assert "coaccess" not in {e["layout"] for e in section["entries"]}


def test_freqcache_places_its_file_by_co_access_and_trains_what_the_host_table_trains(tmp_path):
    from embbench.optim import EmbeddingOptimizer
    from tests.test_file_store import _batches, _pair
    from tests.test_freqcache import _train

    tables = [TableSpec("a", 3000, 8, 2, 1.0), TableSpec("b", 1500, 8, 1, 1.0)]
    batches = _batches(tables, 8, 16, 1)
    memory, on_file = _pair(tables, batches, EmbeddingOptimizer(type="rowwise_adagrad", lr=0.2), tmp_path,
                            dram_ratio=0.5, store_layout="coaccess")
    try:
        order = on_file.file_rows.order
        assert order.name == "coaccess" and len(order.moved) > 0
        # the profile's first batch: a sample's rows the device does not cache share a page
        space = RowSpace(tables)
        rows, samples = space.global_rows(batches[0]).numpy(), batches[0].sample_of_each_id().numpy()
        per_page = on_file.file_rows.layout.rows_per_page
        cached = set(order.row_at(np.arange(on_file.capacity)).tolist())
        first = [r for r, s in zip(rows.tolist(), samples.tolist()) if s == 3 and r not in cached]
        assert len(set((order.place(np.array(first)) // per_page).tolist())) == 1
        expected = _train(memory, batches, prefetch=True, lookahead=2)
        got = _train(on_file, batches, prefetch=True, lookahead=2)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert all(torch.equal(a, b) for a, b in zip(on_file.flush(), memory.flush()))
    finally:
        on_file.file_rows.close()


def test_the_preflight_places_a_coaccess_file_and_counts_its_map(tmp_path):
    from embbench.launch import memory_preflight
    from embbench.scenario import Cell

    raw = tiny_scenario(data={"scale": 0.2})
    raw["data"]["coaccess"] = {"share": 0.5, "entities": 500}
    scenario, _ = parse_scenario(raw, "t.yaml")
    cells = {layout: Cell("freqcache", {"store": "file", "dram_ratio": 0.1, "store_dir": str(tmp_path),
                                        "store_layout": layout}, 1) for layout in ("frequency", "coaccess")}
    estimate = {layout: cell.make_strategy().estimate_memory(scenario.tables(), scenario.optimizer.embedding, 1,
                                                             local_batch_size=64, train_steps=10)
                for layout, cell in cells.items()}
    rows = sum(t.num_rows for t in scenario.tables())
    ids = 32 * 64 * sum(t.bag_size for t in scenario.tables())  # profile_batches x batch x ids a sample
    assert estimate["coaccess"].host_bytes - estimate["frequency"].host_bytes == 8 * (min(rows, 3 * ids) - min(rows, ids))
    assert memory_preflight(scenario, cells["coaccess"], torch.device("cpu"))[1] is None  # it built the order

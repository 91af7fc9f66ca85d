"""Co-access (issue 48, item 2): synthetic samples drawn from entities whose rows recur
together."""

import numpy as np
import pytest
import torch

from embbench.data import SparseFeatures, TableSpec
from embbench.data.synthetic import CoAccess, Stream, SyntheticCriteo
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

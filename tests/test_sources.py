"""Data sources beyond the synthetic preset: Criteo TSV files (parsed against a plain-Python
reader, malformed files, the cache, the split and min_count), traces (record and replay, bad
traces), the DCNv2 model, and the scenario keys that choose them."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from embbench.data.criteo import (FIRST_ID_ROW, MISSING_ROW, RARE_ROW, CriteoSource, DataFormatError, convert_file,
                                  input_files, prepare_dataset)
from embbench.data.fake_criteo import write_fake_criteo
from embbench.data.presets import make_tables
from embbench.data.sources import CACHE_ENV, DataSizeError
from embbench.data.synthetic import Stream, SyntheticCriteo
from embbench.data.trace import Trace, TraceError, TraceSource, record_trace
from embbench.model import CrossLayer, DCNv2, ModelConfig, build_model
from embbench.scenario import ScenarioError, parse_scenario
from tests.conftest import tiny_scenario, train_and_flush


def _reference_rows(path: Path, hash_size: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A plain-Python reading of a Criteo file: labels, log(1 + max(x, 0)) dense, hex ids (-1 empty)."""
    opener = gzip.open if path.suffix == ".gz" else open
    labels, dense, ids = [], [], []
    with opener(path, "rt") as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            labels.append(int(fields[0]))
            dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:14]])
            raw = [int(x, 16) if x else -1 for x in fields[14:]]
            ids.append([x % hash_size if hash_size and x >= 0 else x for x in raw])
    return np.array(labels), np.array(dense, dtype=np.float32), np.array(ids)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("hash_size", [None, 97])
def test_the_parser_reads_what_a_plain_reader_reads(tmp_path, gz, hash_size):
    path = write_fake_criteo(tmp_path / ("day_0.gz" if gz else "day_0"), 700, seed=3, gz=gz)
    # A small block size: the file is read in several pyarrow batches.
    parsed = convert_file(path, tmp_path / "cache", [hash_size] * 26 if hash_size else None, block_size=1 << 14)
    labels, dense, ids = _reference_rows(path, hash_size)
    assert parsed.rows == 700
    np.testing.assert_array_equal(parsed.array("labels"), labels)
    np.testing.assert_allclose(parsed.array("dense"), dense, rtol=1e-6)
    np.testing.assert_array_equal(parsed.array("ids"), ids)
    assert (ids == -1).any() and (dense == 0).any()  # the fake file has empty fields


def _line(label="1", dense=None, ids=None) -> str:
    dense = dense if dense is not None else ["3"] * 13
    ids = ids if ids is not None else ["a1b2c3d4"] * 26
    return "\t".join([label, *dense, *ids]) + "\n"


@pytest.mark.parametrize("bad, expected", [
    (_line(label="2"), ":3: column 1 (label): label 2, expected 0 or 1"),
    (_line(dense=["3"] * 4 + ["1.5"] + ["3"] * 8), ":3: column 6 (I5): '1.5' is not an integer"),
    (_line(ids=["a1"] * 20 + ["zz12"] + ["a1"] * 5), ":3: column 35 (C21): not a hexadecimal id: 'zz12'"),
    ("1\t2\t3\n", ":3: 3 tab-separated columns, expected 40"),
    ("\n", ":3: 1 tab-separated columns, expected 40"),
])
def test_a_malformed_line_is_named_and_nothing_is_cached(tmp_path, bad, expected):
    path = tmp_path / "train.txt"
    path.write_text(_line() + _line(label="0") + bad + _line())
    cache = tmp_path / "cache"
    with pytest.raises(DataFormatError) as e:
        convert_file(path, cache, None)
    assert str(e.value) == f"{path}{expected}"
    assert not any(p.name.startswith("train") for p in (cache / "files").iterdir())  # no entry, no leftovers


def test_a_file_that_is_not_text_is_an_error(tmp_path):
    path = tmp_path / "train.txt"
    path.write_bytes(_line().encode() + b"\x00\x01\x02binary")
    with pytest.raises(DataFormatError, match=r"train.txt:2: not a text file"):
        convert_file(path, tmp_path / "cache", None)


def test_a_directory_reads_its_days_in_order_and_a_missing_path_is_named(tmp_path):
    for day in (10, 2, 0):
        (tmp_path / f"day_{day}").write_text(_line())
    assert [p.name for p in input_files(tmp_path, "terabyte")] == ["day_0", "day_2", "day_10"]
    with pytest.raises(FileNotFoundError, match="nowhere/x: no such file or directory"):
        input_files(tmp_path / "nowhere" / "x")


def test_split_min_count_and_the_cache(tmp_path):
    path = write_fake_criteo(tmp_path / "train.txt", 1000, seed=5, cardinality=50)
    cache = tmp_path / "cache"
    ds = prepare_dataset([path], cache, 0.2, None, min_count=3)
    assert ds.rows(Stream.TRAIN) == 800 and ds.rows(Stream.EVAL) == 200
    _, _, raw = _reference_rows(path)
    rows = np.load(ds.train[0].ids_path)
    for t in (0, 7, 25):
        train_ids = raw[:800, t]
        values, counts = np.unique(train_ids[train_ids >= 0], return_counts=True)
        kept = values[counts >= 3]
        expected = np.array([MISSING_ROW if x < 0 else FIRST_ID_ROW + int(np.searchsorted(kept, x)) if x in kept
                             else RARE_ROW for x in raw[:, t]])
        np.testing.assert_array_equal(rows[:, t], expected)  # eval ids never seen in training: the rare row
        assert ds.cardinalities[t] == len(kept) + FIRST_ID_ROW
    # A second preparation reads the cache: nothing is parsed again.
    stamp = (ds.directory / "meta.json").stat().st_mtime_ns
    again = prepare_dataset([path], cache, 0.2, None, min_count=3)
    assert again.directory == ds.directory and (ds.directory / "meta.json").stat().st_mtime_ns == stamp
    # The source cuts batches in row order and cycles.
    source = CriteoSource(ds)
    first = source.batch(Stream.TRAIN, 0, 64)
    np.testing.assert_array_equal(first.sparse.values.view(26, 64).T.numpy(), rows[:64])
    wrapped = source.batch(Stream.TRAIN, 12, 64)  # rows 768..831 of 800: the last 32, then the first 32
    np.testing.assert_array_equal(wrapped.sparse.values.view(26, 64).T.numpy()[32:], rows[:32])
    assert source.batch(Stream.EVAL, 0, 64).labels.tolist() == _reference_rows(path)[0][800:864].tolist()


def _bags(f) -> list[list[list[int]]]:
    lengths = f.lengths.view(f.num_tables, -1).tolist()
    it = iter(f.values.tolist())
    return [[[next(it) for _ in range(n)] for n in table] for table in lengths]


def _tsv_scenario(path: Path, **run) -> dict:
    return tiny_scenario(
        data={"source": "criteo_tsv", "path": str(path), "eval": 0.25, "embedding_dim": 8, "batch_size": 64,
              "preset": "criteo_kaggle", "scale": 1.0},
        run={"warmup_steps": 1, "steps": 3, "repeats": 2, "eval_batches": 2, **run},
    )


def test_a_criteo_file_trains_every_placement_with_an_auc(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = write_fake_criteo(tmp_path / "train.txt", 1500, seed=1)  # 16 batches of 64 to train on
    raw = _tsv_scenario(path)
    raw["data"] = {k: v for k, v in raw["data"].items() if k not in ("preset", "scale")}
    flushed, metrics = train_and_flush(raw, "device", tmp_path=tmp_path)
    assert 0 < metrics["accuracy"]["auc"] < 1 and math.isfinite(metrics["accuracy"]["logloss"])
    scenario, _ = parse_scenario(raw)
    assert [w.shape[0] for w in flushed] == [t.num_rows for t in scenario.tables()]
    cpu_flushed, cpu_metrics = train_and_flush(raw, "cpu", tmp_path=tmp_path)
    assert cpu_metrics["accuracy"]["auc"] == pytest.approx(metrics["accuracy"]["auc"], abs=1e-3)
    for a, b in zip(flushed, cpu_flushed):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_file_shorter_than_the_run_says_what_it_has_and_needs(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = write_fake_criteo(tmp_path / "train.txt", 400, seed=1)
    raw = _tsv_scenario(path)
    raw["data"] = {k: v for k, v in raw["data"].items() if k not in ("preset", "scale")}
    scenario, _ = parse_scenario(raw)
    with pytest.raises(DataSizeError, match=r"the train stream has 300 rows; the run needs .*Set data.epochs: \d"):
        scenario.data_source("cpu")
    raw["data"]["batch_size"] = 512
    with pytest.raises(DataSizeError, match=r"the train stream has 300 rows, fewer than one batch"):
        parse_scenario(raw)[0].data_source("cpu")
    raw["data"].update(batch_size=64, epochs=10)
    assert parse_scenario(raw)[0].data_source("cpu").batch(Stream.TRAIN, 20, 64).labels.shape == (64,)


def test_a_trace_replays_the_multi_hot_stream_it_recorded(tmp_path):
    tables = make_tables("mlperf_dcnv2", 8, scale=1e-4)
    assert max(t.bag_size for t in tables) > 1
    source = SyntheticCriteo(tables, 7)
    out = tmp_path / "t.npz"
    record_trace(source, [t.num_rows for t in tables], 32, 3, 1, out, features=True)
    trace = Trace(out)
    assert trace.samples(Stream.TRAIN) == 96 and trace.bag_sizes() == [t.bag_size for t in tables]
    replay = TraceSource(trace, seed=0)
    for stream, index, size in ((Stream.TRAIN, 0, 32), (Stream.TRAIN, 2, 32), (Stream.EVAL, 0, 32)):
        a, b = source.batch(stream, index, size), replay.batch(stream, index, size)
        assert torch.equal(a.sparse.values, b.sparse.values) and torch.equal(a.sparse.lengths, b.sparse.lengths)
        assert torch.equal(a.labels, b.labels) and torch.equal(a.dense, b.dense)
    # Another batch size cuts the same sample stream: batch 2 of 16 is the first half of batch 1 of 32.
    assert _bags(replay.batch(Stream.TRAIN, 2, 16).sparse) == [t[:16] for t in _bags(source.batch(Stream.TRAIN, 1, 32).sparse)]
    # Without features, a replay synthesises labels a model can learn and keeps the ids.
    record_trace(source, [t.num_rows for t in tables], 32, 3, 1, out, features=False)
    bare = TraceSource(Trace(out), seed=0).batch(Stream.TRAIN, 0, 32)
    assert torch.equal(bare.sparse.values, source.batch(Stream.TRAIN, 0, 32).sparse.values)
    assert set(bare.labels.unique().tolist()) <= {0.0, 1.0}


def test_a_bad_trace_is_named(tmp_path):
    out = tmp_path / "t.npz"
    lengths = np.ones((4, 2), np.int32)
    np.savez(out, format=np.array("embbench-trace-1"), num_rows=np.array([10, 5]), train_lengths=lengths,
             train_values=np.array([1, 2, 3, 4, 5, 0, 7, 5]), eval_lengths=lengths[:0], eval_values=np.zeros(0, np.int64))
    with pytest.raises(TraceError, match=r"train_values\[7\] = 5 is outside table 1 \(num_rows 5\)"):
        Trace(out)
    np.savez(out, format=np.array("other"))
    with pytest.raises(TraceError, match="format 'other'"):
        Trace(out)
    with pytest.raises(TraceError, match="no such trace file"):
        Trace(tmp_path / "missing.npz")


def test_a_trace_scenario_trains(tmp_path):
    tables = make_tables("mlperf_dcnv2", 8, scale=1e-4)
    out = tmp_path / "t.npz"
    record_trace(SyntheticCriteo(tables, 7), [t.num_rows for t in tables], 64, 16, 2, out)  # the batches a run reads
    raw = tiny_scenario(data={"source": "trace", "path": str(out), "embedding_dim": 8, "batch_size": 64})
    raw["data"] = {k: v for k, v in raw["data"].items() if k not in ("preset", "scale")}
    scenario, _ = parse_scenario(raw)
    assert [t.num_rows for t in scenario.tables()] == [t.num_rows for t in tables]
    _, metrics = train_and_flush(raw, "device", tmp_path=tmp_path)
    assert math.isfinite(metrics["accuracy"]["logloss"])


def test_dcnv2_cross_layers_follow_the_formula():
    torch.manual_seed(0)
    config = ModelConfig(arch="dcnv2", bottom_mlp=[8, 4], top_mlp=[6, 1], cross_layers=2, cross_rank=3)
    model = build_model(config, 13, 2, 4)
    assert isinstance(model, DCNv2)
    dense, pooled = torch.randn(5, 13), torch.randn(5, 8)
    x0 = torch.cat([model.bottom(dense), pooled], 1)
    x = x0
    for layer in model.cross:
        down, up = layer.project[0], layer.project[1]
        x = x0 * (x @ down.weight.T @ up.weight.T + up.bias) + x  # W = U V of rank 3
    torch.testing.assert_close(model(dense, pooled), model.top(x).squeeze(1))
    full = CrossLayer(12, None)
    assert isinstance(full.project, torch.nn.Linear)


def test_a_record_written_before_dcnv2_still_parses():
    scenario, _ = parse_scenario(tiny_scenario(model={"type": "dlrm", "bottom_mlp": [16, 8], "top_mlp": [16, 1]}))
    assert scenario.model.arch == "dlrm" and "type" not in scenario.model.model_dump()


def test_data_keys_belong_to_their_source():
    raw = tiny_scenario(data={"source": "criteo_tsv", "path": "x.tsv", "alpha": 0.9})
    raw["data"].pop("preset", None), raw["data"].pop("scale")
    with pytest.raises(ScenarioError, match="data.alpha: only for source synthetic, this data's source is criteo_tsv"):
        parse_scenario(raw, "s.yaml")
    with pytest.raises(ScenarioError, match="data.preset: preset 'criteo_1tb' was renamed: use criteo_1tb_freq3"):
        parse_scenario(tiny_scenario(data={"preset": "criteo_1tb"}), "s.yaml")
    with pytest.raises(ScenarioError, match="data.alpha: a list needs one value per table \\(26\\), got 2"):
        parse_scenario(tiny_scenario(data={"alpha": [1.0, 1.1]}), "s.yaml")
    scenario, _ = parse_scenario(tiny_scenario(data={"alpha": [0.9 + t / 100 for t in range(26)]}))
    assert [t.alpha for t in scenario.tables()][:2] == [0.9, 0.91]


def test_the_drift_key_is_the_generators_drift():
    raw = tiny_scenario(data={"scale": 0.002}, run={"seed": 3})
    steady = parse_scenario(raw)[0].data_source("cpu")
    raw["data"]["drift"] = {"every": 4, "fraction": 0.5}
    scenario, _ = parse_scenario(raw)
    drifting = scenario.data_source("cpu")
    reference = SyntheticCriteo(scenario.tables(), 3, "cpu", drift_every=4, drift_fraction=0.5)
    for index in (0, 3, 4, 40):
        assert torch.equal(drifting.batch(Stream.TRAIN, index, 256).sparse.values,
                           reference.batch(Stream.TRAIN, index, 256).sparse.values)
    # the first N batches are the steady stream's; later ones are not
    assert torch.equal(steady.batch(Stream.TRAIN, 3, 256).sparse.values, drifting.batch(Stream.TRAIN, 3, 256).sparse.values)
    for index in (4, 40):
        assert not torch.equal(steady.batch(Stream.TRAIN, index, 256).sparse.values,
                               drifting.batch(Stream.TRAIN, index, 256).sparse.values)


@pytest.mark.parametrize("strategy, params", [
    ("cpu", {}), ("freqcache", {"cache_ratio": 0.3}), ("colossalai", {"cache_ratio": 0.5, "optimizer_state": "row"}),
])
@pytest.mark.slow
def test_multi_hot_bags_and_dcnv2_train_every_cpu_placement_like_device(tmp_path, strategy, params):
    # Smaller steps than TINY's: sums of multi-hot bags through cross layers overflow at lr 0.1.
    raw = tiny_scenario(data={"preset": "mlperf_dcnv2", "scale": 0.0001},
                        model={"arch": "dcnv2", "cross_layers": 2, "cross_rank": 4},
                        optimizer={"embedding": {"type": "rowwise_adagrad", "lr": 0.05}, "dense": {"type": "adagrad", "lr": 0.01}})
    assert max(t.bag_size for t in parse_scenario(raw)[0].tables()) > 1
    reference, _ = train_and_flush(raw, "device", tmp_path=tmp_path)
    flushed, metrics = train_and_flush(raw, strategy, params, tmp_path=tmp_path)
    assert math.isfinite(metrics["accuracy"]["logloss"])
    for a, b in zip(reference, flushed):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_evaluation_files_are_never_counted(tmp_path):
    train = write_fake_criteo(tmp_path / "day_0", 300, seed=1, cardinality=40)
    held_out = write_fake_criteo(tmp_path / "day_1", 200, seed=2, cardinality=40)  # other ids
    ds = prepare_dataset([train], tmp_path / "cache", [held_out], None, min_count=1)
    assert ds.rows(Stream.TRAIN) == 300 and ds.rows(Stream.EVAL) == 200
    _, _, train_ids = _reference_rows(train)
    _, _, eval_ids = _reference_rows(held_out)
    assert ds.cardinalities == [len(np.unique(c[c >= 0])) + FIRST_ID_ROW for c in train_ids.T]
    evaluated = np.load(ds.eval[0].ids_path)
    unseen = (eval_ids >= 0) & ~np.stack([np.isin(e, t) for e, t in zip(eval_ids.T, train_ids.T)], 1)
    assert unseen.any() and (evaluated[unseen] == RARE_ROW).all()


def test_epochs_repeat_the_training_rows_and_each_held_out_row_is_evaluated_once(tmp_path, monkeypatch):
    """A small sample with data.epochs: training reads its rows again, the evaluation reads each
    held-out row once (as many whole batches as they hold, at most run.eval_batches), and a
    batch past their end is refused, never taken from the start again."""
    from embbench.data.sources import eval_batches

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = write_fake_criteo(tmp_path / "train.txt", 400, seed=1)  # 300 training and 100 held-out rows
    raw = _tsv_scenario(path, eval_batches=4)
    raw["data"] = {k: v for k, v in raw["data"].items() if k not in ("preset", "scale")}
    raw["data"].update(batch_size=32, epochs=2)
    scenario, _ = parse_scenario(raw)
    assert eval_batches(scenario.data, scenario.run) == 3  # 100 rows hold 3 whole batches of 32, not 4
    source = scenario.data_source("cpu")
    assert source.batch(Stream.TRAIN, 12, 32).labels.shape == (32,)  # row 384 of 300: the second epoch
    with pytest.raises(ValueError, match=r"evaluation batch 3 of 32 samples reads past the 100 held-out rows"):
        source.batch(Stream.EVAL, 3, 32)
    _, metrics = train_and_flush(raw, "device", tmp_path=tmp_path)
    assert metrics["accuracy"]["eval_samples"] == 96


def test_a_trace_evaluates_each_recorded_sample_once(tmp_path):
    tables = make_tables("criteo_kaggle", 8, scale=1e-5)
    out = tmp_path / "t.npz"
    record_trace(SyntheticCriteo(tables, 7), [t.num_rows for t in tables], 16, 3, 2, out)
    replay = TraceSource(Trace(out), seed=0)
    assert replay.batch(Stream.TRAIN, 5, 16).size == 16  # training wraps around
    assert replay.batch(Stream.EVAL, 1, 16).size == 16
    with pytest.raises(ValueError, match=r"evaluation batch 2 of 16 samples reads past the 32 held-out rows"):
        replay.batch(Stream.EVAL, 2, 16)

"""The prepared Criteo data cache proves itself: a damaged entry is rebuilt from its source
or refused by name, never trained on; temporary folders of dead processes go; the cache
key follows the data, not the run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embbench.data import cache as data_cache
from embbench.data import criteo
from embbench.data.criteo import prepare_dataset
from embbench.data.fake_criteo import write_fake_criteo
from embbench.data.synthetic import Stream

ROOT = Path(__file__).resolve().parents[1]
ROWS = 1000


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A source file and a cache prepared from it, copied before each example damages it."""
    root = tmp_path_factory.mktemp("pristine")
    source = write_fake_criteo(root / "train.txt", ROWS, seed=4, cardinality=30)
    prepare_dataset([source], root / "cache", 0.2, None, min_count=2)
    return source, root / "cache"


def _prepare(source: Path, cache: Path, verify: bool = False) -> tuple[criteo.CriteoDataset, str]:
    """The dataset as a run opens it, and what was said on stderr meanwhile."""
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        ds = prepare_dataset([source], cache, 0.2, None, min_count=2, verify=verify)
    return ds, said.getvalue()


def _contents(ds) -> list[np.ndarray]:
    f = ds.train[0].file
    return [np.array(f.array(name)) for name in ("labels", "dense", "ids")] + [
        np.load(ds.train[0].ids_path), np.array(ds.cardinalities)]


def _entry_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob("*/*/*") if p.is_file())


def _damage(path: Path, how: str, data) -> None:
    raw = path.read_bytes()
    if how == "truncate":
        path.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1), label="keep")])
    elif how == "extend":
        path.write_bytes(raw + data.draw(st.binary(min_size=1, max_size=64), label="extra"))
    elif how == "flip":
        offsets = data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=8, unique=True), label="at")
        mask = data.draw(st.integers(1, 255), label="mask")
        changed = bytearray(raw)
        for at in offsets:
            changed[at] ^= mask
        path.write_bytes(bytes(changed))
    elif how == "delete":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(data.draw(st.binary(min_size=1, max_size=200), label="garbage"))
    elif how == "dtype":  # the header says another type of the same width: no size changes
        if path.suffix == ".npy":
            header = raw[:128].decode("latin-1")
            a, b = next((a, b) for a, b in (("'|i1'", "'|u1'"), ("'<f4'", "'<i4'"), ("'<i4'", "'<f4'"), ("'<i8'", "'<f8'"))
                        if a in header)
            path.write_bytes(header.replace(a, b).encode("latin-1") + raw[128:])
        else:  # meta.json: another row count
            path.write_text(path.read_text().replace(f"{ROWS}", f"{ROWS - 1}", 1))


DAMAGES = ["truncate", "extend", "flip", "delete", "empty", "garbage", "dtype"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), how=st.sampled_from(DAMAGES), source_gone=st.booleans())
def test_any_damaged_file_of_an_entry_is_rebuilt_or_refused_by_name(pristine, data, how, source_gone):
    source, clean = pristine
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        shutil.copytree(clean, cache)
        expected = _contents(_prepare(source, cache)[0])
        victim = data.draw(st.sampled_from(_entry_files(cache)), label="file")
        _damage(victim, how, data)
        entry = victim.parent
        moved = Path(tmp) / "away.txt"
        if source_gone:
            shutil.copy2(source, moved)
            source.unlink()
        try:
            if source_gone and entry.parent.name == "files":  # nothing to rebuild it from
                with pytest.raises(ValueError) as refused:
                    _prepare(source, cache)
                message = str(refused.value)
                assert f"data cache entry {entry}: " in message and victim.name in message
                assert f"its source {source} is gone" in message and f"embbench data prepare SCENARIO --data-cache {cache}" in message
                return
            ds, said = _prepare(source, cache)
        finally:
            if source_gone:
                shutil.move(moved, source)  # copy2 kept its modification time: the same fingerprint
        assert f"note: data cache entry {entry}: " in said and victim.name in said and "rebuilding it" in said
        assert len(said.splitlines()) == 1, said
        for got, want in zip(_contents(ds), expected):
            np.testing.assert_array_equal(got, want)
        assert _prepare(source, cache)[1] == ""  # rebuilt once, then intact


def test_a_changed_hash_in_the_manifest_names_the_manifest_as_well_as_the_file(pristine, tmp_path):
    """The manifest has no checksum of its own: a flipped digit in a file's recorded hash cannot be
    told from a change to the file, so the note names both (hypothesis found it naming only the file)."""
    source, clean = pristine
    cache = tmp_path / "cache"
    shutil.copytree(clean, cache)
    manifest = next(cache.glob("files/*/manifest.json"))
    listed = json.loads(manifest.read_text())
    digest = listed["files"]["labels.npy"]["xxh3_128"]
    listed["files"]["labels.npy"]["xxh3_128"] = ("0" if digest[0] != "0" else "1") + digest[1:]
    manifest.write_text(json.dumps(listed))
    said = _prepare(source, cache)[1]
    assert "labels.npy does not match its content hash in manifest.json" in said and "rebuilding it" in said
    assert _prepare(source, cache)[1] == ""


def test_the_cheap_checks_of_a_large_entry_and_what_only_hashing_finds(pristine, tmp_path, monkeypatch):
    source, clean = pristine
    monkeypatch.setattr(data_cache, "FULL_CHECK_BYTES", 0)  # every entry counts as large
    cache = tmp_path / "cache"
    shutil.copytree(clean, cache)
    labels = next(cache.glob("files/*/labels.npy"))
    reference = np.load(labels)
    # Labels overwritten with 7: found by the value check that every open runs.
    written = np.load(labels, mmap_mode="r+")
    written[100:200] = 7
    written.flush()
    ds, said = _prepare(source, cache)
    assert "labels.npy: row 100 holds a label other than 0 or 1; rebuilding it" in said
    np.testing.assert_array_equal(np.asarray(ds.train[0].file.array("labels")), reference)
    # The lowest bit of 300 labels flipped: sizes, dtypes and values still pass; only the hash finds it,
    # which a large entry gets when asked (`data prepare`, `run --verify-data`).
    written = np.load(labels, mmap_mode="r+")
    written[:300] ^= 1
    written.flush()
    assert _prepare(source, cache)[1] == ""
    ds, said = _prepare(source, cache, verify=True)
    assert "labels.npy does not match its content hash" in said
    np.testing.assert_array_equal(np.asarray(ds.train[0].file.array("labels")), reference)
    # A remapped id outside its table: found by the value check of a verified open.
    ids = np.load(ds.train[0].ids_path, mmap_mode="r+")
    ids[5, 3] = ds.cardinalities[3]
    ids.flush()
    _, said = _prepare(source, cache, verify=True)
    assert f"ids-{ds.train[0].file.directory.name}.npy: row 5, table 3: a row outside the table" in said


def test_labels_changed_in_the_cache_never_reach_a_batch(tmp_path, monkeypatch):
    from embbench.data.sources import CACHE_ENV
    from embbench.scenario import parse_scenario
    from tests.conftest import tiny_scenario

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    source = write_fake_criteo(tmp_path / "train.txt", 4000, seed=1)
    raw = tiny_scenario(data={"source": "criteo_tsv", "path": str(source), "eval": 0.25, "embedding_dim": 8, "batch_size": 64})
    raw["data"] = {k: v for k, v in raw["data"].items() if k not in ("preset", "scale")}
    scenario, _ = parse_scenario(raw)
    first = scenario.data_source("cpu").batch(Stream.TRAIN, 0, 64).labels.clone()
    labels = np.load(next((tmp_path / "cache").glob("files/*/labels.npy")), mmap_mode="r+")
    labels[:3000] ^= 1  # the probe: AUC 0.38 instead of 0.56, recorded ok
    labels.flush()
    from embbench.data.sources import _dataset

    _dataset.cache_clear()  # a new process (a cell) opens the cache anew
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        again = scenario.data_source("cpu").batch(Stream.TRAIN, 0, 64).labels
    assert "labels.npy does not match its content hash" in said.getvalue()
    assert again.tolist() == first.tolist()


def test_temporary_folders_of_dead_processes_go_and_live_ones_stay(pristine, tmp_path):
    source, clean = pristine
    cache = tmp_path / "cache"
    shutil.copytree(clean, cache)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        entry = next(cache.glob("files/*")).name
        left = {  # as a killed `data prepare` leaves them (a 30 MB file leaves 178 MB)
            "dead": cache / "files" / f".{entry}.tmp-{dead.pid}-0123abcd",
            "dead_damaged": cache / "datasets" / f".x.damaged-{dead.pid}-0123abcd-{data_cache.HOST}",
            "live": cache / "files" / f".{entry}.tmp-{live.pid}-89abcdef",
            "other_host": cache / "files" / f".{entry}.tmp-{dead.pid}-89abcdef-another.host",
        }
        for path in left.values():
            path.mkdir()
            (path / "ids.npy").write_bytes(b"\0" * 1000)
        _prepare(source, cache)
        assert {name for name, path in left.items() if path.exists()} == {"live", "other_host"}
    finally:
        live.kill()
        live.wait()


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "embbench.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def _scenario_file(tmp_path: Path, source: Path) -> Path:
    raw = {"name": "tsv", "data": {"source": "criteo_tsv", "path": str(source), "eval": 0.25, "embedding_dim": 8,
                                   "batch_size": 64},
           "model": {"bottom_mlp": [16, 8], "top_mlp": [16, 1]},
           "run": {"device": "cpu", "warmup_steps": 1, "steps": 5, "repeats": 2, "eval_batches": 2},
           "baseline": "device", "strategies": [{"name": "device"}]}
    path = tmp_path / "tsv.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _stamps(cache: Path) -> dict:
    return {str(p.relative_to(cache)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.rglob("*")}


@pytest.mark.slow
def test_data_prepare_fills_the_cache_a_run_with_other_steps_reads(tmp_path):
    source = write_fake_criteo(tmp_path / "train.txt", 2700, seed=3)  # 31 batches of 64 to train on
    scenario = _scenario_file(tmp_path, source)
    prepared = _cli(tmp_path, "data", "prepare", str(scenario))
    assert prepared.returncode == 0, prepared.stderr
    cache = tmp_path / "results" / "data-cache"
    before = _stamps(cache)
    assert any(name.endswith("manifest.json") for name in before)
    proc = _cli(tmp_path, "run", str(scenario), "--steps", "3", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert _stamps(cache) == before  # nothing parsed or built again, nothing added
    assert not list((tmp_path / "results").glob("runs/*/data-cache"))


@pytest.mark.slow
def test_a_damaged_entry_without_its_source_stops_the_run_naming_it(tmp_path):
    source = write_fake_criteo(tmp_path / "train.txt", 2700, seed=3)  # 31 batches of 64 to train on
    scenario = _scenario_file(tmp_path, source)
    cache = tmp_path / "cache"
    assert _cli(tmp_path, "data", "prepare", str(scenario), "--data-cache", str(cache)).returncode == 0
    source.unlink()
    labels = next(cache.glob("files/*/labels.npy"))
    os.truncate(labels, 2000)  # the probe: `ValueError: mmap length is greater than file size`, exit 0
    proc = _cli(tmp_path, "run", str(scenario), "--data-cache", str(cache), "--out", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert (f"error: data cache entry {labels.parent}: labels.npy is 2,000 bytes, manifest.json says" in proc.stderr
            and f"run `{sys.executable} -m embbench.cli data prepare {scenario} --data-cache {cache}`" in proc.stderr), \
        proc.stderr  # the command as it can be pasted: the program as this test started it
    assert not list((tmp_path / "run").glob("*.json")), "no cell ran"


def test_a_changed_source_replaces_its_entries_instead_of_adding_more(tmp_path):
    source = write_fake_criteo(tmp_path / "train.txt", 600, seed=1)
    cache = tmp_path / "cache"
    _prepare(source, cache)
    write_fake_criteo(source, 700, seed=2)  # the file is replaced by another (gigabytes of stale cache otherwise)
    ds, said = _prepare(source, cache)
    assert f"{source} changed since it was parsed" in said and "meta.json: built from other versions of its input files" in said
    assert ds.rows(Stream.TRAIN) + ds.rows(Stream.EVAL) == 700
    assert len(list(cache.glob("files/*"))) == 1 and len(list(cache.glob("datasets/*"))) == 1


@pytest.mark.parametrize("written", ['"=', '"|'])
def test_a_manifest_dtype_changed_to_an_equal_or_unknown_spelling_is_a_changed_manifest(pristine, tmp_path, written):
    """A bit flip can turn "<i8" into "=i8" (the same dtype on this machine) or into a string
    numpy cannot read: the manifest's text was changed, so the entry is rebuilt, named."""
    source, clean = pristine
    cache = tmp_path / "cache"
    shutil.copytree(clean, cache)
    manifest = next(p for p in _entry_files(cache) if p.name == "manifest.json" and '"dtype": "<' in p.read_text())
    manifest.write_text(manifest.read_text().replace('"dtype": "<', '"dtype": ' + written, 1))
    ds, said = _prepare(source, cache)
    assert f"note: data cache entry {manifest.parent}: " in said and "rebuilding it" in said, said
    assert _prepare(source, cache)[1] == ""


def test_a_file_name_changed_in_the_manifest_names_the_manifest(pristine, tmp_path):
    source, clean = pristine
    cache = tmp_path / "cache"
    shutil.copytree(clean, cache)
    manifest = next(p for p in _entry_files(cache) if p.name == "manifest.json" and '"meta.json"' in p.read_text())
    manifest.write_text(manifest.read_text().replace('"meta.json"', '"meta.jsoo"', 1))
    ds, said = _prepare(source, cache)
    assert f"note: data cache entry {manifest.parent}: " in said and "manifest.json" in said and "rebuilding it" in said, said


# --- the machinery on its own (embbench/data/cache.py): any content, not only Criteo's ---------


def _plain_entry(final: Path, built: list, fill_error: Exception | None = None) -> dict:
    """An entry of one array and its meta through :func:`embbench.data.cache.cache_entry`."""

    def fill(tmp: Path) -> None:
        built.append(tmp.name)
        np.save(tmp / "values.npy", np.arange(10, dtype=np.int32))
        if fill_error is not None:
            raise fill_error
        (tmp / "meta.json").write_text('{"rows": 10}')

    def check(directory: Path, full: bool) -> dict:
        return data_cache.check_entry(directory, lambda meta: {"values.npy": (np.int32, (meta["rows"],))},
                                      lambda directory, meta, full: None, full)

    return data_cache.cache_entry(final, fill, check, verify=True)


def test_an_entry_of_any_content_is_built_once_checked_at_each_open_and_rebuilt_when_damaged(tmp_path, capsys):
    final, built = tmp_path / "entries" / "plain", []
    assert _plain_entry(final, built) == {"rows": 10} and len(built) == 1
    assert sorted(p.name for p in final.iterdir()) == [data_cache.MANIFEST, "meta.json", "values.npy"]
    assert _plain_entry(final, built) == {"rows": 10} and len(built) == 1  # opened, checked, not built again
    raw = bytearray((final / "values.npy").read_bytes())
    raw[-1] ^= 1  # one bit of the data, the size unchanged: only the content hash sees it
    (final / "values.npy").write_bytes(bytes(raw))
    assert _plain_entry(final, built) == {"rows": 10} and len(built) == 2
    assert f"note: data cache entry {final}: values.npy does not match its content hash" in capsys.readouterr().err
    assert np.load(final / "values.npy").tolist() == list(range(10))
    assert sorted(p.name for p in final.parent.iterdir()) == ["plain"]  # no work folder left behind


def test_a_build_that_fails_leaves_neither_an_entry_nor_its_work_folder(tmp_path):
    final, built = tmp_path / "entries" / "plain", []
    with pytest.raises(RuntimeError, match="stopped"):
        _plain_entry(final, built, RuntimeError("stopped"))
    assert built and built[0].startswith(".plain.tmp-")  # it was built in a work folder beside the entry
    assert list(final.parent.iterdir()) == []

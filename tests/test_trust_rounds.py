"""The trust rounds (issues 26 and 28): a hostile user's probes of traces, run directories,
flags, the environment, user text on the terminal, printed commands and output files. Each
ends in a one-line message naming what is wrong (exit 2), or in the output the user meant.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from embbench.cli import main
from embbench.data.synthetic import Stream, SyntheticCriteo
from embbench.data.presets import make_tables
from embbench.data.trace import record_trace
from tests.conftest import tiny_scenario

ROOT = Path(__file__).resolve().parents[1]


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_clean_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _write(tmp_path: Path, raw: dict, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


# --- damaged and fractional traces (issue 26) --------------------------------------------------


@pytest.fixture
def trace(tmp_path) -> Path:
    tables = make_tables("criteo_kaggle", 8, scale=1e-5)
    out = tmp_path / "t.npz"
    record_trace(SyntheticCriteo(tables, 7), [t.num_rows for t in tables], 64, 13, 2, out)
    return out


def _trace_scenario(tmp_path: Path, trace: Path) -> Path:
    raw = tiny_scenario(data={"source": "trace", "path": str(trace), "embedding_dim": 8, "batch_size": 64})
    raw["data"] = {k: v for k, v in raw["data"].items() if k not in ("preset", "scale")}
    return _write(tmp_path, raw)


@pytest.mark.parametrize("damage, expected", [
    (lambda data: data[: len(data) // 2], "truncated or damaged .npz trace"),
    (lambda data: data[:-30], "truncated or damaged .npz trace"),
    (lambda data: b"", "an empty file (0 bytes), not an .npz trace"),
], ids=["half", "tail-cut", "empty"])
def test_a_damaged_trace_is_named_by_data_check_and_run(tmp_path, capsys, trace, damage, expected):
    trace.write_bytes(damage(trace.read_bytes()))
    code, _, err = _cli(capsys, "data", "check", trace)
    assert code == 2 and _one_clean_line(err).startswith(f"error: {trace}: {expected}")
    code, _, err = _cli(capsys, "run", _trace_scenario(tmp_path, trace), "--out", tmp_path / "run")
    assert code == 2 and _one_clean_line(err).startswith(f"error: {trace}: {expected}")


def _with_values(trace: Path, values: np.ndarray) -> None:
    arrays = dict(np.load(trace))
    arrays["train_values"] = values
    np.savez(trace, **arrays)


def test_fractional_ids_are_refused_naming_the_array_and_the_element(tmp_path, capsys, trace):
    values = np.load(trace)["train_values"].astype(np.float64)
    values[3] = 3.5
    _with_values(trace, values)
    code, _, err = _cli(capsys, "data", "check", trace)
    assert code == 2 and _one_clean_line(err) == (
        f"error: {trace}: train_values[3] = 3.5 is not an integer (train_values must hold integers, not float64)")
    code, _, err = _cli(capsys, "run", _trace_scenario(tmp_path, trace), "--out", tmp_path / "run")
    assert code == 2 and "train_values[3] = 3.5 is not an integer" in _one_clean_line(err)


def test_integral_float_ids_are_converted_and_said_so(tmp_path, capsys, trace):
    ids = np.load(trace)["train_values"]
    _with_values(trace, ids.astype(np.float32))
    code, out, err = _cli(capsys, "data", "check", trace)
    assert code == 0 and "a valid trace" in out
    assert _one_clean_line(err) == f"note: {trace}: train_values is float32 holding only integers; converted to int64"
    from embbench.data.trace import Trace

    assert np.array_equal(Trace(trace).streams[Stream.TRAIN]["values"], ids)

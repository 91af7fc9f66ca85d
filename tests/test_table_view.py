"""Tables that fit the terminal: run, show and compare keep the headline columns, add others by
priority as the width allows, name the ones left out; --columns picks, --wide shows all."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from record_factory import make_record, write_run
from rich.console import Console

from conftest import tiny_scenario
from embbench import cli
from embbench.compare import compare_records
from embbench.report import COMPARE_COLUMNS, DELTA_COLUMNS, RESULT_COLUMNS, SHOW_COLUMNS, print_comparison, print_deltas
from embbench.table_view import View

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

#: The first line of each results column's header, as the table prints it; those the cells below
#: fill (not "vs HBM": device is the fastest all-in-HBM cell and the baseline, tests/test_all_in_hbm.py).
HEADER = {c.key: c.header.splitlines()[0] for c in RESULT_COLUMNS if c.key != "speedup_hbm"}
HEADLINE = ["cell", "status", "throughput", "step_time", "speedup"]


def _seed_like() -> list:
    """Cells as seed_systems.yaml has them: long ids, caches with bounds, traffic, bookkeeping,
    a reordering strategy: every column of the table filled by some cell."""
    per_step = {"bytes_h2d": 3 * MiB, "bytes_d2h": MiB, "bytes_comm": 2 * MiB, "host_syncs": 10, "host_plan_us": 798}
    busy = dict(ops_per_step=220, host_syncs_per_step=18.5, max_weight_diff_vs_baseline=2.4e-7, cpu_seconds_per_step=0.011)
    sfctr = make_record("sfctr", {"hot_fraction": 0.01, "refresh_every": 100}, step_times=[0.007] * 12, **busy)
    return [
        make_record("device", step_times=[0.006] * 12, ops_per_step=139, host_syncs_per_step=1.5,
                    max_weight_diff_vs_baseline=0.0),
        make_record("colossalai", {"cache_ratio": 0.05, "optimizer_state": "slot"}, step_times=[0.0075] * 12,
                    hit_rate=0.952, host_bytes=2 * MiB, **busy),
        make_record("freqcache", {"cache_ratio": 0.01, "policy": "lfu"}, step_times=[0.0069] * 12, hit_rate=0.907,
                    unique_hit_rate=0.24, extra={"belady_hit_rate": 0.908, "belady_unique_hit_rate": 0.25},
                    counters={"total": {}, "per_step": per_step, "hit_rate": 0.907, "unique_hit_rate": 0.24},
                    instruments=[{"name": "belady_stream", "what": "ids", "steps": [20, 30], "timed": False,
                                  "cost_s_per_step": 1e-4, "cost_share": 0.015}], **busy),
        sfctr.model_copy(update={"semantics": "reordered"}),
        make_record("uvm", status="unsupported", message="needs CUDA"),
    ]


def _printed(width: int, records: list, **view) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    print_comparison(records, console, title="seed_systems", view=View(**view))
    return console.export_text()


def _header(text: str) -> str:
    """The table's header rows (above the ┡ rule)."""
    return text.split("┡")[0]


def _footer(text: str) -> list[str] | None:
    """The names the footer says are hidden (None: no footer)."""
    if "hidden: " not in text:
        return None
    words = " ".join(text.split("hidden: ", 1)[1].split())  # the footer may wrap
    return [n.strip() for n in words.split(" — ")[0].split(",")]


@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_table_fits_the_width_keeps_the_headline_and_names_exactly_the_hidden_columns(width):
    text = _printed(width, _seed_like())
    assert max(map(len, text.splitlines())) <= width
    header = _header(text)
    for key in HEADLINE:
        assert HEADER[key] in header, (key, text)
    hidden = _footer(text)
    absent = [key for key in HEADER if HEADER[key] not in header]
    assert hidden == absent and hidden  # every column is filled: at these widths some are left out
    if width == 200:  # the first by priority after the headline
        assert "device_bytes" not in hidden and "hit_rate" not in hidden


def _cell_ids(text: str) -> list[str]:
    """The first column, a row's lines joined (a long id folds onto several)."""
    ids: list[str] = []
    for line in text.splitlines():
        if line.startswith("│"):
            _, cell, status, *_ = line.split("│")
            if status.strip():
                ids.append("")
            ids[-1] += cell.strip()
    return ids


def test_long_cell_ids_fold_whole_when_that_makes_room_for_the_next_column():
    records = _seed_like()
    text = _printed(120, records)  # the ids run to 50 characters: unfolded, no memory column would fit
    assert HEADER["device_bytes"] in _header(text)
    assert _cell_ids(text) == [r.cell_id for r in sorted(records, key=lambda r: r.strategy != "device")]
    assert max(map(len, text.splitlines())) <= 120


@pytest.mark.parametrize("width", [120, 160])
def test_a_folded_cell_id_breaks_between_its_parts_never_mid_word(width):
    text = _printed(width, _seed_like())
    lines: list[list[str]] = []  # each row's identity, line by line
    for line in text.splitlines():
        if line.startswith("│"):
            _, cell, status, *_ = line.split("│")
            if status.strip():
                lines.append([])
            lines[-1].append(cell.strip())
    folded = [parts for parts in lines if len(parts) > 1]
    assert folded, text  # the long ids do fold at these widths
    for parts in folded:
        for before, after in zip(parts, parts[1:]):
            assert before.endswith((",", "[")) or after.startswith("@"), parts


def test_a_policy_and_its_min_are_counted_over_the_same_steps():
    """freqcache counts MIN over a window of the measured steps: the policy beside it is its
    count over that window, not over every step (which let 25.0% "beat" a 24.9% bound)."""
    extra = {"belady_hit_rate": 0.95, "belady_unique_hit_rate": 0.249, "window_hit_rate": 0.93,
             "window_unique_hit_rate": 0.22}
    cache = make_record("freqcache", {"cache_ratio": 0.01}, hit_rate=0.96, unique_hit_rate=0.25, extra=extra,
                        counters={"total": {}, "per_step": {}, "hit_rate": 0.96, "unique_hit_rate": 0.25})
    text = _printed(200, [make_record("device"), cache], columns=("hit_rate",))
    assert "93.0% (95.0%)" in text and "uniq 22.0% (24.9%)" in text and "25.0%" not in text


def test_the_wider_the_terminal_the_fewer_columns_hidden():
    hidden = [len(_footer(_printed(width, _seed_like()))) for width in (80, 120, 200)]
    assert hidden[0] > hidden[1] > hidden[2]
    assert _footer(_printed(400, _seed_like())) is None  # all fit: no footer


def test_columns_no_cell_fills_are_left_out_and_not_called_hidden():
    records = [make_record("device"), make_record("cpu", step_times=[0.03] * 12)]  # no cache, no traffic
    for width in (80, 200):
        text = _printed(width, records)
        assert "hit rate" not in text and "H2D" not in text and "comm" not in _header(text)
        assert not {"hit_rate", "h2d_d2h", "comm", "bookkeeping", "order"} & set(_footer(text) or [])


def test_the_caption_explains_only_the_columns_shown():
    narrow, wide = _printed(80, _seed_like()), _printed(80, _seed_like(), wide=True)
    assert "Belady" not in narrow and "speedup against device" in " ".join(narrow.split())
    assert "Belady" in wide


def test_wide_shows_every_filled_column_at_its_natural_width():
    text = _printed(80, _seed_like(), wide=True)
    header = _header(text)
    assert all(HEADER[key] in header for key in HEADER) and _footer(text) is None
    assert max(map(len, text.splitlines())) > 80  # no cell squeezed into a wrapped block


def test_columns_picks_the_columns_after_the_cell_id_in_the_order_given():
    text = _printed(80, _seed_like(), columns=("auc", "speedup"))
    header = _header(text)
    assert "cell" in header and header.index("AUC") < header.index("speedup")
    assert "samples/s" not in header and "status" not in header and _footer(text) is None


def _cli(capsys, monkeypatch, width: int, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setattr(cli.console, "width", width)
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse refuses a flag
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_show_fits_the_console_and_takes_columns_and_wide(tmp_path, capsys, monkeypatch):
    run = str(write_run(tmp_path / "run", _seed_like()))
    code, out, _ = _cli(capsys, monkeypatch, 100, "show", run)
    assert code == 0 and max(map(len, out.splitlines())) <= 100 and _footer(out)
    code, out, _ = _cli(capsys, monkeypatch, 100, "show", run, "--columns", "hit_rate,auc")
    assert code == 0 and "hit rate" in _header(out) and "samples/s" not in out and _footer(out) is None
    code, out, _ = _cli(capsys, monkeypatch, 100, "show", run, "--wide")
    assert code == 0 and "bookkeeping" in _header(out) and _footer(out) is None


@pytest.mark.parametrize("command", ["show", "compare", "run"])
def test_an_unknown_column_is_exit_2_listing_the_valid_names(tmp_path, capsys, monkeypatch, command):
    run = str(write_run(tmp_path / "run", [make_record("device")]))
    argv = {"show": ["show", run], "compare": ["compare", run, run], "run": ["run", "scenarios/smoke.yaml"]}[command]
    code, out, err = _cli(capsys, monkeypatch, 100, *argv, "--columns", "auc,thruput")
    valid = COMPARE_COLUMNS if command == "compare" else SHOW_COLUMNS  # the results' (or deltas') and the tiers' tables
    assert code == 2 and out == ""
    names = dict.fromkeys(c.key for c in valid)
    assert "--columns: unknown column 'thruput'; valid: " + ", ".join(names) in " ".join(err.split())


def test_columns_and_wide_are_not_for_the_csv_or_json_export(tmp_path, capsys, monkeypatch):
    run = str(write_run(tmp_path / "run", [make_record("device")]))
    code, _, err = _cli(capsys, monkeypatch, 100, "show", run, "--csv", "--wide")
    assert code == 2 and "not allowed with argument" in err


def _compared(width: int, **view) -> str:
    before = _seed_like()
    def slower(r):
        step = r.metrics["step_time_s"]
        return r.model_copy(update={"metrics": {**r.metrics, "step_time_s": {**step, "median": step["median"] * 1.1}}})

    after = [slower(r) if r.metrics else r for r in before]
    console = Console(width=width, record=True, file=io.StringIO())
    print_deltas(compare_records(before, after), "A", "B", "a test", console, View(**view))
    return console.export_text()


@pytest.mark.parametrize("width", [80, 120])
def test_compare_fits_the_width_and_names_the_hidden_columns(width):
    text = _compared(width)
    assert max(map(len, text.splitlines())) <= width
    header = _header(text)
    for label in ("cell", "status", "samples/s", "step time", "significant"):
        assert label in header
    labels = {c.key: c.header.split(" (")[0] for c in DELTA_COLUMNS}
    hidden = _footer(text) or []
    assert all(labels[key] not in header for key in hidden)
    assert all(labels[key] in header for key in labels if key not in hidden)
    assert _footer(_compared(width, wide=True)) is None


@pytest.mark.slow
def test_run_prints_a_table_that_fits_columns_and_a_footer(tmp_path):
    """The newcomer's first command, its output piped: COLUMNS is honoured."""
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(tiny_scenario(strategies=[{"name": "device"}])))
    command = [sys.executable, "-m", "embbench.cli", "run", str(scenario), "--steps", "3", "--out", str(tmp_path / "run")]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    assert max(map(len, proc.stdout.splitlines())) <= 80
    assert "samples/s" in proc.stdout and "speedup" in proc.stdout and _footer(proc.stdout)


def test_show_and_compare_name_each_quantity_alike():
    """``--columns`` takes the same name for a quantity in show and compare (and the CSV's)."""
    shown, compared = {c.key for c in SHOW_COLUMNS}, {c.key for c in COMPARE_COLUMNS}
    both = {"throughput", "step_time", "device_bytes", "host_bytes", "hit_rate", "auc", "logloss", "tier_hit_rate",
            "hit_rate_of_reaching", "stall_seconds_per_step", "bytes_read_per_step", "reads_per_second"}
    assert both <= shown and both <= compared

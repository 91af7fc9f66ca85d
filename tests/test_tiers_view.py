"""The memory tiers of a record (``metrics.tiers``) in ``show``, ``compare`` and the report."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest
from record_factory import cache_counters, file_store_counters, make_record, write_run

from embbench import cli
from embbench.compare import compare_records
from embbench.report import tier_grid

STEPS = 12  # make_record's timed steps
FILE = {"cache_ratio": 0.01, "store": "file", "dram_ratio": 0.5}
STORE = {"store": "file", "store_filesystem": "ext4", "store_direct": True, "store_reader": "native pread pool, 32 threads",
         "dram_blocks": 100, "store_blocks": 400}


def _records(pages_read: int = 900, stall_s: float = 0.03, dram_misses: int = 600) -> list:
    """A cell without tiers, one with host rows in memory, one with them in a file."""
    return [
        make_record("device"),
        make_record("freqcache", {"cache_ratio": 0.01}, tier_counters=cache_counters(6000, 1500, written_back=300)),
        make_record("freqcache", FILE, extra=STORE, tier_counters=file_store_counters(
            6000, 1500, dram_misses=dram_misses, pages_read=pages_read, pages_written=120, stall_s=stall_s, read_s=0.09)),
    ]


def _cli(capsys, monkeypatch, *argv: str, width: int = 250) -> str:
    monkeypatch.setattr(cli.console, "width", width)
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    """The first line of each row of the table under the heading ``memory tiers``, by (cell, tier)."""
    table = text.split("memory tiers", 1)[1].split("└")[0].split("┡")[1]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) > 2 and cells[0]:
            rows[(cells[0], cells[1])] = cells[2:]
    return rows


FILE_ID = "freqcache[cache_ratio=0.01,dram_ratio=0.5,store=file]@w1"
PICKED = ["tier_hit_rate", "hit_rate_of_reaching", "bytes_read_per_step", "bytes_written_per_step", "ios_per_step",
          "read_amplification", "stall_seconds_per_step", "reads_per_second"]


def test_show_has_a_row_per_cell_and_tier_with_the_record_s_figures(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", _records())
    out = _cli(capsys, monkeypatch, "show", str(run), "--columns", ",".join(PICKED))
    rows = _rows(out)
    assert list(rows) == [(FILE_ID, "hbm"), (FILE_ID, "dram"), (FILE_ID, "nvme"),  # the results table's order
                          ("freqcache[cache_ratio=0.01]@w1", "hbm"), ("freqcache[cache_ratio=0.01]@w1", "dram")]
    # 6000 distinct rows over 12 steps: 1500 missed the device, 600 of those host memory, read in 900 pages
    assert rows[(FILE_ID, "hbm")][:2] == ["75.0%", "75.0%"]
    assert rows[(FILE_ID, "dram")][:2] == ["15.0%", "60.0%"]
    # each row's traffic with the tier below it: the device read 1500 rows from host memory, host
    # memory read 900 pages from the drive (for 600 rows) and wrote 120; the drive's row is its own
    assert rows[(FILE_ID, "hbm")][2] == f"{1500 * 36 / STEPS / 1024:,.2f} KiB"
    assert rows[(FILE_ID, "dram")][2:4] == ["300.00 KiB", "40.00 KiB"]
    assert rows[(FILE_ID, "nvme")] == [
        "10.0%", "100.0%", "300.00 KiB",  # 900 pages of 4 KiB over 12 steps
        "40.00 KiB", "85.0",  # 120 pages written; (900 + 120) / 12 I/Os a step
        f"{900 * 4096 / (600 * 36):,.2f}x", "2.50 ms", "10,000"]  # 0.03 s stalled, 900 pages in 0.09 s
    # host rows in memory: host memory is the last tier and serves every row that reaches it
    assert rows[("freqcache[cache_ratio=0.01]@w1", "dram")][:2] == ["25.0%", "100.0%"]
    assert "device@w1" not in {cell for cell, _ in rows}
    assert "samples/s" not in out  # --columns named only the tiers' columns: the results table is not drawn
    assert "ext4 (O_DIRECT)" in " ".join(out.split())  # where the file was


def test_show_draws_only_the_tier_columns_some_cell_fills(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", _records()[:2])  # host rows in memory: no drive
    header = _cli(capsys, monkeypatch, "show", str(run), "--wide").split("memory tiers")[1].split("┡")[0]
    assert "rows hit" in header and "read" in header
    for drive_only in ("stall", "I/Os", "amplification", "reads/s"):
        assert drive_only not in header


def test_records_without_tiers_show_no_tier_table(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", [make_record("device"), make_record("freqcache", {"cache_ratio": 0.01}, hit_rate=0.9)])
    out = _cli(capsys, monkeypatch, "show", str(run), "--wide")
    assert "memory tiers" not in out and "hbm" not in out and out.count("┡") == 1  # the results table alone


def test_columns_picks_in_both_tables_and_each_draws_its_own(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", _records())
    out = _cli(capsys, monkeypatch, "show", str(run), "--columns", "auc,stall_seconds_per_step")
    results, tiers = out.split("memory tiers")
    assert "AUC" in results and "stall" not in results and "hit rate" not in results
    assert "stall" in tiers and "AUC" not in tiers and "tier" in tiers  # the tier tells its rows apart
    assert "memory tiers" not in _cli(capsys, monkeypatch, "show", str(run), "--columns", "auc")


@pytest.mark.parametrize("pages_read, stall_s, read, stall", [
    (12, 12 * 2e-6, "4.00 KiB", "2.00 µs"),
    (12 * 256, 0.03, "1.00 MiB", "2.50 ms"),
    (12 * 256 * 1024, 12 * 1.5, "1.00 GiB", "1.50 s"),
    (0, 0.0, "0 B", "0"),
])
def test_bytes_and_stalls_read_in_the_unit_that_fits(pages_read, stall_s, read, stall):
    grid = tier_grid(_records(pages_read=pages_read, stall_s=stall_s))
    nvme = next(row for row in grid.rows if row.cells["tier"] == "nvme")
    assert nvme.cells["bytes_read_per_step"].splitlines()[0] == read and nvme.cells["stall_seconds_per_step"] == stall
    assert nvme.sort["bytes_read_per_step"] == pages_read * 4096 / STEPS  # sorted by the number, not its text


def test_show_exports_every_tier_figure_as_a_column(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", _records())
    rows = {r["cell_id"]: r for r in json.loads(_cli(capsys, monkeypatch, "show", str(run), "--json"))}
    assert rows[FILE_ID]["tier.nvme.stall_seconds_per_step"] == pytest.approx(0.03 / STEPS)
    assert rows[FILE_ID]["tier.dram.hit_rate_of_reaching"] == pytest.approx(0.6)
    assert not any(k.startswith("tier.") for k in rows["device@w1"])
    table = list(csv.DictReader(io.StringIO(_cli(capsys, monkeypatch, "show", str(run), "--csv"))))
    by_id = {r["cell_id"]: r for r in table}
    assert float(by_id[FILE_ID]["tier.nvme.reads_per_second"]) == pytest.approx(10_000)
    assert by_id["device@w1"]["tier.hbm.hit_rate"] == ""


def _two_runs(tmp_path):
    a = write_run(tmp_path / "a", _records())
    b = write_run(tmp_path / "b", _records(pages_read=450, stall_s=0.06, dram_misses=300))
    return a, b


def test_compare_gives_each_tier_s_figures_in_both_runs_and_their_change(tmp_path, capsys, monkeypatch):
    a, b = _two_runs(tmp_path)
    data = json.loads(_cli(capsys, monkeypatch, "compare", str(a), str(b), "--json"))
    cells = {c["cell_id"]: c for c in data["runs"][0]["cells"]}
    nvme = cells[FILE_ID]["tier_deltas"]["nvme"]
    assert nvme["tier_hit_rate"] == {"before": pytest.approx(0.1), "after": pytest.approx(0.05),
                                     "relative": pytest.approx(-0.5), "direction": "worse"}
    assert nvme["stall_seconds_per_step"]["relative"] == pytest.approx(1.0)
    assert nvme["stall_seconds_per_step"]["direction"] == "worse"  # more waiting
    assert nvme["bytes_read_per_step"]["direction"] == "better"  # fewer pages read
    assert cells[FILE_ID]["tier_deltas"]["hbm"]["tier_hit_rate"]["direction"] == "same"
    assert list(cells["freqcache[cache_ratio=0.01]@w1"]["tier_deltas"]) == ["hbm", "dram"]
    assert cells["device@w1"]["tier_deltas"] == {}
    out = _cli(capsys, monkeypatch, "compare", str(a), str(b), "--columns", "tier_hit_rate,stall_seconds_per_step")
    rows = _rows(out)
    assert rows[(FILE_ID, "nvme")] == ["10.0% → 5.0%  -50.0%", "2.50 ms → 5.00 ms  +100.0%"]
    assert rows[(FILE_ID, "dram")][0] == "15.0% → 20.0%  +33.3%"
    text = " ".join(out.split())
    assert "counted" in text and "no significance" in text  # counts, not repeats: no test over them
    assert "significant" not in out.split("memory tiers")[1].split("└")[0]


def test_compare_draws_no_tier_table_where_no_cell_has_tiers(tmp_path, capsys, monkeypatch):
    a = write_run(tmp_path / "a", [make_record("device")])
    b = write_run(tmp_path / "b", [make_record("device")])
    assert "memory tiers" not in _cli(capsys, monkeypatch, "compare", str(a), str(b))
    assert compare_records([make_record("device")], [make_record("device")])[0].tier_deltas == {}


def test_the_report_has_a_tier_section_with_each_run_and_the_comparison(tmp_path):
    a, b = _two_runs(tmp_path)
    out = tmp_path / "report.html"
    assert cli.main(["report", str(a), str(b), "--out", str(out)]) == 0
    section = out.read_text().split("<h2>Memory tiers</h2>")[1].split("<h2>")[0]
    tables = re.findall(r'<table class="sortable"><caption>(.*?)</caption>(.*?)</table>', section, re.S)
    assert [caption for caption, _ in tables] == [f"{a}: memory tiers", f"{b}: memory tiers",
                                                  f"{b} against {a}: memory tiers"]
    rows = re.findall(r"<tr>(.*?)</tr>", tables[0][1].split("<tbody>")[1])
    assert len(rows) == 5 and 'data-sort="0.1"' in rows[2]  # the file store's nvme row: its hit rate
    assert "→" in tables[2][1] and "counted" in section


def test_a_report_without_tiers_has_no_tier_section(tmp_path):
    run = write_run(tmp_path / "a", [make_record("device")])
    out = tmp_path / "report.html"
    assert cli.main(["report", str(run), "--out", str(out)]) == 0
    assert "Memory tiers" not in out.read_text()


def test_a_tier_column_never_takes_the_name_of_another_quantity():
    """``--columns`` names one quantity each: the tiers' hit rate is not the device cache's per access."""
    from embbench.report import DELTA_COLUMNS, RESULT_COLUMNS, TIER_COLUMNS

    tiers = {c.key for c in TIER_COLUMNS}
    assert tiers & {c.key for c in RESULT_COLUMNS} == tiers & {c.key for c in DELTA_COLUMNS} == {"cell"}


def test_each_tier_row_shows_its_traffic_with_the_tier_below_and_old_records_read_the_same(tmp_path):
    """Issue 49, point 5: the dram row is host memory's traffic with the drive (rows it lacked,
    the pages read for them), not the device's traffic with host memory repeated; a record made
    before says the same when read."""
    new = _records()[2]
    grid = tier_grid([new])
    by_tier = {row.cells["tier"]: row for row in grid.rows}
    assert by_tier["hbm"].cells["bytes_read_per_step"] == f"{1500 * 36 / STEPS / 1024:,.2f} KiB\n125.0 rows"
    assert by_tier["dram"].cells["bytes_read_per_step"] == "300.00 KiB\n50.0 rows"  # 600 rows in 900 pages
    assert by_tier["dram"].cells["bytes_written_per_step"] == "40.00 KiB"
    old = new.model_copy(deep=True)
    dram = next(t for t in old.metrics["tiers"] if t["tier"] == "dram")
    dram.update(rows_read_per_step=1500 / STEPS, bytes_read_per_step=1500 * 36 / STEPS,
                rows_written_per_step=0.0, bytes_written_per_step=0.0)  # as records before issue 49 said it
    assert [r.cells for r in tier_grid([old]).rows] == [r.cells for r in grid.rows]


def test_the_two_hit_rates_on_one_screen_are_named_apart(tmp_path, capsys, monkeypatch):
    counted = make_record("freqcache", {"cache_ratio": 0.05}, hit_rate=0.9, tier_counters=cache_counters(6000, 900))
    run = write_run(tmp_path / "run", [*_records(), counted])
    results, tiers = _cli(capsys, monkeypatch, "show", str(run), "--wide").split("memory tiers")
    flat = lambda text: " ".join(text.split())  # noqa: E731 (headers wrap)
    assert "per access" in flat(results) and "rows hit" not in results
    assert "rows hit" in tiers and "per access" not in flat(tiers.split("┡")[0])

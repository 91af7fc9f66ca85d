"""report: one self-contained HTML file with the tables and plots, rendered by a real browser."""

from __future__ import annotations

import io
import os
import re
import shutil

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from record_factory import make_record, write_run

from embbench.cli import main
from embbench.columns import speed
from embbench.compare import Run
from embbench.html_report import pareto_front, strategy_colours

MiB = 1 << 20


def _per_rank(ranks: int) -> list[dict]:
    return [{"rank": r, "memory": {"static_device_bytes": (r + 1) * MiB, "static_host_bytes": 2 * MiB, "pinned_bytes": 0},
             "counters": {"bytes_comm": 1000 * (r + 1)}, "extra": {}, "hit_rate": 0.5 + 0.1 * r, "unique_hit_rate": None}
            for r in range(ranks)]


def _records(seconds: float = 0.01) -> list:
    profile = {"trace": "device@w1.trace.json", "steps": 3,
               "top_host": [{"op": "aten::mm", "calls": 7.0, "self_cpu_us": 1234.5, "self_device_us": 0.0}], "top_device": []}
    return [
        make_record("device", step_times=[seconds] * 12, device_bytes=64 * MiB, profile=profile),
        make_record("cpu", step_times=[3 * seconds] * 12, device_bytes=0, host_bytes=64 * MiB),
        *[make_record("freqcache", {"cache_ratio": ratio}, step_times=[seconds * (2 - ratio)] * 12, device_bytes=int(ratio * 64 * MiB),
                      hit_rate=0.8 + ratio / 10, unique_hit_rate=0.3 + ratio / 10,
                      extra={"belady_hit_rate": 0.85 + ratio / 10, "belady_unique_hit_rate": 0.4 + ratio / 10, "capacity_rows": 10})
          for ratio in (0.01, 0.1, 0.5)],
        make_record("device", world_size=2, step_times=[seconds / 2] * 12, device_bytes=32 * MiB, per_rank=_per_rank(2)),
        make_record("uvm", status="unsupported", message="needs CUDA"),
    ]


@pytest.fixture
def report(tmp_path):
    a = write_run(tmp_path / "a", _records())
    b = write_run(tmp_path / "b", _records(0.012))
    out = tmp_path / "report.html"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_the_report_is_one_self_contained_file_with_tables_and_plots(report):
    text = report.read_text()
    # nothing fetched from elsewhere: every image is inline, the one script too, no sheet
    assert not re.search(r"(src|href)=\"(?!data:)", text) and not re.search(r"<script[^>]*src", text)
    assert text.count("<script>") == 1
    images = re.findall(r'<img alt="" src="data:image/png;base64,[A-Za-z0-9+/=]+">', text)
    # throughput/memory per run (2), hit rates (1), step times (1), per-rank bars of the 2-rank cell per run (2)
    assert len(images) == 6
    for heading in ("Results", "Comparison against", "Throughput against device memory", "Hit rate against Belady",
                    "Step times", "Per rank", "Top operators"):
        assert heading in text
    assert "freqcache[cache_ratio=0.1]@w1" in text and "Welch" in text and "aten::mm" in text


def test_a_report_without_caches_or_ranks_leaves_their_sections_out(tmp_path):
    run = write_run(tmp_path / "a", [make_record("device")])
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.count("<img") == 2  # throughput/memory, step times
    assert "Per rank" not in text and "Hit rate against" not in text and "Comparison against" not in text
    assert "Throughput against device memory" in text and "Step times" in text


def _tables(text: str) -> list[str]:
    return re.findall(r'<table class="sortable">.*?</table>', text, re.S)


@pytest.mark.slow
def test_the_results_are_html_tables_with_a_row_per_cell_and_sort_values(report):
    text = report.read_text()
    assert '<pre class="rich">' not in text.split("<h2>Top operators")[0]  # only the profiles stay rich text
    results, _, comparison = _tables(text)  # a table per run, then B against A
    headers = re.findall(r"<th [^>]*>(.*?)</th>", results)
    assert headers[:5] == ["cell", "status", "samples/s<br>(95% interval)", "step ms<br>repeats / p95", "speedup"]
    rows = re.findall(r"<tr>(.*?)</tr>", results.split("<tbody>")[1])
    assert len(rows) == len(_records())
    cells = re.findall(r'<td class="\w+"(?: data-sort="([^"]*)")?>(.*?)</td>', rows[0])
    assert cells[0] == ("device@w1", "device@w1") and len(cells) == len(headers)
    # the sort value is the number, not its rounded text with separators and a spread
    sort, shown = cells[2]
    assert float(sort) == pytest.approx(512 / 0.01) and shown.startswith("51,200")
    assert "uvm@w1" in results and "unsupported" in results
    assert "samples/s" in comparison and "significant" in comparison


#: Headless Chromium as root on a machine with no network (see .ci/run).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1200,2400"]


def _browser_missing() -> str | None:
    """Why the report cannot be opened in a browser here, or None."""
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    if missing:
        return f"no {' or '.join(missing)} on PATH (as root: apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (scripts/setup_env.sh installs the test extra)"
    return None


@pytest.fixture
def browser(tmp_path):
    """Chromium driven by chromedriver (selenium). Without one the test is skipped, except where
    EMBBENCH_REQUIRE_BROWSER=1 (CI: .ci/run installs the browser): there it fails."""
    missing = _browser_missing()
    if missing:
        if os.environ.get("EMBBENCH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"EMBBENCH_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _first_column(driver, table) -> list[str]:
    return driver.execute_script("return [...arguments[0].tBodies[0].rows].map(r => r.cells[0].textContent)", table)


def test_the_report_in_a_browser_shows_every_plot_and_a_table_that_sorts(report, browser):
    from PIL import Image
    from selenium.webdriver.common.by import By

    browser.get(report.resolve().as_uri())
    # every plot decoded and laid out with a size
    images = browser.execute_script("return [...document.images].map(i => [i.complete, i.naturalWidth, i.naturalHeight, "
                                    "i.getBoundingClientRect().width, i.getBoundingClientRect().height])")
    assert len(images) == 6 and all(done and all(size > 0 for size in sizes) for done, *sizes in images), images
    # the first run's results: a row per cell, shown
    table = browser.find_elements(By.CSS_SELECTOR, "table.sortable")[0]
    assert table.is_displayed() and table.size["width"] > 0 and table.size["height"] > 0
    records = _records()
    measured = sorted((r for r in records if r.metrics), key=lambda r: speed(r.metrics).throughput)
    by_rate = [r.cell_id for r in measured]
    assert sorted(_first_column(browser, table)) == sorted(r.cell_id for r in records)
    # a click on a header sorts by it, a second reverses; cells without a number stay last
    header = next(th for th in table.find_elements(By.TAG_NAME, "th") if th.text.startswith("samples/s"))
    header.click()
    assert _first_column(browser, table) == by_rate + ["uvm@w1"]
    header.click()
    assert _first_column(browser, table) == by_rate[::-1] + ["uvm@w1"]
    # no error on the page's console (a script that threw, an image that did not load)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    # and what a person sees is a page of text, tables and plots, not a blank one
    pixels = np.asarray(Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")).reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 50
    assert 0.01 < (pixels < 250).any(axis=1).mean() < 0.9


@pytest.mark.parametrize("where, message", [("missing/report.html", "no such directory"), (".", "is a directory"),
                                            ("x" * 300 + ".html", "File name too long")])
def test_an_unwritable_out_is_one_line_and_exit_2(tmp_path, capsys, where, message):
    run = write_run(tmp_path / "a", [make_record("device")])
    assert main(["report", str(run), "--out", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_read_only_out_is_one_line_and_exit_2(tmp_path, capsys):
    import os

    run = write_run(tmp_path / "a", [make_record("device")])
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root): a read-only directory does not stop it")
        assert main(["report", str(run), "--out", str(locked / "r.html")]) == 2
        assert "not writable" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)


def test_the_same_run_twice_is_refused(tmp_path, capsys):
    run = write_run(tmp_path / "a", [make_record("device")])
    assert main(["report", str(run), str(run), "--out", str(tmp_path / "r.html")]) == 2
    assert "given twice" in capsys.readouterr().err


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=30))
def test_the_pareto_front_is_exactly_the_undominated_points(points):
    front = pareto_front(points)

    def dominates(p, q):
        return p[0] <= q[0] and p[1] >= q[1] and p != q

    for i, p in enumerate(points):
        beaten = any(dominates(q, p) for q in points)
        assert (i in front) == (not beaten)
    assert [points[i][0] for i in front] == sorted(points[i][0] for i in front)


def test_a_strategy_has_one_colour_in_every_run_of_a_report(tmp_path):
    full = Run(tmp_path / "a", [make_record("device"), make_record("cpu"), make_record("freqcache", {"cache_ratio": 0.1})])
    fewer = Run(tmp_path / "b", [make_record("device"), make_record("freqcache", {"cache_ratio": 0.1})])
    colours = strategy_colours([full, fewer])
    assert set(colours) == {"device", "cpu", "freqcache"} and len(set(colours.values())) == 3
    assert strategy_colours([fewer, full]) == colours


def test_a_cache_curve_beside_the_run_is_a_plot_with_the_measured_cells(tmp_path):
    from embbench.cache.curve import measure
    from embbench.html_report import plot_cache_curve

    run = write_run(tmp_path / "a", _records())
    rng = np.random.default_rng(0)
    steps = [rng.zipf(1.3, 200) % 500 for _ in range(12)]
    curve = measure(steps, {"t0": 500}, (0.01, 0.1, 0.5), ("lru", "freqcache", "min"), skip=2)  # freqcache: the cells only
    (run / "curve.json").write_text(__import__("json").dumps(curve))
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--out", str(out)]) == 0
    text = out.read_text()
    assert "Cache curve (embbench curve)" in text and text.count("<img") == 5  # the 4 plots of one run, and the curve
    assert plot_cache_curve(Run(tmp_path / "none", _records())) is None  # no curve file: no plot


# --- the plots, read from their artists (issue 41, item 7) --------------------------------------------

BUSY = {"noise": {"others_cpu_share": 0.6, "steal_share": 0.0, "cores": 2}}


def _repeats(ms: float, spread: float) -> list[float]:
    """12 steps in 3 repeats whose medians are ``ms`` times 1 - spread, 1 and 1 + spread."""
    return [ms / 1e3 * f for f in (1 - spread, 1, 1 + spread) for _ in range(4)]


def _crowd() -> list:
    """A smoke-like run: a dozen cells, most within a few MiB and a few percent of each other
    (their labels would pile up), the step times 200x apart, one cell timed on a busy machine."""
    return [
        make_record("device", step_times=_repeats(10, 0.02), device_bytes=3 * MiB),
        make_record("cpu", step_times=_repeats(2000, 0.05), device_bytes=0, host_bytes=3 * MiB, **BUSY),
        make_record("uvm", step_times=_repeats(11, 0.02), device_bytes=0),
        *[make_record("freqcache", {"cache_ratio": r, "policy": p}, step_times=_repeats(10.5 + r, 0.03),
                      device_bytes=int((2.7 + r) * MiB), hit_rate=0.5 + r, unique_hit_rate=0.3 + r,
                      extra={"belady_hit_rate": 0.6 + r, "belady_unique_hit_rate": 0.4 + r})
          for r in (0.01, 0.05) for p in ("lfu", "lru")],
        *[make_record("colossalai", {"cache_ratio": r, "optimizer_state": s}, step_times=_repeats(10.8, 0.04),
                      device_bytes=int((2.8 + r) * MiB), hit_rate=0.45 + r, extra={"belady_hit_rate": 0.6 + r})
          for r in (0.01, 0.05) for s in ("row", "slot")],
        *[make_record("uvm_cache", {"algorithm": a, "cache_ratio": r}, step_times=_repeats(12, 0.02),
                      device_bytes=int((2.75 + r) * MiB), hit_rate=0.4 + r, unique_hit_rate=0.3 + r)
          for a in ("lru", "lfu") for r in (0.01, 0.05)],
    ]


def _annotations(ax) -> list:
    from matplotlib.text import Annotation

    return [t for t in ax.texts if isinstance(t, Annotation)]


def test_the_pareto_plot_has_the_repeat_intervals_a_log_axis_and_marks_busy_cells(tmp_path):
    from matplotlib.container import ErrorbarContainer

    from embbench.columns import flat_row
    from embbench.html_report import pareto_figure

    records = _crowd()
    run = Run(tmp_path, records)
    fig = pareto_figure(run, strategy_colours([run]))
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    bars = {}
    for container in ax.containers:
        assert isinstance(container, ErrorbarContainer)
        (segment,) = container.lines[2][0].get_segments()
        bars[round(segment[0][0], 6)] = bars.get(round(segment[0][0], 6), []) + [(segment[0][1], segment[1][1])]
    for row in map(flat_row, records):  # each cell's bar spans its 95% interval over repeats
        assert (pytest.approx(row["throughput_ci95_low"]), pytest.approx(row["throughput_ci95_high"])) \
            in bars[round(row["device_bytes"] / MiB, 6)]
    labels = {a.get_text() for a in _annotations(ax)}
    assert labels == {r.cell_id + (" busy!" if r.strategy == "cpu" else "") for r in records}
    busy = [c for c in ax.containers if c.lines[0].get_marker() == "X"]
    assert len(busy) == 1 and busy[0].lines[0].get_xdata()[0] == 0 and busy[0].lines[0].get_ydata()[0] < 300
    assert "busy!: timed on a busy machine" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_point_labels_do_not_overlap_and_stay_inside_the_plot(tmp_path):
    from embbench.html_report import pareto_figure
    from embbench.plot_labels import text_extent

    run = Run(tmp_path, _crowd())
    fig = pareto_figure(run, strategy_colours([run]))
    ax = fig.axes[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [text_extent(a, renderer) for a in _annotations(ax)]
    frame = ax.get_window_extent(renderer)
    assert len(boxes) == len(run.records)
    for i, a in enumerate(boxes):
        assert frame.x0 <= a.x0 and a.x1 <= frame.x1 and frame.y0 <= a.y0 and a.y1 <= frame.y1
        for b in boxes[:i]:
            assert min(a.x1, b.x1) <= max(a.x0, b.x0) or min(a.y1, b.y1) <= max(a.y0, b.y0), (a, b)


def test_the_legends_fit_inside_their_figures(tmp_path):
    from embbench.html_report import hit_rates_figure, pareto_figure

    run = Run(tmp_path, _crowd())
    hit_rates = hit_rates_figure([run])
    for fig in (hit_rates, pareto_figure(run, strategy_colours([run]))):
        fig.canvas.draw()
        (legend,) = fig.legends
        box, frame = legend.get_window_extent(), fig.bbox
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
        assert not fig.axes[0].get_window_extent().overlaps(box)
    # a colour per family and a line style per quantity, not an entry for each of their pairs
    families = 2 + 2 + 2  # freqcache (lfu, lru), colossalai (row, slot) and uvm_cache (lru, lfu), ratios apart
    assert len(hit_rates.legends[0].get_texts()) == families + 4  # was 20, one per pair shown


def test_step_times_are_on_a_log_axis_and_busy_cells_say_so(tmp_path):
    from embbench.html_report import step_times_figure

    ax = step_times_figure([Run(tmp_path, _crowd())]).axes[0]
    assert ax.get_xscale() == "log"
    low, high = ax.get_xlim()
    assert low < 10 * 0.98 and high > 2000 * 1.05  # the 10 ms and the 2,000 ms cell on one axis
    assert [t.get_text() for t in ax.get_yticklabels() if "busy!" in t.get_text()] == ["cpu@w1 busy!"]


def test_the_verdict_names_the_best_cell_its_margin_and_whether_the_noise_decides(tmp_path):
    from embbench.report import verdict

    clear = [make_record("device", step_times=_repeats(10, 0.01)), make_record("cpu", step_times=_repeats(13, 0.01))]
    (line,) = verdict(clear)
    assert line.startswith("1 rank(s): fastest device@w1 (51,200 samples/s), +30.0% [")
    assert "] over cpu@w1: faster beyond noise (p=" in line and line.endswith("the noise allows the decision")
    noisy = [make_record("device", step_times=_repeats(10, 0.1)), make_record("cpu", step_times=_repeats(10.5, 0.1))]
    (line,) = verdict(noisy)
    assert line.startswith("1 rank(s): fastest device@w1 (51,200 samples/s), +5.0% [")
    assert "] over cpu@w1: cannot judge: noise ±" in line and "wider than the change (+5.0%)" in line
    busy = [make_record("device", step_times=_repeats(10, 0.01), **BUSY), make_record("cpu", step_times=_repeats(13, 0.01))]
    assert "cannot judge: busy in the best: other processes took 60% of the 2 cores" in verdict(busy)[0]
    # the report opens with it, before the tables
    run = write_run(tmp_path / "a", noisy)
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.index("<b>Verdict</b>") < text.index("<h2>Results") and "cannot judge: noise" in text


def test_the_cache_curve_draws_freqcache_as_points_and_shades_sizes_below_a_batch(tmp_path):
    from embbench.cache.curve import measure
    from embbench.html_report import cache_curve_figure

    rng = np.random.default_rng(0)
    steps = [rng.zipf(1.3, 200) % 2000 for _ in range(12)]  # ~100 distinct rows a batch
    ratios = (0.01, 0.03, 0.1, 0.3)  # 20 and 60 rows: below a batch; 200 and 600: above
    curve = measure(steps, {"t0": 2000}, ratios, ("lru", "freqcache", "min"), skip=2, freqcache=lambda r: (0.5, 0.4),
                    freqcache_ratios=(0.01, 0.3))
    fig = cache_curve_figure(Run(tmp_path, _records()), curve)
    for ax in fig.axes:
        (shade,) = [p for p in ax.patches if p.get_label() == "below one batch's distinct rows"]
        left, right = shade.get_x(), shade.get_x() + shade.get_width()
        assert left < 0.01 and 0.03 < right < 0.1
    freqcache = next(ax for ax in fig.axes if ax.get_title() == "freqcache")
    (line,) = [l for l in freqcache.get_lines() if l.get_label() == "freqcache (curve)"]
    assert line.get_linestyle() == "None" and line.get_marker() == "o" and list(line.get_xdata()) == [0.01, 0.3]
    (lru,) = [l for l in fig.axes[0].get_lines() if l.get_label() == "lru (curve)"]
    assert lru.get_linestyle() == "-"  # measured at every size: a line

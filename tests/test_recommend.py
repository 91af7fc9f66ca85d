"""recommend: the fastest measured cell that fits a budget, why the others do not, and which
cells to run when the records do not cover the budget."""

from __future__ import annotations

import json

import os

import numpy as np
import pytest
from record_factory import make_record, write_run

from embbench.cli import main
from embbench.recommend import Budget, parse_size, recommend

MiB = 1 << 20


def _cache(ratio: float, seconds: float, device_bytes: int, **kw):
    return make_record("freqcache", {"cache_ratio": ratio, "policy": "lfu"}, step_times=[seconds] * 6 + [seconds * 1.01] * 6,
                       device_bytes=device_bytes, host_bytes=64 * MiB, **kw)


@pytest.mark.parametrize("text, size", [("16GiB", 16 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                        ("123456", 123456), (" 2 GiB ", 2 << 30), ("80gb", 80_000_000_000)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["16XB", "lots", "-5GiB", "0", ""])
def test_parse_size_rejects_what_is_not_a_size_naming_the_flag(text):
    with pytest.raises(ValueError, match=f"--device-memory {text!r}"):
        parse_size(text, "--device-memory")


def test_the_fastest_cell_that_fits_wins_and_the_others_say_why_not():
    records = [
        make_record("device", step_times=[0.005] * 12, device_bytes=900 * MiB),
        make_record("cpu", step_times=[0.030] * 6 + [0.031] * 6, device_bytes=0, host_bytes=800 * MiB),
        _cache(0.05, 0.010, 100 * MiB),
        _cache(0.20, 0.008, 300 * MiB),
        make_record("uvm", status="unsupported", message="needs CUDA\nmore detail"),
        make_record("gpu_sharded", status="oom", message="CUDA out of memory"),
    ]
    (rec,) = recommend(records, Budget(512 * MiB))
    assert rec.world_size == 1 and rec.best.cell_id == "freqcache[cache_ratio=0.2,policy=lfu]@w1"
    assert [c.cell_id for c in rec.runners_up] == ["freqcache[cache_ratio=0.05,policy=lfu]@w1", "cpu@w1"]
    assert rec.runners_up[0].relative_to_best == pytest.approx(0.008 / 0.010 - 1, rel=0.01)
    assert rec.runners_up[0].significant and rec.runners_up[0].p_value < 0.05
    assert rec.excluded == {
        "device@w1": "needs 900.00 MiB device memory per rank, 388.00 MiB over the budget",
        "uvm@w1": "status unsupported: needs CUDA",
        "gpu_sharded@w1": "status oom: CUDA out of memory",
    }


def test_the_measured_device_peak_counts_where_there_is_one():
    (rec,) = recommend([make_record("device", device_bytes=100 * MiB, peak_bytes=600 * MiB)], Budget(512 * MiB))
    assert rec.best is None and "needs 600.00 MiB device memory" in rec.excluded["device@w1"]
    assert rec.notes == ["no measured cell qualifies; the smallest needs 600.00 MiB device memory per rank"]


def test_a_host_budget_counts_all_ranks_together():
    records = [make_record("cpu", world_size=2, device_bytes=0, host_bytes=300 * MiB, baseline="cpu")]
    (rec,) = recommend(records, Budget(1 << 30, host_bytes=512 * MiB))
    assert rec.excluded == {"cpu@w2": "needs 600.00 MiB host memory, 88.00 MiB over the budget"}


def test_a_cell_less_accurate_than_the_baseline_beyond_the_tolerance_is_left_out():
    records = [make_record("device", step_times=[0.02] * 12, auc=0.750),
               make_record("cpu", step_times=[0.01] * 12, auc=0.745, device_bytes=0),
               _cache(0.1, 0.015, 1 * MiB, auc=0.7495)]
    (rec,) = recommend(records, Budget(16 << 30), auc_tolerance=0.001)
    assert rec.best.cell_id == "freqcache[cache_ratio=0.1,policy=lfu]@w1"
    assert rec.excluded == {"cpu@w1": "AUC 0.7450 is 0.0050 below the baseline's 0.7500 (tolerance 0.001), not weighed "
                                      "against its sampling error (no evaluation scores in the records)"}
    (loose,) = recommend(records, Budget(16 << 30), auc_tolerance=0.01)
    assert loose.best.cell_id == "cpu@w1"


def test_without_a_baseline_auc_accuracy_is_not_checked_and_it_says_so():
    records = [make_record("device", status="oom"), make_record("cpu", auc=0.5, device_bytes=0)]
    (rec,) = recommend(records, Budget(1 << 30))
    assert rec.best.cell_id == "cpu@w1"
    assert any(n.startswith("accuracy not checked") for n in rec.notes)


def test_each_world_size_gets_its_own_answer():
    records = [make_record("device", step_times=[0.02] * 12), make_record("device", world_size=2, step_times=[0.01] * 12)]
    recs = recommend(records, Budget(16 << 30))
    assert [(r.world_size, r.best.cell_id) for r in recs] == [(1, "device@w1"), (2, "device@w2")]


# -- cells to run where the records do not cover the budget ----------------------------------------

def test_every_measured_cache_too_big_suggests_the_largest_ratio_that_fits():
    # device bytes = 10 MiB + ratio * 1000 MiB, measured at 0.1 and 0.2; 60 MiB fits ratio 0.05
    records = [_cache(0.1, 0.01, 110 * MiB), _cache(0.2, 0.009, 210 * MiB)]
    (rec,) = recommend(records, Budget(60 * MiB), run_dir="results/runs/x")
    assert rec.best is None
    (s,) = rec.suggestions
    assert s.family == "freqcache[policy=lfu,cache_ratio=?]@w1" and s.cache_ratio == pytest.approx(0.05)
    assert "a line through 2 measured ratios: 10.00 MiB + 10.00 MiB per 0.01" in s.basis
    assert s.edit == "add 0.05 to freqcache's cache_ratio list in scenarios/smoke.yaml"
    assert s.command == "embbench run scenarios/smoke.yaml --strategies freqcache --out results/runs/x --resume"


def test_a_suggested_ratio_is_rounded_down_so_that_it_fits():
    records = [_cache(0.1, 0.01, 110 * MiB), _cache(0.2, 0.009, 210 * MiB)]
    (rec,) = recommend(records, Budget(68 * MiB))  # exactly 0.058
    assert rec.suggestions[0].cache_ratio == pytest.approx(0.058)
    (rec,) = recommend(records, Budget(68 * MiB - 1))  # just below 0.058
    assert rec.suggestions[0].cache_ratio == pytest.approx(0.057)


def test_one_measured_ratio_gives_a_proportional_estimate_marked_optimistic():
    (rec,) = recommend([_cache(0.1, 0.01, 100 * MiB, extra={"capacity_rows": 1000})], Budget(50 * MiB))
    (s,) = rec.suggestions
    assert s.cache_ratio == pytest.approx(0.05) and "optimistic" in s.basis
    assert "about 104,858 bytes per cached row" in s.basis  # 100 MiB / 1000 rows


def test_room_for_a_much_larger_cache_than_the_winner_suggests_measuring_it():
    records = [make_record("cpu", step_times=[0.05] * 12, device_bytes=0), _cache(0.01, 0.02, 20 * MiB), _cache(0.02, 0.01, 30 * MiB)]
    (rec,) = recommend(records, Budget(100 * MiB))  # 10 MiB + 1000 MiB * ratio: 0.09 fits
    assert rec.best.cell_id == "freqcache[cache_ratio=0.02,policy=lfu]@w1"
    assert [s.cache_ratio for s in rec.suggestions] == [pytest.approx(0.09)]
    (covered,) = recommend(records, Budget(35 * MiB))  # only 0.025 would fit: no news
    assert covered.suggestions == []


def test_a_cache_whose_fixed_part_exceeds_the_budget_is_said_not_to_fit_at_any_ratio():
    (rec,) = recommend([_cache(0.1, 0.01, 110 * MiB), _cache(0.2, 0.009, 210 * MiB)], Budget(5 * MiB))
    assert rec.suggestions == []
    assert "freqcache[policy=lfu,cache_ratio=?]@w1: its fixed device memory (about 10.00 MiB) exceeds the budget at any cache_ratio" in rec.notes


# -- the command --------------------------------------------------------------------------------

def test_recommend_prints_the_answer(tmp_path, capsys):
    run = write_run(tmp_path / "run", [make_record("device", step_times=[0.005] * 12, device_bytes=900 * MiB),
                                       _cache(0.05, 0.010, 100 * MiB), _cache(0.20, 0.008, 300 * MiB)])
    assert main(["recommend", str(run), "--device-memory", "512MiB"]) == 0
    out = capsys.readouterr().out
    assert "recommended: freqcache[cache_ratio=0.2,policy=lfu]@w1" in out
    assert "runners-up" in out and "388.00 MiB over the budget" in out
    assert main(["recommend", str(run), "--device-memory", "16GiB", "--json"]) == 0
    (data,) = json.loads(capsys.readouterr().out)
    assert data["best"]["cell_id"] == "device@w1" and data["excluded"] == {}


@pytest.mark.parametrize("argv, message", [
    (["--device-memory", "16XB"], "--device-memory '16XB': expected a size"),
    (["--device-memory", "1GiB", "--host-memory", "many"], "--host-memory 'many': expected a size"),
])
def test_recommend_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    run = write_run(tmp_path / "run", [make_record("device")])
    assert main(["recommend", str(run), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_winner_within_the_noise_of_a_runner_up_is_named_with_that_caveat(tmp_path, capsys):
    """Repeats 10/14/9 ms against 11/10.5/12 ms: the first is 'fastest' by its median, but the
    intervals overlap: the answer says so, and it never says so of a clear winner."""
    noisy = make_record("device", step_times=[0.010] * 4 + [0.014] * 4 + [0.009] * 4, device_bytes=MiB)
    close = make_record("cpu", step_times=[0.011] * 4 + [0.0105] * 4 + [0.012] * 4, device_bytes=MiB)
    (rec,) = recommend([noisy, close], Budget(1 << 30))
    assert rec.best.cell_id == "device@w1" and rec.runners_up[0].interval[0] < 1 < rec.runners_up[0].interval[1]
    assert any(c.startswith("device@w1 is not faster beyond noise than cpu@w1") for c in rec.caveats)
    slow = make_record("cpu", step_times=[0.030] * 4 + [0.031] * 4 + [0.029] * 4, device_bytes=MiB)
    (rec,) = recommend([noisy, slow], Budget(1 << 30))
    assert not any("beyond noise" in c for c in rec.caveats)


def test_a_cpu_run_says_first_that_it_is_no_placement_decision(tmp_path, capsys):
    run = write_run(tmp_path / "run", [make_record("device", device="cpu", step_times=[0.01] * 12),
                                       make_record("cpu", device="cpu", step_times=[0.03] * 12)])
    assert main(["recommend", str(run), "--device-memory", "16GiB"]) == 0
    out = capsys.readouterr().out
    first = out.index("read first: the placement question cannot be answered here: measured with the host CPU")
    assert first < out.index("fastest on this machine: device@w1") and "recommended:" not in out


def _curve(hit_rates: list[float]) -> dict:
    """A cache curve of one table whose MIN hits ``hit_rates`` of distinct rows, complete as
    ``embbench curve`` writes it (read_curve checks every key)."""
    ratios = [0.001, 0.01, 0.02, 0.05, 0.1, 0.2][: len(hit_rates)]
    rows, steps, distinct = 10_000, 10, 5_000
    line = {"hit_rate": hit_rates, "unique_hit_rate": hit_rates,
            "rows_moved_per_step": [(1 - h) * distinct / steps for h in hit_rates],
            "bytes_per_step": [(1 - h) * distinct / steps * 64 for h in hit_rates]}
    scope = {"rows": rows, "accesses": 2 * distinct, "distinct": distinct,
             "capacity": [max(1, round(r * rows)) for r in ratios], "policies": {"min": line}}
    return {"format": "embbench-curve-1", "ratios": ratios, "policies": ["min"], "row_bytes": 64, "warmup_steps": 0,
            "counted_steps": steps, "tables": {"t0": rows},
            "scopes": [{"name": "all", **scope}, {"name": "t0", **scope}]}


def test_a_suggested_ratio_stops_at_the_knee_of_the_cache_curve():
    # device bytes = 10 MiB + ratio * 1000 MiB: 0.09 fits; the curve flattens from 0.02 on
    records = [make_record("cpu", step_times=[0.05] * 12, device_bytes=0), _cache(0.01, 0.02, 20 * MiB), _cache(0.011, 0.01, 21 * MiB)]
    curve = _curve([0.1, 0.5, 0.9, 0.92, 0.93, 0.94])
    (rec,) = recommend(records, Budget(100 * MiB), curve=curve)
    (s,) = rec.suggestions
    assert s.cache_ratio == 0.02 and "the cache curve's knee: MIN hits 90.0% of distinct rows at 0.02" in s.basis
    (without,) = recommend(records, Budget(100 * MiB))
    assert without.suggestions[0].cache_ratio == pytest.approx(0.09)
    (tight,) = recommend(records, Budget(15 * MiB), curve=curve)  # every cache too big; 0.005 fits, below the knee
    (s,) = tight.suggestions
    assert s.cache_ratio == pytest.approx(0.005) and "knee" not in s.basis


def test_recommend_reads_the_curve_file_beside_the_run(tmp_path, capsys):
    records = [make_record("cpu", step_times=[0.05] * 12, device_bytes=0), _cache(0.01, 0.02, 20 * MiB), _cache(0.011, 0.01, 21 * MiB)]
    run = write_run(tmp_path / "run", records)
    (run / "curve.json").write_text(json.dumps(_curve([0.1, 0.5, 0.9, 0.92, 0.93, 0.94])))
    assert main(["recommend", str(run), "--device-memory", "100MiB"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"cache curve: {run / 'curve.json'}" in out and "cache_ratio=0.02" in out and "knee" in out
    (run / "curve.json").write_text("{}")
    assert main(["recommend", str(run), "--device-memory", "100MiB"]) == 2
    assert f"{run / 'curve.json'}: not a curve file" in capsys.readouterr().err


# -- issue 41: advice that fits the budget ------------------------------------------------------


def test_a_budget_that_holds_every_row_suggests_no_cache_but_the_tables_on_the_device():
    """16 GiB against a few MiB of tables: a cache_ratio=1 cache is every table on the device."""
    records = [make_record("device", step_times=[0.005] * 12, device_bytes=2 * MiB),
               _cache(0.01, 0.02, 20 * MiB), _cache(0.02, 0.01, 30 * MiB)]
    (rec,) = recommend(records, Budget(16 << 30))
    assert rec.suggestions == []
    assert ("freqcache[policy=lfu,cache_ratio=?]@w1: the budget holds a cache of every row (cache_ratio=1): with every "
            "table on the device no cache is needed; that is `device`") in rec.notes


def test_a_ratio_at_the_curves_knee_has_two_significant_digits():
    records = [make_record("cpu", step_times=[0.05] * 12, device_bytes=0), _cache(0.01, 0.02, 20 * MiB),
               _cache(0.011, 0.01, 21 * MiB)]
    curve = _curve([0.1, 0.5, 0.9, 0.92, 0.93, 0.94])
    curve["ratios"] = [0.0012345, 0.0076324, 0.0211111, 0.05, 0.1, 0.2]
    (rec,) = recommend(records, Budget(100 * MiB), curve=curve)
    (s,) = rec.suggestions
    assert s.cache_ratio == 0.021 and "0.021 to freqcache's cache_ratio" in s.edit


def test_a_cache_whose_fixed_part_exceeds_every_table_says_it_and_from_how_many_rows_it_pays():
    """The smoke's freqcache: 2.72 MiB of planner state against 2.19 MiB of tables."""
    device = make_record("device", step_times=[0.005] * 12, device_bytes=2 * MiB)
    # 3 MiB fixed + 1 MiB per unit ratio; 100,000 rows (capacity 1,000 at 0.01): 21 bytes a row on the device
    caches = [_cache(0.01, 0.02, 3 * MiB + MiB // 100, extra={"capacity_rows": 1000}), _cache(0.1, 0.01, 3 * MiB + MiB // 10)]
    (rec,) = recommend([device, *caches], Budget(1 << 30))
    (note,) = [n for n in rec.notes if "is fixed" in n]
    assert note.startswith("freqcache[policy=lfu,cache_ratio=?]@w1: about 3.00 MiB of its device memory is fixed (it does "
                           "not shrink with cache_ratio), more than every table on the device (2.00 MiB, device@w1): at "
                           "this scale the cache costs more device memory than no cache; at cache_ratio=0.01 it needs "
                           "less than device from about ")
    rows = float(note.split("from about ")[1].split(" rows")[0].replace(",", ""))
    # 3 MiB / (2 MiB / 1e5 - 1 MiB / 1e5 * 0.01) rows, to two digits
    assert rows == pytest.approx(3 * MiB / (2 * MiB / 1e5 - MiB / 1e5 * 0.01), rel=0.01)


# -- issue 41: an AUC judged against its own noise ---------------------------------------------------


def _scored(n: int = 2000, seed: int = 0):
    """Labels (a quarter positive) and two models' scores that share most of their signal."""
    rng = np.random.default_rng(seed)
    labels = rng.random(n) < 0.25
    base = rng.normal(size=n) + labels
    return labels, base + rng.normal(scale=0.5, size=n), base + rng.normal(scale=0.6, size=n)


def test_delongs_test_agrees_with_a_paired_bootstrap_on_the_same_samples():
    """The reference: scipy's paired bootstrap of the AUC difference; the AUC itself: Mann-Whitney's U."""
    from scipy import stats

    from embbench.stats import auc_standard_error, delong

    labels, a, b = _scored()
    test = delong(labels, a, b)
    assert test.auc_a == pytest.approx(stats.mannwhitneyu(a[labels], a[~labels]).statistic / (labels.sum() * (~labels).sum()))

    def auc(scores, y, axis=-1):
        ranks, n1 = stats.rankdata(scores, axis=axis), y.sum(axis=axis)
        return ((ranks * y).sum(axis=axis) - n1 * (n1 + 1) / 2) / (n1 * (y.shape[axis] - n1))

    boot = stats.bootstrap((labels.astype(float), a, b), lambda y, sa, sb, axis=-1: auc(sb, y, axis) - auc(sa, y, axis),
                           paired=True, vectorized=True, n_resamples=2000, random_state=1, batch=200)
    assert test.standard_error == pytest.approx(boot.standard_error, rel=0.1) and test.paired
    one = stats.bootstrap((labels.astype(float), a), lambda y, s, axis=-1: auc(s, y, axis), paired=True, vectorized=True,
                          n_resamples=2000, random_state=1, batch=200)
    assert auc_standard_error(labels, a) == pytest.approx(one.standard_error, rel=0.1)
    assert delong(labels, a, a).p_value == 1.0


def _with_scores(record, run, scores, labels):
    from embbench.eval_scores import write_eval_scores
    from embbench.results import EVAL_DIR

    name = f"{record.strategy}.npz"
    write_eval_scores(run / EVAL_DIR / name, scores.tolist(), labels.astype(int).tolist())
    record.metrics["accuracy"]["eval_file"] = name
    return record


def test_an_auc_drop_within_its_sampling_error_is_a_note_and_beyond_it_a_reason(tmp_path):
    """Issue 41: fae 0.0021 below the baseline with a tolerance of 0.001, on samples whose AUC
    standard error is about 0.01: kept, with the numbers; the same drop on samples that say it is
    real leaves the cell out."""
    labels, a, _ = _scored(2048)
    base = _with_scores(make_record("device", step_times=[0.005] * 12, auc=0.7521), tmp_path, a, labels)
    fae = _with_scores(make_record("fae", step_times=[0.004] * 12, auc=0.7500), tmp_path, a + 0.3 * np.sin(np.arange(2048)),
                       labels)
    (rec,) = recommend([base, fae], Budget(1 << 30), auc_tolerance=0.001, run_dir=str(tmp_path))
    assert rec.best.cell_id == "fae@w1" and "fae@w1" not in rec.excluded
    (note,) = [n for n in rec.notes if n.startswith("fae@w1: AUC")]
    assert "0.0021 below the baseline's 0.7521 (tolerance 0.001), within its sampling error (±0." in note
    assert "DeLong on the same 2,048 evaluation samples): not left out" in note
    worse = _with_scores(make_record("fae", step_times=[0.004] * 12, auc=0.7000), tmp_path, -a + labels * 0.5, labels)
    (rec,) = recommend([base, worse], Budget(1 << 30), auc_tolerance=0.001, run_dir=str(tmp_path))
    assert rec.excluded["fae@w1"].endswith("evaluation samples)") and "beyond its sampling error (±0." in rec.excluded["fae@w1"]


def test_without_scores_the_records_standard_errors_weigh_the_drop_unpaired():
    base = make_record("device", step_times=[0.005] * 12, auc=0.7521)
    fae = make_record("fae", step_times=[0.004] * 12, auc=0.7500)
    for r in (base, fae):
        r.metrics["accuracy"].update(auc_standard_error=0.012, eval_samples=2048)
    (rec,) = recommend([base, fae], Budget(1 << 30), auc_tolerance=0.001)
    assert "fae@w1" not in rec.excluded
    assert any("within its sampling error (±0.0170, p=0.9, unpaired standard errors on the same 2,048" in n for n in rec.notes)


def _damage(kind, path, labels, scores, outside):
    """An eval file at ``path`` damaged in one way (issue 50, 6)."""
    import io
    import zipfile

    if kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[:40])
    elif kind == "huge":  # a small file whose array asks for 3 GB, and holds more bytes than the samples take
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (750_000_000,)})
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("labels.npy", _npy(labels.astype(np.uint8)))
            with z.open("scores.npy", "w", force_zip64=True) as member:
                member.write(header.getvalue())
                member.write(bytes(100_000))
    elif kind == "outside":
        return "../../" + outside.name
    else:
        bad = {"short": (scores[:-5], labels), "labels": (scores, labels * 2), "one class": (scores, labels * 0),
               "nan": (np.where(np.arange(len(scores)) % 7 == 0, np.nan, scores), labels)}[kind]
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("scores.npy", _npy(bad[0].astype(np.float32)))
            z.writestr("labels.npy", _npy(bad[1].astype(np.uint8)))
    return path.name


def _npy(array):
    import io

    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


@pytest.mark.parametrize("kind", ["outside", "fifo", "truncated", "huge", "short", "labels", "one class", "nan"])
def test_a_damaged_eval_file_makes_its_cell_cannot_judge_and_never_fails_the_command(tmp_path, kind):
    """Issue 50, 6: read as a record is (a regular file in the run's eval/, bounded, its arrays
    checked); a drop that file was to weigh is not judged, and recommend answers."""
    labels, a, _ = _scored(2048)
    run = tmp_path / "run"
    outside = tmp_path / "x.npz"  # a file outside the run that would decide the verdict
    from embbench.eval_scores import write_eval_scores

    write_eval_scores(outside, (-a + labels * 0.5).tolist(), labels.astype(int).tolist())
    base = _with_scores(make_record("device", step_times=[0.005] * 12, auc=0.7521), run, a, labels)
    fae = _with_scores(make_record("fae", step_times=[0.004] * 12, auc=0.7000), run, a + 0.3 * np.sin(np.arange(2048)),
                       labels)
    for r in (base, fae):
        r.metrics["accuracy"]["eval_samples"] = 2048
    fae.metrics["accuracy"]["eval_file"] = _damage(kind, run / "eval" / "fae.npz", labels, a, outside)
    (rec,) = recommend([base, fae], Budget(1 << 30), auc_tolerance=0.001, run_dir=str(run))
    reason = rec.excluded["fae@w1"]
    assert "cannot judge it against its sampling error: " in reason and "beyond" not in reason
    expected = {"outside": "an eval file is named by a file name", "fifo": "is a FIFO", "truncated": "damaged",
                "huge": "scores.npy unpacks to", "short": "2,043 scores, 2,048 labels", "labels": "labels other than 0",
                "one class": "one class only", "nan": "not finite"}[kind]
    assert expected in reason

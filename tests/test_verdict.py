"""One verdict everywhere (issue 49, point 1): the HTML report's opening verdict, ``compare``,
its ``--fail-on`` gate and ``recommend`` read one judgement (:func:`embbench.compare.repeat_test`),
the A/A noise floor included."""

from __future__ import annotations

import json
import math

from embbench.cli import main
from embbench.compare import CANNOT_JUDGE, aa_floor_of, compare_runs, load_runs
from embbench.recommend import Budget, recommend
from embbench.report import verdict
from tests.record_factory import make_record, write_run


def _repeats(ms: float, spread: float = 0.01) -> list[float]:
    """12 steps in 3 repeats whose medians are ``ms`` times 1 - spread, 1 and 1 + spread."""
    return [ms / 1e3 * f for f in (1 - spread, 1, 1 + spread) for _ in range(4)]


def _aa_pair(tmp_path):
    """The issue's case: one scenario and commit run twice. In A, device is 64% faster than cpu
    with tight repeats; in B device took 12 times as long (the machine), so B names cpu fastest:
    the A/A floor is x12."""
    a = write_run(tmp_path / "a", [make_record("device", step_times=_repeats(10)),
                                   make_record("cpu", step_times=_repeats(16.4))])
    b = write_run(tmp_path / "b", [make_record("device", step_times=_repeats(120)),
                                   make_record("cpu", step_times=_repeats(16.4))])
    return a, b


def test_the_reports_verdict_and_compare_hold_an_aa_pair_to_its_floor(tmp_path):
    a, b = _aa_pair(tmp_path)
    runs = load_runs([a, b])
    floor = aa_floor_of(runs)
    assert math.isclose(math.exp(floor), 12, rel_tol=1e-6)
    alone = verdict(runs[0].records)  # one run, no floor known: its repeats decide
    assert "faster beyond noise" in alone[0]
    for run in runs:  # held to the floor, neither run names a winner the noise allows
        (line,) = verdict(run.records, aa_floor=floor)
        assert "cannot judge: within the A/A noise floor (up to x12)" in line
    (_, cells), = compare_runs(runs)
    assert all("within the A/A noise floor (up to x12)" in c.significance.not_judged for c in cells)


def test_the_html_report_opens_with_the_verdict_compare_reads(tmp_path):
    a, b = _aa_pair(tmp_path)
    out = tmp_path / "r.html"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    opening = out.read_text().split('<div class="verdict">')[1].split("</div>")[0]
    assert "held to the A/A noise floor of these runs, up to x12" in opening
    assert "faster beyond noise" not in opening and opening.count("cannot judge: within the A/A noise floor") == 2


def test_the_gate_and_recommend_read_the_same_floor(tmp_path, capsys):
    a, b = _aa_pair(tmp_path)
    assert main(["compare", str(a), str(b), "--fail-on", "5%"]) == CANNOT_JUDGE
    capsys.readouterr()
    (rec,) = recommend(load_runs([a])[0].records, Budget(1 << 40), aa_floor=aa_floor_of(load_runs([a, b])))
    assert rec.runners_up[0].significant is None and "within the A/A noise floor" in rec.runners_up[0].not_judged
    assert main(["recommend", str(a), "--device-memory", "1TiB", "--noise-floor-from", str(b), "--json"]) == 0
    (shown,) = json.loads(capsys.readouterr().out)
    assert "within the A/A noise floor (up to x12)" in shown["runners_up"][0]["not_judged"]
    assert main(["recommend", str(a), "--device-memory", "1TiB"]) == 0  # without it, A's repeats alone
    assert "A/A" not in capsys.readouterr().out


def test_noise_floor_from_a_run_of_another_scenario_is_refused(tmp_path, capsys):
    a, _ = _aa_pair(tmp_path)
    other = write_run(tmp_path / "c", [make_record("device", digest="e" * 64), make_record("cpu", digest="e" * 64)])
    assert main(["recommend", str(a), "--device-memory", "1TiB", "--noise-floor-from", str(other)]) == 2
    assert "not the same scenario and clean commit" in capsys.readouterr().err

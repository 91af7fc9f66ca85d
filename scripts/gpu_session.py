"""A lent GPU's quarter-hour, after scripts/gpu_session.sh installed the packages: the CUDA
tests the CPU skips, the headline cells, then the priority list, within the seconds left.

Run through scripts/gpu_session.sh (see docs/gpu-matrix.md); ``--rehearse`` runs the same
sequence on the CPU at a tiny scale. Every cell's record is archived into ``$OUT`` the moment
it exists (one tar, replaced whole, and the ledger), so a run cut short returns all that
finished. A cell is started only when its estimate fits in the seconds left; records already
committed under ``results/*/<run>/`` (same scenario, same device) are reused, never rerun.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from embbench import launch  # noqa: E402
from embbench.bounds import positive_flag  # noqa: E402
from embbench.results import load_records  # noqa: E402
from embbench.scenario import Cell, Scenario, parse_scenario  # noqa: E402

MATRIX = ROOT / "scenarios" / "gpu_matrix"
#: The CUDA checks the CPU skips: freqcache's captured and compiled steps, the prefetch
#: pipeline's exactness, fbgemm's cache counters, the graphed generator.
CUDA_TESTS = [
    "tests/test_device_planner.py::test_on_cuda_the_captured_steps_train_like_the_eager_ones_without_a_host_sync",
    "tests/test_prefetch_pipeline.py::test_prefetch_pipeline_trains_like_device_on_cuda",
    "tests/test_torchrec_baselines.py::test_cache_counts_agree_with_fbgemm_on_cuda",
    "tests/test_generator.py",  # (with -k cuda: its cases on the GPU, the graph replays included)
    "tests/test_row_copy.py",  # freqcache's Triton moves against its torch moves
    "tests/test_sparse_backward.py",  # the Triton update of the distinct rows against torch's update
]
#: Device seconds of one cell at the Criteo-Kaggle shape on an H100: process start, tables (17 GB
#: of initial weights on 16 cores, then to the device), warm-up, 90 measured steps, evaluation.
#: Measured on 2026-11-26 (results/2026-11-26-h100): device 19-24 s, uvm_cache 26-31 s, freqcache
#: 55 s (its plan step failed to compile and ran eagerly); the others are 2026-11-23's 55-76 s less
#: the faster fill (a guess until measured).
KAGGLE_SECONDS = {"device": 25, "gpu_sharded": 40, "uvm": 45, "uvm_cache": 32, "cpu": 120, "freqcache": 50,
                  "colossalai": 60, "fae": 60, "sfctr": 75}
FIRST_COMPILE_SECONDS = 40
#: Cells of the 1TB shape hold 5.3 times the Kaggle rows.
SHAPE_FACTOR = {"criteo_kaggle": 1.0, "criteo_1tb_freq3": 4.0}
#: Kept for the last archive and the transfer back.
RESERVE_SECONDS = 15
#: The rehearsal: every scenario shrunk to seconds a cell on a CPU (CUDA-only cells are
#: recorded unsupported).
REHEARSAL = {"data": {"scale": 0.0001, "embedding_dim": 8, "batch_size": 64},
             "model": {"bottom_mlp": [8], "top_mlp": [8, 1]},
             "run": {"device": "auto", "warmup_steps": 1, "warmup_max_steps": None, "steps": 2, "repeats": 1,
                     "eval_batches": 1, "time_limit_s": 60}}
REHEARSAL_CELL_SECONDS = 12
SPENT = "not started: the budget is spent"


@dataclass
class Item:
    """One entry of the priority list: a scenario's cells (all, or those of ``strategies``,
    or the cells ``cells`` names), run into ``results/<run>/``."""

    title: str
    scenario: Path
    run: str
    strategies: tuple[str, ...] = ()
    ratios: tuple[float, ...] = ()
    #: run every cell with the code this lease carries, never from committed records: each lease
    #: answers the headline question anew (freqcache changes between leases)
    fresh: bool = False
    #: a torch.profiler trace of a few untimed steps after each cell's measurement (run --profile):
    #: the top kernels in the record, the trace in profiles/
    profile: bool = False
    #: a run folder of this session to compare these cells against (compare.txt beside show.txt)
    against: str | None = None
    #: scenario sections updated before parsing (e.g. {"run": {"sparse_backward": "unique"}}):
    #: another effective scenario, so another digest; give it its own ``run`` folder
    overrides: dict = field(default_factory=dict)


def priority_list() -> list[Item]:
    """What a lent machine runs after the CUDA tests, most important first."""
    headline = [Item("headline: Kaggle shape, cache 1.5 %", MATRIX / "kaggle_headline.yaml", "kaggle_alpha1.15",
                     fresh=True, profile=True),
                # as H100 users train: the dense matmuls in TF32, where fp32's sgemm no longer hides
                # the sparse part (issue 42)
                Item("headline in TF32: dense matmuls in TF32", MATRIX / "kaggle_headline_tf32.yaml",
                     "kaggle_headline_tf32", fresh=True, profile=True),
                # the same device cell again: what a second run of identical code moves (the GPU's
                # noise floor, which "freqcache beats device" must clear)
                Item("A/A: device again", MATRIX / "kaggle_headline.yaml", "kaggle_alpha1.15-aa", ("device",),
                     fresh=True, against="kaggle_alpha1.15"),
                # device's sparse backward both ways (TF32 dense, where it is not hidden): the
                # fixed-shape one with the update kernel against torch.unique's host sync (issue 42)
                *(Item(f"device, sparse_backward {way}", MATRIX / "kaggle_headline_tf32.yaml",
                       f"kaggle_headline_tf32-{way}", ("device",), fresh=True, against="kaggle_headline_tf32",
                       overrides={"run": {"sparse_backward": way}}) for way in ("padded", "unique")),
                # full size, sums in a fixed order: freqcache's losses must equal device's exactly
                Item("exactness: freqcache against device, deterministic", MATRIX / "kaggle_exactness.yaml",
                     "kaggle_exactness", fresh=True),
                # and device against itself there: any difference is not float atomics (2026-11-28:
                # freqcache's losses differed from device's by 1.5e-3 under deterministic algorithms)
                Item("exactness A/A: device again, deterministic", MATRIX / "kaggle_exactness.yaml",
                     "kaggle_exactness-aa", ("device",), fresh=True, against="kaggle_exactness")]
    optional = []
    row_precision = MATRIX / "row_precision.yaml"  # the full Kaggle shape (scenarios/row_precision.yaml: CPU-sized)
    if row_precision.exists():
        optional.append(Item("row precision", row_precision, "row_precision"))
    chunks = []
    for name in ("kaggle_alpha1.15", "kaggle_alpha1.05", "criteo_1tb_dim64", "criteo_1tb_dim128"):
        path = MATRIX / f"{name}.yaml"
        chunks += [Item(f"{name}: the caches at 1.5 %", path, name, ("device", "freqcache", "uvm_cache"), (0.015,)),
                   Item(f"{name}: the caches at 0.5 and 5 %", path, name, ("freqcache", "uvm_cache"), (0.005, 0.05)),
                   Item(f"{name}: whole-table placements", path, name, ("device", "gpu_sharded", "uvm", "cpu")),
                   Item(f"{name}: the other caches", path, name, ("colossalai", "fae", "sfctr"))]
    return headline + optional + chunks


@dataclass
class Ledger:
    """Device seconds per phase, printed and archived as it grows."""

    budget: float
    started: float
    lines: list[tuple[str, float | None, float, str]] = field(default_factory=list)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def add(self, phase: str, estimate: float | None, used: float, status: str) -> None:
        self.lines.append((phase, estimate, used, status))
        if status != SPENT:
            print(f"[{self.budget - self.left():6.0f} s] {phase}: {status} ({used:.0f} s)", flush=True)

    def text(self) -> str:
        rows = [f"{'phase':<90} {'est s':>6} {'used s':>7}  status"]
        spent = [phase for phase, _, _, status in self.lines if status == SPENT]
        for phase, estimate, used, status in self.lines:
            if status != SPENT:
                rows.append(f"{phase[:90]:<90} {'' if estimate is None else f'{estimate:.0f}':>6} {used:7.1f}  {status}")
        if spent:
            rows.append(f"{'not started, the budget spent: ' + '; '.join(spent)}")
        used = self.budget - self.left()
        rows.append(f"{'total':<90} {'':>6} {used:7.1f}  of {self.budget:.0f} s given; {self.left():.0f} s left")
        return "\n".join(rows) + "\n"


class Session:
    def __init__(self, args: argparse.Namespace):
        self.rehearse = args.rehearse
        self.work = Path(args.work)
        self.out = Path(args.out)
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.ledger = Ledger(args.seconds, time.monotonic() - args.spent)
        if args.install_note:
            self.ledger.add("install", 30, args.spent, args.install_note)
        self.observed: dict[tuple[str, str], float] = {}  # (run, strategy) -> seconds of a cell run here
        self.compiled: set[tuple[str, str]] = set()  # freqcache cells (shapes) compiled on this machine

    # -- archiving -----------------------------------------------------------------------------

    def archive(self) -> None:
        """The work folder (records, logs, tables; no weight files) as $OUT/session.tgz, replaced
        whole, and the ledger beside it."""
        (self.work / "ledger.txt").write_text(self.ledger.text())
        shutil.copyfile(self.work / "ledger.txt", self.out / "ledger.txt")
        partial = self.out / ".session.tgz.part"
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(self.work, arcname="session", filter=lambda info: None if "/weights" in info.name else info)
        os.replace(partial, self.out / "session.tgz")

    # -- phases --------------------------------------------------------------------------------

    def cuda_tests(self) -> None:
        estimate = 20 if self.rehearse else 60  # 46 s on the H100 (2026-11-28)
        started = time.monotonic()
        done = self.work / "cuda_tests.txt"
        if done.exists():  # a second call of this session, on the same machine
            self.ledger.add("CUDA tests", None, 0, f"ran earlier in this session: {_last_line(done.read_text())}")
            return
        if estimate > self.ledger.left() - RESERVE_SECONDS:
            self.ledger.add("CUDA tests", estimate, 0, f"not started: estimate {estimate} s > {self.ledger.left():.0f} s left")
            return
        try:
            import hypothesis  # noqa: F401
            import pytest  # noqa: F401
        except ImportError as e:
            self.ledger.add("CUDA tests", estimate, 0, f"not run: {e} (stage pytest and hypothesis: docs/gpu-matrix.md)")
            return
        limit = max(10, int(min(2 * estimate, self.ledger.left() - RESERVE_SECONDS)))
        try:
            out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-k", "cuda", *CUDA_TESTS],
                                 cwd=ROOT, capture_output=True, text=True, timeout=limit)
            text, status = out.stdout + out.stderr, f"exit {out.returncode}: {_last_line(out.stdout)}"
        except subprocess.TimeoutExpired as e:
            text, status = f"{e.stdout or ''}{e.stderr or ''}", f"cut at {limit} s"
        (self.work / "cuda_tests.txt").write_text(text)
        self.ledger.add("CUDA tests", estimate, time.monotonic() - started, status)
        self.archive()

    def item(self, item: Item) -> None:
        scenario, cells = self._scenario(item)
        cells = _selected(item, cells)
        run_dir = self.work / item.run
        run_dir.mkdir(parents=True, exist_ok=True)
        reused = 0 if item.fresh else self._seed(run_dir, scenario)
        done = launch.reusable_records(run_dir, scenario, None, lambda message: None)
        if reused:
            self.ledger.add(f"{item.title}: reused", None, 0, f"{reused} committed record(s) of this scenario")
        for cell in cells:
            if cell.id in done:
                continue
            refused = launch.outcome_without_launch(scenario, cell)  # unsupported or skipped: no process, no time
            estimate = None if refused else self._estimate(item, scenario, cell)
            title = f"{item.run} {cell.id}"
            if estimate is not None and estimate > self.ledger.left() - RESERVE_SECONDS:
                self.ledger.add(title, estimate, 0, f"not started: estimate {estimate:.0f} s > "
                                                    f"{self.ledger.left() - RESERVE_SECONDS:.0f} s left")
                continue
            started = time.monotonic()
            record = self._run_cell(scenario, item, cell, cells, done, run_dir)
            used = time.monotonic() - started
            if record.status == "ok":
                done[cell.id] = record
                self.observed[item.run, cell.strategy] = used
                if cell.strategy == "freqcache":
                    self.compiled.add((item.run, cell.id))
            self.ledger.add(title, estimate, used, _summary(record))
            self.archive()
        self._show(run_dir)
        if item.against:
            self._compare(self.work / item.against, run_dir)

    def _run_cell(self, scenario: Scenario, item: Item, cell: Cell, cells: list[Cell], done: dict, run_dir: Path):
        """One cell through launch.run_cells (the baseline's record first, for the loss check),
        under a time limit that ends it before the budget does."""
        limit = max(5.0, min(scenario.run.time_limit_s, self.ledger.left() - RESERVE_SECONDS))

        def execute(c: Cell, weights: Path | None):
            profile = run_dir / "profiles" / f"{c.slug}.trace.json" if item.profile else None
            if profile is not None:
                profile.parent.mkdir(parents=True, exist_ok=True)
            return launch.outcome_without_launch(scenario, c) or launch.run_isolated(
                scenario, str(item.scenario), c, run_dir / "logs", weights, time_limit_s=limit, profile_path=profile)

        order = [c for c in cells if c.id in done or c is cell]
        records = launch.run_cells(scenario, str(item.scenario), order, run_dir, execute=execute, done=dict(done))
        return records[order.index(cell)]

    def _scenario(self, item: Item) -> tuple[Scenario, list[Cell]]:
        raw = _raw(item)
        if self.rehearse:
            for section, values in REHEARSAL.items():
                raw.setdefault(section, {}).update(values)
        return parse_scenario(raw, str(item.scenario))

    def _estimate(self, item: Item, scenario: Scenario, cell: Cell) -> float:
        seen = self.observed.get((item.run, cell.strategy))
        if seen is not None and (cell.strategy != "freqcache" or (item.run, cell.id) in self.compiled):
            return seen
        if self.rehearse:
            return REHEARSAL_CELL_SECONDS
        return estimate(scenario, cell, compiled=(item.run, cell.id) in self.compiled)

    def _seed(self, run_dir: Path, scenario: Scenario) -> int:
        """Copy committed records of this scenario made on this kind of device into the run
        folder, so that their cells are not run again; returns how many."""
        run_dir.mkdir(parents=True, exist_ok=True)
        here = _device_name()
        copied = 0
        for folder in sorted((ROOT / "results").glob(f"*/{run_dir.name}")):
            for record in load_records(folder, on_damaged=lambda e: None):
                if record.status != "ok" or record.scenario["digest"] != scenario.digest():
                    continue
                if _record_device(record) != here:
                    continue
                slug = Cell(record.strategy, record.params, record.world_size).slug
                target = run_dir / f"{slug}.json"
                if not target.exists():
                    shutil.copyfile(folder / f"{slug}.json", target)
                    copied += 1
        return copied

    def _show(self, run_dir: Path) -> None:
        (run_dir / "show.txt").write_text(_cli_output("show", str(run_dir), "--wide"))
        self.archive()

    def _compare(self, baseline: Path, run_dir: Path) -> None:
        (run_dir / "compare.txt").write_text(_cli_output("compare", str(baseline), str(run_dir)))
        self.archive()


def _cli_output(*argv: str) -> str:
    """What ``embbench ARGV`` prints, errors included."""
    from embbench import cli

    text = io.StringIO()
    try:
        with redirect_stdout(text), redirect_stderr(text):
            cli.main(list(argv))
    except SystemExit:
        pass
    return text.getvalue()


def estimate(scenario: Scenario, cell: Cell, compiled: bool = False) -> float:
    """Device seconds of one cell on an H100 (before any was measured in this session): a
    freqcache cell compiles its steps for its shape first unless this machine did already."""
    seconds = KAGGLE_SECONDS.get(cell.strategy, 90) * SHAPE_FACTOR.get(scenario.data.preset, 1.0)
    return seconds + (FIRST_COMPILE_SECONDS if cell.strategy == "freqcache" and not compiled else 0)


def plan_text() -> str:
    """The priority list with each item's cells and estimated device seconds on a bare H100
    (cells a GPU refuses, such as lfu with the prefetch pipeline, count nothing)."""
    import torch

    from embbench.strategy import RuntimeEnv

    env, rows, seen = RuntimeEnv(torch.device("cuda")), [], set()
    for item in priority_list():
        scenario, cells = parse_scenario(_raw(item), str(item.scenario))
        cells = [c for c in _selected(item, cells) if (item.run, c.id) not in seen]
        seen.update((item.run, c.id) for c in cells)
        runnable = [c for c in cells if not c.make_strategy().unsupported_reason(env)]
        seconds = sum(estimate(scenario, c) for c in runnable)
        rows.append(f"{item.title:<52} {len(runnable):>3} cells {seconds:>6.0f} s  ({item.scenario.name})")
    return "\n".join(rows)


def _raw(item: Item) -> dict:
    """The item's scenario file with its overrides."""
    raw = yaml.safe_load(item.scenario.read_text())
    for section, values in item.overrides.items():
        raw.setdefault(section, {}).update(values)
    return raw


def _selected(item: Item, cells: list[Cell]) -> list[Cell]:
    return [c for c in cells if (not item.strategies or c.strategy in item.strategies)
            and (not item.ratios or _ratio(c) is None or _ratio(c) in item.ratios)]


def _ratio(cell: Cell) -> float | None:
    return cell.params.get("cache_ratio", cell.params.get("hot_ratio"))


def _device_name() -> str:
    import torch

    # (properties, not get_device_name: the launcher process opens no CUDA context; see launch.py)
    return torch.cuda.get_device_properties(0).name if torch.cuda.is_available() else "cpu"


def _record_device(record) -> str:
    gpus = ((record.provenance or {}).get("devices") or {}).get("gpus") or []
    return gpus[0]["name"] if gpus and record.metrics and str(record.metrics.get("device", "")).startswith("cuda") else "cpu"


def _summary(record) -> str:
    """A record in a few words: status, step time, hits, syncs, the loss check."""
    if record.status != "ok":
        return f"{record.status}: {(record.message or '')[:160]}"
    m = record.metrics
    parts = [f"ok, {1e3 * m['step_time_s']['median']:.2f} ms/step"]
    hit = (m.get("counters") or {}).get("hit_rate")
    if hit is not None:
        belady = (m.get("extra") or {}).get("belady_hit_rate")
        parts.append(f"hits {100 * hit:.1f} %" + (f" (Belady {100 * belady:.1f} %)" if belady is not None else ""))
    if m.get("host_syncs_per_step") is not None:
        parts.append(f"{m['host_syncs_per_step']:.1f} syncs/step")
    for key in ("train_loss_last10_diff_vs_baseline", "logloss_diff_vs_baseline"):
        if key in m:
            parts.append(f"{key.split('_diff')[0]} Δ {m[key]:.1e}")
    graph = (m.get("extra") or {}).get("cache_graph")
    if graph:
        parts.append(f"graph: {graph[:60]}")
    return ", ".join(parts)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_session.sh", description=__doc__.splitlines()[0])
    # A budget is a finite number: NaN would make every budget test false, and cells would start with none.
    parser.add_argument("seconds", type=positive_flag(float, zero=True), nargs="?",
                        help="device seconds left to this session (status's budget_left_s)")
    parser.add_argument("--plan", action="store_true", help="print the priority list with estimated device seconds; run nothing")
    parser.add_argument("--rehearse", action="store_true", help="the same sequence on the CPU at a tiny scale")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_session_out", help="where archives go ($OUT)")
    parser.add_argument("--work", default=os.environ.get("SESSION_DIR") or "/tmp/gpu_session", help="the run folders")
    parser.add_argument("--spent", type=positive_flag(float, zero=True), default=0.0,
                        help="seconds already spent (the install)")
    parser.add_argument("--install-note", default="", help="how the install went (the ledger's first line)")
    args = parser.parse_args(argv)
    if args.plan:
        print(plan_text())
        return 0
    if args.seconds is None:
        parser.error("give the seconds left (or --plan)")
    session = Session(args)
    session.archive()
    # The headlines first: a lease cut short still answers the question it was lent for; the CUDA
    # tests that say whether its numbers were made as intended (no host sync, graphs captured) next.
    headline, headline_tf32, *rest = priority_list()
    for item in [headline, headline_tf32, "CUDA tests", *rest]:
        if item == "CUDA tests":
            session.cuda_tests()
            continue
        if session.ledger.left() - RESERVE_SECONDS < (REHEARSAL_CELL_SECONDS if args.rehearse else 30):
            session.ledger.add(item.title, None, 0, SPENT)
            continue
        session.item(item)
    session.archive()
    print(session.ledger.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

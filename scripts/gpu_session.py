"""A lent GPU's quarter-hour, after scripts/gpu_session.sh installed the packages: the plan
(:func:`priority_list`) in two device calls of at most CALL_SECONDS each, the second started at
once: the headlines and the CUDA tests the CPU skips, then exactness, the row file, the update
kernel's gain, row precisions and the 1TB shape, each item within its budget.

Run through scripts/gpu_session.sh (see docs/gpu-matrix.md); ``--rehearse`` runs the same
plan on the CPU at a tiny scale. Every cell's record is archived into ``$OUT`` the moment
it exists (one tar, replaced whole, and the call's ledger), so a call cut short returns all that
finished. A cell is started only when its estimate fits in what is left of its item's budget and
of the call; records already committed under ``results/*/<run>/`` (same scenario, same device)
are reused by an item that is not ``fresh``, never rerun.
"""

from __future__ import annotations

import argparse
import io
import math
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
CUDA_TEST_NODES = [
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
    scenario: Path | None  # None: the CUDA tests
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
    #: another effective scenario, so another digest; give it its own ``run`` folder. A list
    #: (``strategies``) replaces the section: cells, not the digest
    overrides: dict = field(default_factory=dict)
    #: the device call (of at most CALL_SECONDS) it belongs to, and the seconds of that call it may
    #: use: a cell whose estimate exceeds what is left of either is not started
    call: int = 1
    budget_s: float = 60.0
    #: only the cells whose params hold these values (a cell without the param is kept)
    only: dict = field(default_factory=dict)
    #: device seconds of a cell of this item by strategy, where the Kaggle estimate is wrong for it
    seconds: dict = field(default_factory=dict)


#: The seconds of one device call (the run tool's limit per command).
CALL_SECONDS = 600
#: The install at the start of each call: the first installs (39 s on 2026-11-28), the second
#: finds the packages in /tmp/site on the warm machine.
INSTALL_SECONDS = {1: 45, 2: 5}
#: The CUDA tests' place in the plan (no scenario: :meth:`Session.cuda_tests`).
CUDA_TESTS_TITLE = "CUDA tests"
#: Cells of a deterministic Kaggle run (2026-11-28: device 322 ms a step, freqcache 519 ms).
EXACTNESS_SECONDS = {"device": 40, "freqcache": 70}


def priority_list() -> list[Item]:
    """The session: two device calls of at most CALL_SECONDS each, the second started at once
    on the warm machine (issue 47), each item with its share of its call. Call 1 answers the
    headline: every placement at its best beside ours, torchrec's all-in-HBM ``gpu_sharded``
    included, at fp32 and TF32 (every uvm_cache cell records its instruments' cost too: its
    step with its counting and without, ``metrics.instruments``), then the CUDA tests. Call 2:
    exactness (compiled, eager, and device's A/A), ``store: file`` against ``store: memory``,
    device's row update through torch against the kernel, row precisions, and the 1TB shape at
    dim 128 on a GPU that holds it (the launcher's preflight reads the free memory first)."""
    tf32 = MATRIX / "kaggle_headline_tf32.yaml"
    exactness = MATRIX / "kaggle_exactness.yaml"
    no_pipeline = {"prefetch_pipeline": False}  # 0.89x of the plain LRU cache on two leases
    return [
        Item("headline: Kaggle shape, cache 1.5 %", MATRIX / "kaggle_headline.yaml", "kaggle_alpha1.15",
             ("device", "gpu_sharded", "freqcache", "uvm_cache"), fresh=True, profile=True, call=1, budget_s=205,
             only=no_pipeline),
        # as H100 users train: the dense matmuls in TF32, where fp32's sgemm no longer hides the sparse part
        Item("headline in TF32: dense matmuls in TF32", tf32, "kaggle_headline_tf32",
             ("device", "gpu_sharded", "freqcache", "uvm_cache"), fresh=True, profile=True, call=1, budget_s=230,
             only=no_pipeline),
        Item(CUDA_TESTS_TITLE, None, "", call=1, budget_s=75),
        # full size, sums in a fixed order: freqcache's losses must equal device's exactly, with its
        # plan compiled and eager (the strategies are cells, not the digest: one folder)
        Item("exactness: freqcache compiled and eager against device, deterministic", exactness, "kaggle_exactness",
             fresh=True, call=2, budget_s=190, seconds=EXACTNESS_SECONDS,
             overrides={"strategies": [{"name": "device"},
                                       {"name": "freqcache", "params": {"cache_ratio": 0.015, "compile": ["auto", False]}}]}),
        # device against itself there: a difference is not float atomics
        Item("exactness A/A: device again, deterministic", exactness, "kaggle_exactness-aa", ("device",), fresh=True,
             against="kaggle_exactness", call=2, budget_s=45, seconds=EXACTNESS_SECONDS),
        # rows in a file behind host memory, beside the TF32 headline's freqcache (rows in memory):
        # the same digest, so the same folder and its show.txt
        Item("store: file against store: memory (TF32 headline's freqcache)", tf32, "kaggle_headline_tf32",
             ("freqcache",), fresh=True, call=2, budget_s=100, seconds={"freqcache": 90},
             overrides={"strategies": [{"name": "device"},
                                       {"name": "freqcache", "params": {"cache_ratio": 0.015, "store": "file"}}]}),
        # device's fixed-shape backward with torch's update of every padded entry: against the TF32
        # headline's device (the update kernel of the distinct rows), in one run
        Item("device, sparse_backward padded_torch (against the kernel)", tf32, "kaggle_headline_tf32-padded_torch",
             ("device",), fresh=True, against="kaggle_headline_tf32", call=2, budget_s=35,
             overrides={"run": {"sparse_backward": "padded_torch"}}),
        Item("row precision: device fp32, fp16, bf16", MATRIX / "row_precision.yaml", "row_precision", ("device",),
             call=2, budget_s=90, overrides={"run": {"row_precision": ["fp32", "fp16", "bf16"]}}),
        # 178M rows at dim 128: ~92 GB with the optimizer state, which an H200's 139 GiB holds
        Item("1TB shape at dim 128: device (all in HBM)", MATRIX / "criteo_1tb_dim128.yaml", "criteo_1tb_dim128",
             ("device",), call=2, budget_s=110),
    ]


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
    def __init__(self, args: argparse.Namespace, call: int = 1):
        self.rehearse = args.rehearse
        self.call = call
        #: the rehearsal's call is shorter than CALL_SECONDS: each item's budget shrinks with it
        self.scale = min(1.0, args.seconds / CALL_SECONDS) if args.rehearse else 1.0
        self._item_started, self._item_budget = time.monotonic(), math.inf
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
        whole, and the call's ledger beside it."""
        ledger = f"ledger-call{self.call}.txt"
        (self.work / ledger).write_text(self.ledger.text())
        shutil.copyfile(self.work / ledger, self.out / ledger)
        partial = self.out / ".session.tgz.part"
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(self.work, arcname="session", filter=lambda info: None if "/weights" in info.name else info)
        os.replace(partial, self.out / "session.tgz")

    # -- phases --------------------------------------------------------------------------------

    def left(self) -> float:
        """Seconds this item may still start work in: what is left of its budget and of the call."""
        item = self._item_budget - (time.monotonic() - self._item_started)
        return min(self.ledger.left() - RESERVE_SECONDS, item)

    def begin(self, item: Item) -> None:
        self._item_started, self._item_budget = time.monotonic(), item.budget_s * self.scale

    def cuda_tests(self) -> None:
        estimate = 20 if self.rehearse else 60  # 46 s on the H100 (2026-11-28)
        started = time.monotonic()
        done = self.work / "cuda_tests.txt"
        if done.exists():  # a second call of this session, on the same machine
            self.ledger.add("CUDA tests", None, 0, f"ran earlier in this session: {_last_line(done.read_text())}")
            return
        if estimate > self.left():
            self.ledger.add("CUDA tests", estimate, 0, f"not started: estimate {estimate} s > {self.left():.0f} s left")
            return
        try:
            import hypothesis  # noqa: F401
            import pytest  # noqa: F401
        except ImportError as e:
            self.ledger.add("CUDA tests", estimate, 0, f"not run: {e} (stage pytest and hypothesis: docs/gpu-matrix.md)")
            return
        limit = max(10, int(min(2 * estimate, self.left())))
        try:
            out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-k", "cuda", *CUDA_TEST_NODES],
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
            if estimate is not None and estimate > self.left():
                self.ledger.add(title, estimate, 0, f"not started: estimate {estimate:.0f} s > {self.left():.0f} s left")
                continue
            started = time.monotonic()
            record = self._run_cell(scenario, item, cell, cells, done, run_dir)
            used = time.monotonic() - started
            if record.status == "ok":
                done[cell.id] = record
                self.observed[item.run, cell.strategy] = used
                if cell.strategy == "freqcache":
                    self.compiled.add((item.run, cell.id))
            self.ledger.add(title, estimate, used, _summary(record) + _ratios(list(done.values()), record))
            self.archive()
        self._show(run_dir)
        if item.against:
            self._compare(self.work / item.against, run_dir)

    def _run_cell(self, scenario: Scenario, item: Item, cell: Cell, cells: list[Cell], done: dict, run_dir: Path):
        """One cell through launch.run_cells (the baseline's record first, for the loss check),
        under a time limit that ends it before the budget does."""
        limit = max(5.0, min(scenario.run.time_limit_s, self.ledger.left() - RESERVE_SECONDS))  # the call's end

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
        return estimate(scenario, cell, compiled=(item.run, cell.id) in self.compiled, item=item)

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


def estimate(scenario: Scenario, cell: Cell, compiled: bool = False, item: Item | None = None) -> float:
    """Device seconds of one cell on an H100 (before any was measured in this session): the
    item's own figure where it has one; a freqcache cell compiles its steps for its shape first
    unless this machine did already (or it does not compile)."""
    if item is not None and cell.strategy in item.seconds:
        return item.seconds[cell.strategy]
    seconds = KAGGLE_SECONDS.get(cell.strategy, 90) * SHAPE_FACTOR.get(scenario.data.preset, 1.0)
    compiles = cell.strategy == "freqcache" and cell.params.get("compile", "auto") is not False
    return seconds + (FIRST_COMPILE_SECONDS if compiles and not compiled else 0)


def plan_text() -> str:
    """The plan, call by call: each item's cells, estimated device seconds on a bare H100 and its
    budget (cells a GPU refuses count nothing), and each call's sum against CALL_SECONDS."""
    import torch

    from embbench.strategy import RuntimeEnv

    env, rows, seen = RuntimeEnv(torch.device("cuda")), [], set()
    for call in (1, 2):
        items = [item for item in priority_list() if item.call == call]
        rows.append(f"call {call} (at most {CALL_SECONDS} s; {RESERVE_SECONDS} s kept for the archive): install "
                    f"{INSTALL_SECONDS[call]} s, then")
        for item in items:
            if item.scenario is None:
                rows.append(f"  {item.title:<70} {'':>9} {60:>6.0f} s  budget {item.budget_s:>4.0f} s")
                continue
            scenario, cells = parse_scenario(_raw(item), str(item.scenario))
            cells = [c for c in _selected(item, cells) if (item.run, c.id) not in seen]
            seen.update((item.run, c.id) for c in cells)
            runnable = [c for c in cells if not c.make_strategy().unsupported_reason(env)]
            seconds = sum(estimate(scenario, c, item=item) for c in runnable)
            rows.append(f"  {item.title:<70} {len(runnable):>3} cells {seconds:>6.0f} s  budget {item.budget_s:>4.0f} s"
                        f"  ({item.scenario.name})")
        total = INSTALL_SECONDS[call] + sum(item.budget_s for item in items)
        rows.append(f"  {'budgets and install':<70} {'':>9} {'':>8}  total  {total:>4.0f} s")
    return "\n".join(rows)


def _raw(item: Item) -> dict:
    """The item's scenario file with its overrides (a list replaces its section)."""
    raw = yaml.safe_load(item.scenario.read_text())
    for section, values in item.overrides.items():
        if isinstance(values, list):
            raw[section] = values
        else:
            raw.setdefault(section, {}).update(values)
    return raw


def _selected(item: Item, cells: list[Cell]) -> list[Cell]:
    return [c for c in cells if (not item.strategies or c.strategy in item.strategies)
            and (not item.ratios or _ratio(c) is None or _ratio(c) in item.ratios)
            and all(c.params.get(k, v) == v for k, v in item.only.items())]


def _ratios(records: list, record) -> str:
    """A cell's speed against the run's baseline and against its fastest all-in-HBM cell
    (``, 0.93x device, 0.88x gpu_sharded@w1 (fastest all-in-HBM)``), as ``show`` gives them."""
    from embbench.columns import flat_rows

    if record.status != "ok":
        return ""
    row = next((r for r in flat_rows([*records, record]) if r["cell_id"] == record.cell_id), {})
    hbm = row.get("speedup_vs_hbm")
    parts = [f"{row['speedup']:.2f}x {record.baseline}" if row.get("speedup") else "",
             f"{hbm:.2f}x {row['fastest_hbm_cell']} (fastest all-in-HBM)" if hbm and hbm != row.get("speedup") else "",
             f"instruments {100 * row['instruments_cost_share']:+.1f} % counted (not timed)"
             if row.get("instruments_cost_share") is not None else ""]
    return "".join(f", {p}" for p in parts if p)


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
    parser.add_argument("--call", choices=["1", "2", "all"], default="1",
                        help="the device call of the plan (--plan shows both); all: both, each with SECONDS (a rehearsal)")
    args = parser.parse_args(argv)
    if args.plan:
        print(plan_text())
        return 0
    if args.seconds is None:
        parser.error("give the seconds left (or --plan)")
    for call in (1, 2) if args.call == "all" else (int(args.call),):
        run_call(args, call)
        args.spent, args.install_note = 0.0, ""  # (a rehearsal's second call installs nothing)
    return 0


def run_call(args: argparse.Namespace, call: int) -> None:
    """One device call's items in order, each within its budget and the call's seconds. The
    headlines first: a lease cut short still answers the question it was lent for; the CUDA
    tests that say whether its numbers were made as intended (no host sync, graphs captured) next."""
    session = Session(args, call)
    session.archive()
    for item in [item for item in priority_list() if item.call == call]:
        if session.ledger.left() - RESERVE_SECONDS < (REHEARSAL_CELL_SECONDS if args.rehearse else 30):
            session.ledger.add(item.title, None, 0, SPENT)
            continue
        session.begin(item)
        if item.scenario is None:
            session.cuda_tests()
        else:
            session.item(item)
    session.archive()
    print(session.ledger.text())


if __name__ == "__main__":
    sys.exit(main())

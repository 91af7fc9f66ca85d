"""How far a scenario's accuracy moves when its arithmetic changes in the last bit.

An exact strategy sums the same numbers as the baseline in another order (float atomics on
CUDA, another kernel): its losses differ from the baseline's by what the training amplifies a
last-bit difference to. This trains ``device`` on the CPU twice, the second time with its
initial embedding weights multiplied by ``1 + nudge * N(0, 1)`` (1e-7: about one float32 ulp),
and prints both runs' accuracy, the peak of the training loss and the differences.

    python benchmarks/accuracy_sensitivity.py scenarios/gpu_matrix/kaggle_headline.yaml \\
        --scale 0.003 --batch 4096 [--dense-lr 0.05] [--nudge 1e-7]

(2026-11-26, this command at the scenario's old dense lr 0.05: loss peak 1.7e6 at step 1,
log-loss moved 1.2e-2; at 0.001: no peak, 7.0e-5; docs/measurement.md.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from embbench import runner  # noqa: E402
from embbench.scenario import Cell, parse_scenario  # noqa: E402
from embbench.strategy import RuntimeEnv  # noqa: E402


def train_device(raw: dict, nudge: float) -> dict:
    """One ``device`` cell on the CPU; its initial embedding weights nudged by ``nudge``."""
    unnudged = runner.initial_weights

    def nudged(table, index, seed, start, stop):
        weights = unnudged(table, index, seed, start, stop)
        if not nudge:
            return weights
        noise = torch.randn(weights.shape, generator=torch.Generator().manual_seed(1234 + index + start))
        return weights * (1 + nudge * noise)

    runner.initial_weights = nudged
    try:
        scenario, _ = parse_scenario(raw, "accuracy_sensitivity")
        return runner.run_cell(scenario, Cell("device"), RuntimeEnv(torch.device("cpu")))["accuracy"]
    finally:
        runner.initial_weights = unnudged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", type=Path)
    parser.add_argument("--scale", type=float, default=0.003, help="data.scale (the tables' share of the preset)")
    parser.add_argument("--batch", type=int, default=4096, help="data.batch_size")
    parser.add_argument("--dense-lr", type=float, help="optimizer.dense.lr (default: the scenario's)")
    parser.add_argument("--nudge", type=float, default=1e-7, help="relative size of the nudge")
    args = parser.parse_args(argv)

    raw = yaml.safe_load(args.scenario.read_text())
    raw["data"].update(scale=args.scale, batch_size=args.batch)
    raw["run"].update(device="cpu", time_limit_s=36000, warmup_max_steps=None, compare_weights=False)
    if args.dense_lr is not None:
        raw["optimizer"]["dense"]["lr"] = args.dense_lr
    raw["strategies"], raw["baseline"] = [{"name": "device"}], "device"
    plain, nudged = train_device(raw, 0.0), train_device(raw, args.nudge)
    for name, a in (("as it is", plain), (f"nudged {args.nudge:g}", nudged)):
        print(f"{name:>14}: loss first {a['train_loss_first']:.4f}, peak {a['train_loss_peak']:.4g} at step "
              f"{a['train_loss_peak_step']}, last 10 {a['train_loss_last10']:.6f}, log-loss {a['logloss']:.6f}, "
              f"AUC {a['auc']:.4f}")
    print(f"{'moved by':>14}: last 10 {abs(plain['train_loss_last10'] - nudged['train_loss_last10']):.2e}, "
          f"log-loss {abs(plain['logloss'] - nudged['logloss']):.2e}, AUC {abs(plain['auc'] - nudged['auc']):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

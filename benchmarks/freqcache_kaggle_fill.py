"""How many training steps freqcache's slots take to fill at the Criteo-Kaggle shape (26 tables,
33.8M rows, batch 16384, 1.5 % cache, dim 128, rowwise Adagrad), on the CPU, without training:
the device planner driven as freqcache drives it (profile, preload, window entries, each batch
planned while the one before runs), its empty slots counted every few steps. The warm-up of a
Kaggle-shape GPU scenario (``run.warmup_max_steps``) must reach the step where none is left
(issue 47 item 5). Minutes on a 2-core CPU:

    .venv/bin/python benchmarks/freqcache_kaggle_fill.py [--steps 200] [--scale 1.0] [--out FILE.json]
"""

import argparse
import json
import math
import time

import torch

from embbench.cache.device_planner import DevicePlanner, cache_window
from embbench.data import Stream, SyntheticCriteo, make_tables
from embbench.embedding import RowSpace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--cache-ratio", type=float, default=0.015)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    started = time.time()
    tables = make_tables("criteo_kaggle", dim=128, scale=args.scale)
    space, data = RowSpace(tables), SyntheticCriteo(tables, seed=0)
    cpu = torch.device("cpu")
    batches: dict[int, torch.Tensor] = {}

    def rows(i: int) -> torch.Tensor:
        if i not in batches:
            batches[i] = space.global_rows(data.batch(Stream.TRAIN, i, args.batch).sparse)
        return batches[i]

    n, ids = space.num_rows, args.batch * sum(t.bag_size for t in tables)
    capacity = max(1, min(n, math.ceil(args.cache_ratio * n)))
    profiled = [rows(i) for i in range(32)]
    lookahead, window_rows = cache_window([len(r.unique()) for r in profiled], n, capacity, ids, (128 + 1) * 4, "auto")
    planner = DevicePlanner(n, capacity, ids, lookahead, cpu, "tinylfu", learn=True, decay_every=256,
                            window_rows=window_rows)
    planner.profile(profiled)
    del profiled
    numbers: dict[int, int] = {}
    running, empty = None, []
    for i in range(args.steps):
        for j in range(i + 1, i + 1 + lookahead):
            if j not in numbers:
                numbers[j] = planner.enter(rows(j))
        plan = planner.plan(rows(i), train=True, running=running, number=numbers.pop(i, None))
        running = plan.id
        batches.pop(i, None)
        if (i + 1) % args.every == 0:
            left = int((planner.slot_row[: planner.num_slots] == planner.empty_row).sum())
            empty.append([i + 1, left])
            print(f"step {i + 1}: {left:,} of {planner.num_slots:,} slots empty ({time.time() - started:.0f} s)",
                  flush=True)
            if left == 0:
                break
    result = {"scale": args.scale, "rows": n, "batch": args.batch, "ids": ids, "capacity": capacity,
              "slots": planner.num_slots, "lookahead": lookahead, "empty_slots_by_step": empty,
              "full_at_step": next((s for s, left in empty if left == 0), None),
              "seconds": round(time.time() - started)}
    print(json.dumps({k: v for k, v in result.items() if k != "empty_slots_by_step"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Memory given back, and what finding the model's runtime costs per call.

1. ``--rounds`` rounds of: build a reference DiT, compile it with ``backend="dlo"``, call
   it, drop it (``gc.collect()``). Prints the process RSS after each round and its growth
   after the first five rounds (warm-up), beside the model's own size: a runtime that
   outlived its model would grow RSS by about one model per round.
2. ``GraphSchedule.bind`` (one runtime lookup from the call's parameters): median of
   ``--repeats`` timings of 10,000 binds, as a ratio to the median compiled call.

    python benchmarks/bench_lifetime.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

import dlo_fx
from dlo_fx.apps.models import example_inputs, reference_dit
from dlo_fx.runtime import runtimes_holding


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rounds(n: int) -> tuple[int, list[int]]:
    inputs, rss, model_bytes = None, [], 0
    for i in range(n):
        model = reference_dit(width=256, depth=4, heads=4, seed=i, dtype=torch.float32)
        inputs = inputs or example_inputs(model.config, batch=1, height=8, width=8, seed=1)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        compiled = torch.compile(dlo_fx.offload(model, {"device": "cpu"}), backend="dlo")
        with torch.no_grad():
            compiled(*inputs)
        del model, compiled
        gc.collect()
        rss.append(rss_bytes())
    return model_bytes, rss


def bind_cost(repeats: int) -> tuple[float, float]:
    """(median seconds per bind, median seconds per compiled call)."""
    model = reference_dit(width=256, depth=4, heads=4, seed=0, dtype=torch.float32)
    inputs = example_inputs(model.config, batch=1, height=8, width=8, seed=1)
    compiled = torch.compile(dlo_fx.offload(model, {"device": "cpu"}), backend="dlo")
    with torch.no_grad():
        for _ in range(3):
            compiled(*inputs)
    params = list(model.parameters())
    runtime = runtimes_holding(params)[0]
    from dlo_fx.runtime import GraphSchedule

    sched = GraphSchedule(runtime, [0], [[]])
    binds, calls = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10_000):
            sched.bind(params)
        binds.append((time.perf_counter() - start) / 10_000)
        start = time.perf_counter()
        with torch.no_grad():
            compiled(*inputs)
        calls.append(time.perf_counter() - start)
    return statistics.median(binds), statistics.median(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model_bytes, rss = rounds(args.rounds)
    mib = 2 ** 20
    print(f"model: {model_bytes / mib:.1f} MiB of parameters")
    print("RSS after each round (MiB): " + " ".join(f"{r / mib:.0f}" for r in rss))
    growth = max(rss[5:]) - rss[4]
    print(f"RSS growth over rounds 6-{args.rounds}: {growth / mib:.1f} MiB "
          f"({growth / model_bytes:.2f} x the model)")
    bind, call = bind_cost(args.repeats)
    print(f"bind: {bind * 1e6:.2f} us (median of {args.repeats}); compiled call: "
          f"{call * 1e3:.2f} ms; ratio {bind / call:.2e}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Transfer-bound latency against the device budget (``device_budget``), on CPU.

One reference DiT (few tokens, so that copies weigh most) is compiled five times with a
budget of the minimum plus 0, 25, 50, 75 and 100% of its streamed bytes, and once
resident (``backend="eager"``). Every variant is called in turn in each repetition (see
benchmarks/_timing.py); the figures are medians over the repetitions after warm-up, with
the ratio to the resident model measured in the same run. Expected: latency falls
monotonically with the budget and is within 5% of the resident model at 100%. Beside
each measured median: the planner's predicted time per call, with its parts: the
streamed blocks' copies and every block's compute (FLOPs at the matmul rate measured at
compile time).

    python benchmarks/bench_budget.py             # width 768, depth 6, 9 repetitions
    python benchmarks/bench_budget.py --quick     # a smoke run in seconds
    python benchmarks/bench_budget.py --markdown  # also print the docs/benchmarks.md table
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import _timing as T  # noqa: E402

import dlo_fx  # noqa: E402
from dlo_fx.apps.models import example_inputs, reference_dit  # noqa: E402
from dlo_fx.runtime import reset_runtimes, runtimes_holding  # noqa: E402

FRACTIONS = (0, 25, 50, 75, 100)


def budget_sweep(width: int, depth: int, heads: int, hw: int, device: torch.device, *,
                 reps: int, warmup: int,
                 timer: Optional[Callable[[Callable[[], Any]], float]] = None,
                 fractions: tuple[int, ...] = FRACTIONS) -> dict:
    """Latency per budget (and resident), interleaved; shared with benchmarks/gpu_check.py."""
    torch._dynamo.reset()
    reset_runtimes()

    def model():
        return reference_dit(width=width, depth=depth, heads=heads, seed=0,
                             device=device).eval().requires_grad_(False)

    inputs = example_inputs(model().config, batch=1, height=hw, width=hw, seed=1,
                            device=device)
    probe = dlo_fx.offload(model(), {"device": device, "device_budget": 10**15})
    c = torch.compile(probe, backend="dlo")
    ref = c(*inputs)
    (plan,) = runtimes_holding(list(probe.parameters()))[0].budget_plans.values()
    total = sum(plan.block_bytes)
    variants: dict[str, Callable[[], Any]] = {}
    models, info = [], {}
    for f in fractions:
        budget = plan.minimum + total * f // 100
        m = dlo_fx.offload(model(), {"device": device, "device_budget": budget})
        compiled = torch.compile(m, backend="dlo")
        assert torch.equal(compiled(*inputs), ref), f"budget {f}%: output differs"
        report = dlo_fx.memory_report(m)
        info[f"{f}%"] = {"device_budget": budget, "resident_blocks": report.num_resident_blocks,
                         "streamed_bytes_per_call": report.streamed_bytes_per_call,
                         "predicted_s": report.predicted_s_per_call,
                         "predicted_copy_s": report.predicted_copy_s_per_call,
                         "predicted_compute_s": report.predicted_compute_s_per_call}
        models.append(m)
        variants[f"{f}%"] = (lambda cc: lambda: cc(*inputs))(compiled)
    resident = torch.compile(model(), backend="eager")
    assert torch.equal(resident(*inputs), ref)
    variants["resident"] = lambda: resident(*inputs)
    if timer is not None:  # a device: synchronise around each call
        orig = dict(variants)
        variants = {k: (lambda fn: lambda: timer(fn))(fn) for k, fn in orig.items()}
    s = T.interleaved(variants, reps=reps, warmup=warmup)
    rows = []
    for f in fractions:
        name = f"{f}%"
        rows.append({"budget": name, **info[name], "median_s": s.median(name),
                     "ratio_to_resident": s.paired_ratio(name, "resident")})
    medians = [r["median_s"] for r in rows]
    return {"blocks": len(plan.block_bytes), "streamed_bytes": total, "minimum": plan.minimum,
            "resident_median_s": s.median("resident"), "rows": rows, "reps": s.reps,
            "monotone": all(a >= b for a, b in zip(medians, medians[1:])),
            "full_within_5pct": rows[-1]["ratio_to_resident"] <= 1.05}


def markdown(result: dict) -> str:
    lines = ["| budget (of streamed bytes) | resident blocks | streamed B/call | median ms | "
             "/ resident | predicted ms | of which: copies ms | compute ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        lines.append(f"| {r['budget']} | {r['resident_blocks']} of {result['blocks']} | "
                     f"{r['streamed_bytes_per_call']:,} | {r['median_s'] * 1e3:.1f} | "
                     f"{r['ratio_to_resident']:.3f} | {r['predicted_s'] * 1e3:.1f} | "
                     f"{r['predicted_copy_s'] * 1e3:.1f} | {r['predicted_compute_s'] * 1e3:.1f} |")
    lines.append(f"| resident model | | | {result['resident_median_s'] * 1e3:.1f} | 1.000 | | | |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer repetitions")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", default="bench-out/budget.json")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: a core left for the copy thread)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    p = (dict(width=128, depth=4, heads=4, hw=4, reps=5, warmup=1) if args.quick else
         dict(width=768, depth=6, heads=8, hw=2, reps=9, warmup=2))
    if args.reps is not None:
        p["reps"] = args.reps
    with torch.inference_mode(), T.CpuLoad() as load:
        result = budget_sweep(device=torch.device("cpu"), **p)
    result.update(plan=p, machine=T.machine_info(), cpu_load=load.as_dict())
    for r in result["rows"]:
        print(f"{r['budget']:>5}: {r['resident_blocks']} resident blocks, "
              f"{r['median_s'] * 1e3:8.2f} ms  ({r['ratio_to_resident']:.3f} x resident, "
              f"predicted {r['predicted_s'] * 1e3:.2f} ms: copies "
              f"{r['predicted_copy_s'] * 1e3:.2f}, compute {r['predicted_compute_s'] * 1e3:.2f})")
    print(f"resident: {result['resident_median_s'] * 1e3:.2f} ms; median of {result['reps']} "
          f"after {p['warmup']} warm-up; monotone: {result['monotone']}; "
          f"100% within 5%: {result['full_within_5pct']}")
    if args.markdown:
        print(markdown(result))
    T.write_json(args.out, result)
    return 0 if result["monotone"] and result["full_within_5pct"] else 1


if __name__ == "__main__":
    sys.exit(main())

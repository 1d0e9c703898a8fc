#!/usr/bin/env python
"""Core CPU benchmark of the ``dlo`` torch.compile backend.

Five figures, each measured in one run of this script (see docs/benchmarks.md):

1. compute-bound   DLO / resident latency, reference DiT width 1024, ~1k tokens
2. transfer-bound  DLO latency / max(resident latency, copy time), same model, 24 tokens;
                   2b: the same with one core left to the copy thread (nproc - 1 threads)
3. overhead        (DLO - resident latency) / num_blocks on a model of many tiny blocks
4. slots           slot_bytes == num_slots x max_block_bytes, the same for 12 and 48 layers
5. compile         run_passes time on a 128-layer graph; dlo / eager compile time

Latencies are medians over repetitions that call the variants in turn (A B, B A, ...);
see benchmarks/_timing.py. "resident" is the same model (a separate instance with the
same seed, since dlo hollows the compiled model's parameters) compiled with
``backend="eager"``, so both sides pay Dynamo's guards and run the captured FX graph;
figure 3 also reports the plain eager module. Figures 3 and 5 run with one intra-op
thread (tiny ops; see the comments of fig_overhead and fig_compile).

    python benchmarks/bench_core.py            # full mode (about 5 min on 2 idle cores)
    python benchmarks/bench_core.py --quick    # smoke mode (< 60 s), smaller models
    python benchmarks/bench_core.py --markdown # also print the docs/benchmarks.md table
    python benchmarks/bench_core.py --wait-quiet 120   # shared machine: wait for quiet
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import _timing as T  # noqa: E402

import dlo_fx  # noqa: E402
import dlo_fx.dynamo.backend  # noqa: E402
import dlo_fx.passes  # noqa: E402
from dlo_fx.apps.models import (DiTConfig, ReferenceDiT, example_inputs,  # noqa: E402
                                 reference_dit)
from dlo_fx.runtime import reset_runtimes, runtimes_holding  # noqa: E402

# -- what each mode measures ----------------------------------------------------------------
FULL = {
    "compute": dict(width=1024, depth=12, heads=16, hw=64, reps=7, warmup=1),
    "transfer": dict(width=1024, depth=12, heads=16, hw=8, reps=15, warmup=2, reserve_core=True),
    "overhead": dict(width=64, depth=48, heads=4, hw=4, block_bytes=16384, reps=40, warmup=3,
                     threads=1),
    "slots": dict(width=512, heads=8, depths=(12, 48), hw=4),
    "compile": dict(width=64, depth=128, heads=4, hw=4, reps=5, steady=3, warm_depth=4,
                    threads=1),
}
QUICK = {
    "compute": dict(width=1024, depth=2, heads=16, hw=64, reps=5, warmup=1),
    "transfer": dict(width=1024, depth=2, heads=16, hw=8, reps=5, warmup=1, reserve_core=False),
    "overhead": dict(width=64, depth=12, heads=4, hw=4, block_bytes=16384, reps=10, warmup=2,
                     threads=1),
    "slots": dict(width=256, heads=4, depths=(4, 12), hw=4),
    "compile": dict(width=64, depth=16, heads=4, hw=4, reps=3, steady=2, warm_depth=2,
                    threads=1),
}
FIGURES = ("compute", "transfer", "overhead", "slots", "compile")


@dataclass
class Figure:
    key: str
    name: str
    target: str
    measured: str
    value: Optional[float]
    n: int
    passed: Optional[bool]
    setup: str
    details: dict = field(default_factory=dict)


# -- helpers ----------------------------------------------------------------------------------
def fresh() -> None:
    """Forget every compiled graph and runtime (host stores, slots, copy threads)."""
    torch._dynamo.reset()
    reset_runtimes()
    gc.collect()


def tokens(hw: int, text_len: int = 8, patch: int = 2) -> int:
    return (hw // patch) ** 2 + text_len


def build(p: dict, depth: Optional[int] = None):
    model = reference_dit(width=p["width"], depth=depth or p["depth"], heads=p["heads"], seed=0)
    inputs = example_inputs(model.config, batch=1, height=p["hw"], width=p["hw"], seed=0)
    return model, inputs


def dlo_runtime(model: torch.nn.Module):
    found = runtimes_holding(list(model.parameters()))
    if len(found) != 1:
        raise RuntimeError(f"expected one dlo runtime holding the model, found {len(found)}")
    return found[0]


def caller(fn: Callable, inputs: tuple) -> Callable[[], Any]:
    return lambda: fn(*inputs)


def model_desc(p: dict, depth: Optional[int] = None) -> str:
    return (f"reference DiT width {p['width']}, {depth or p['depth']} layers, bf16, "
            f"{tokens(p['hw'])} tokens")


def compile_pair(p: dict, dlo_options: Optional[dict] = None):
    """A resident model compiled with backend="eager" and an identical dlo-compiled one.

    Both are called once (that call compiles) before they are returned.
    """
    resident, inputs = build(p)
    streamed, _ = build(p)
    eager_c = torch.compile(resident, backend="eager")
    dlo_fx.offload(streamed, {"device": "cpu", **(dlo_options or {})})  # where the inputs are
    dlo_c = torch.compile(streamed, backend="dlo", options=dict(dlo_options or {}))
    ref = eager_c(*inputs)
    out = dlo_c(*inputs)
    max_diff = (out.float() - ref.float()).abs().max().item()
    return resident, streamed, eager_c, dlo_c, inputs, max_diff


@contextlib.contextmanager
def intra_op_threads(n: Optional[int]):
    """Run with ``torch.set_num_threads(n)`` (None: leave as is), restored afterwards."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def copier(rt) -> Callable[[], None]:
    """Every streamed byte once, host shard -> a slot-sized buffer, slots in turn: the
    copies of one call without the schedule."""
    blocks = list(rt.store.blocks)
    dsts = [torch.empty(rt.slots.slot_bytes, dtype=torch.uint8, device=rt.device)
            for _ in range(rt.slots.num_slots)]

    def copy_all() -> None:
        for i, b in enumerate(blocks):
            dsts[i % len(dsts)][: b.shard.numel()].copy_(b.shard)
    return copy_all


def predicted(p: dict, resident_s: float, copy_gbps: float) -> dict:
    """What `dlo_fx.plan` predicts for this figure's model and shapes on this machine, given
    the figure's own copy rate and a matmul rate fitted to its resident time (so what is
    predicted is what streaming adds), with copies beside compute only where the intra-op
    threads leave a core free ([Note: a copy lane of its own] in planning/budget.py). The
    model and inputs are built on the meta device: nothing is computed."""
    from dlo_fx.apps.plan import Hardware, cpu_copies_overlap

    with torch.device("meta"):  # built from its config, as `dlo-fx plan` builds a model
        model = ReferenceDiT(DiTConfig(width=p["width"], depth=p["depth"], heads=p["heads"]))
    inputs = tuple(t.to("meta") for t in example_inputs(model.config, batch=1, height=p["hw"],
                                                         width=p["hw"], seed=0))
    overlap = cpu_copies_overlap()

    def planned(rate: float):
        hw = Hardware("this CPU", h2d_gbps=copy_gbps, gather_gbps=copy_gbps,
                      flops_per_s={"bfloat16": rate, "float32": rate},
                      memory_bytes=64 * 2**30, copies_overlap=overlap)
        return dlo_fx.plan(model, inputs, hardware=hw, options={"device_budget": None})

    flops = sum(planned(1e12).flops)
    plan = planned(flops / resident_s)
    return {"predicted_s": plan.predicted_step_s, "fitted_flops_per_s": flops / resident_s,
            "copies_overlap": overlap, "bound": plan.bound}


def prediction_text(measured_s: float, pred: dict) -> str:
    return (f"; plan predicts {ms(pred['predicted_s'])} (measured / predicted "
            f"{measured_s / pred['predicted_s']:.3f}, copies "
            f"{'beside' if pred['copies_overlap'] else 'in turn with'} compute)")


# -- figure 1: compute-bound ------------------------------------------------------------------
def fig_compute(p: dict) -> list[Figure]:
    fresh()
    resident, streamed, eager_c, dlo_c, inputs, max_diff = compile_pair(p)
    report = dlo_fx.memory_report(streamed)
    with T.CpuLoad() as load:
        s = T.interleaved({"resident": caller(eager_c, inputs), "dlo": caller(dlo_c, inputs)},
                          reps=p["reps"], warmup=p["warmup"])
    ratio = s.median("dlo") / s.median("resident")
    rt = dlo_runtime(streamed)
    copy_all = copier(rt)
    streamed_bytes = sum(b.shard.numel() for b in rt.store.blocks)
    copy = T.interleaved({"copy": copy_all}, reps=5, warmup=1)
    pred = predicted(p, s.median("resident"), streamed_bytes / copy.median("copy") / 1e9)
    del resident, streamed, eager_c, dlo_c, rt, copy_all
    fresh()
    return [Figure(
        key="1", name="compute-bound: DLO / resident latency",
        target="<= 1.05", measured=f"{ratio:.3f} ({ms(s.median('dlo'))} / "
                                   f"{ms(s.median('resident'))})"
                                   + prediction_text(s.median("dlo"), pred),
        value=ratio, n=s.reps, passed=ratio <= 1.05,
        setup=f"{model_desc(p)}, {report.num_blocks} blocks, num_slots={report.num_slots}",
        details={"samples": s.summary(), "paired_ratio": s.paired_ratio("dlo", "resident"),
                 "num_blocks": report.num_blocks, "max_abs_diff_vs_resident": max_diff,
                 "plan": pred, "cpu_load": load.as_dict()})]


# -- figure 2: transfer-bound -----------------------------------------------------------------
def fig_transfer(p: dict) -> list[Figure]:
    figs = _transfer(p, key="2", threads=None)
    nproc = T.machine_info()["nproc"] or 1
    if p.get("reserve_core") and nproc > 1:
        figs += _transfer(p, key="2b", threads=nproc - 1)
    return figs


def _transfer(p: dict, *, key: str, threads: Optional[int]) -> list[Figure]:
    with intra_op_threads(threads):
        return _transfer_run(p, key=key)


def _transfer_run(p: dict, *, key: str) -> list[Figure]:
    fresh()
    resident, streamed, eager_c, dlo_c, inputs, max_diff = compile_pair(p)
    report = dlo_fx.memory_report(streamed)
    rt = dlo_runtime(streamed)
    blocks = list(rt.store.blocks)
    copy_all = copier(rt)
    copies0 = rt.machine.copies
    with T.CpuLoad() as load:
        s = T.interleaved({"resident": caller(eager_c, inputs), "dlo": caller(dlo_c, inputs),
                           "copy": copy_all}, reps=p["reps"], warmup=p["warmup"])
    calls = p["reps"] + p["warmup"]
    copies_per_call = (rt.machine.copies - copies0) / calls
    bound = max(s.median("resident"), s.median("copy"))
    ratio = s.median("dlo") / bound
    streamed_bytes = sum(b.shard.numel() for b in blocks)
    copy_gbs = streamed_bytes / s.median("copy") / 1e9
    pred = predicted(p, s.median("resident"), copy_gbs)
    del resident, streamed, eager_c, dlo_c, rt, blocks, copy_all
    fresh()
    threads = torch.get_num_threads()
    name = "transfer-bound: DLO / max(resident, copy)"
    if key != "2":
        name += f", torch.set_num_threads({threads}) (a core left for the copy thread)"
    return [Figure(
        key=key, name=name, target="<= 1.25",
        measured=f"{ratio:.3f} ({ms(s.median('dlo'))} / max({ms(s.median('resident'))}, "
                 f"copy {ms(s.median('copy'))}))" + prediction_text(s.median("dlo"), pred),
        value=ratio, n=s.reps, passed=ratio <= 1.25,
        setup=(f"{model_desc(p)}, {report.num_blocks} blocks, "
               f"{streamed_bytes / 2**20:.0f} MiB streamed per call ({copy_gbs:.1f} GB/s copy), "
               f"{threads} intra-op thread(s)"),
        details={"intra_op_threads": threads, "samples": s.summary(),
                 "streamed_bytes": streamed_bytes,
                 "copy_GBps": copy_gbs, "copies_per_call": copies_per_call,
                 "num_blocks": report.num_blocks, "max_abs_diff_vs_resident": max_diff,
                 "plan": pred, "cpu_load": load.as_dict()})]


# -- figure 3: per-block runtime overhead -----------------------------------------------------
def fig_overhead(p: dict) -> list[Figure]:
    # One intra-op thread by default: the ops of a width-64 model are far too small to gain
    # from two, and a parallel region's barrier makes tiny-op latency explode (tens of x)
    # as soon as another process takes a core, which would bury the microseconds measured.
    with intra_op_threads(p.get("threads")):
        return _overhead(p)


def _overhead(p: dict) -> list[Figure]:
    fresh()
    opts = {"block_bytes": p["block_bytes"]}
    resident, streamed, eager_c, dlo_c, inputs, max_diff = compile_pair(p, opts)
    report = dlo_fx.memory_report(streamed)
    rt = dlo_runtime(streamed)
    nb = report.num_blocks
    copies0 = rt.machine.copies
    with T.CpuLoad() as load:
        s = T.interleaved({"eager": caller(resident, inputs),
                           "compiled_eager": caller(eager_c, inputs),
                           "dlo": caller(dlo_c, inputs)}, reps=p["reps"], warmup=p["warmup"])
    copies_per_call = (rt.machine.copies - copies0) / (p["reps"] + p["warmup"])
    setup = (f"{model_desc(p)}, block_bytes={p['block_bytes']}: {nb} blocks "
             f"(max {report.max_block_bytes} B), {copies_per_call:.0f} copies per call, "
             f"{torch.get_num_threads()} intra-op thread(s)")
    figs = []
    for key, base, label in (("3a", "eager", "eager module"),
                             ("3b", "compiled_eager", "torch.compile(backend=\"eager\")")):
        per_block = (s.median("dlo") - s.median(base)) / nb
        paired = T.median([(d - b) / nb for d, b in zip(s.times["dlo"], s.times[base])])
        figs.append(Figure(
            key=key, name=f"overhead per block vs {label}", target="<= 50 us",
            measured=(f"{per_block * 1e6:.1f} us (({ms(s.median('dlo'))} - "
                      f"{ms(s.median(base))}) / {nb})"),
            value=per_block * 1e6, n=s.reps, passed=per_block * 1e6 <= 50, setup=setup,
            details={"samples": s.summary(), "paired_us_per_block": paired * 1e6,
                     "num_blocks": nb, "copies_per_call": copies_per_call,
                     "max_abs_diff_vs_resident": max_diff, "cpu_load": load.as_dict()}))
    del resident, streamed, eager_c, dlo_c, rt
    fresh()
    return figs


# -- figure 4: slot memory independent of depth -----------------------------------------------
def fig_slots(p: dict) -> list[Figure]:
    rows = {}
    for depth in p["depths"]:
        fresh()
        model, inputs = build(p, depth)
        torch.compile(dlo_fx.offload(model, {"device": "cpu"}), backend="dlo")(*inputs)
        r = dlo_fx.memory_report(model)
        rows[depth] = {"num_blocks": r.num_blocks, "num_slots": r.num_slots,
                       "max_block_bytes": r.max_block_bytes, "slot_bytes": r.slot_bytes,
                       "host_shard_bytes": r.host_shard_bytes, "resident_bytes": r.resident_bytes}
        del model
    fresh()
    exact = all(r["slot_bytes"] == r["num_slots"] * r["max_block_bytes"] for r in rows.values())
    same = len({r["slot_bytes"] for r in rows.values()}) == 1
    d0, d1 = p["depths"]
    r0, r1 = rows[d0], rows[d1]
    measured = (f"{d0} layers: {r0['num_slots']} x {r0['max_block_bytes']:,} = "
                f"{r0['slot_bytes']:,} B; {d1} layers: {r1['num_slots']} x "
                f"{r1['max_block_bytes']:,} = {r1['slot_bytes']:,} B")
    return [Figure(
        key="4", name=f"slot_bytes == num_slots x max_block_bytes, same for {d0} and {d1} layers",
        target="equal", measured=measured, value=float(r1["slot_bytes"]), n=1,
        passed=exact and same,
        setup=(f"reference DiT width {p['width']}, {d0} and {d1} layers, bf16, "
               f"{tokens(p['hw'])} tokens, one call each "
               f"(host store {r0['host_shard_bytes'] / 2**20:.0f} / "
               f"{r1['host_shard_bytes'] / 2**20:.0f} MiB)"),
        details={"by_depth": rows, "exact": exact, "same_across_depths": same})]


# -- figure 5: pass pipeline and compile time -------------------------------------------------
@contextlib.contextmanager
def timed_passes(log: list):
    """Time every ``run_passes`` call the dlo backend makes, and each pass inside it."""
    orig_run, orig_pipeline = dlo_fx.dynamo.backend.run_passes, dlo_fx.passes.PIPELINE

    def wrap_pass(fn):
        @functools.wraps(fn)
        def timed(gm, ctx):
            t = time.perf_counter()
            try:
                return fn(gm, ctx)
            finally:
                log[-1]["passes"][fn.__name__] = (log[-1]["passes"].get(fn.__name__, 0.0)
                                                  + time.perf_counter() - t)
        return timed

    @functools.wraps(orig_run)
    def run_passes(gm, ctx, *args, **kw):
        log.append({"passes": {}, "nodes_in": len(gm.graph.nodes)})
        t = time.perf_counter()
        out = orig_run(gm, ctx, *args, **kw)
        log[-1]["total_s"] = time.perf_counter() - t
        log[-1]["nodes_out"] = len(out.graph.nodes)
        log[-1]["blocks"] = len(ctx.blocks)
        return out

    dlo_fx.dynamo.backend.run_passes = run_passes
    dlo_fx.passes.PIPELINE = tuple(wrap_pass(f) for f in orig_pipeline)
    try:
        yield
    finally:
        dlo_fx.dynamo.backend.run_passes = orig_run
        dlo_fx.passes.PIPELINE = orig_pipeline


def compile_once(p: dict, backend: str, depth: int, steady: int) -> dict:
    """First-call latency minus the median steady-state call, for a fresh model."""
    fresh()
    model, inputs = build(p, depth)
    if backend == "dlo":
        dlo_fx.offload(model, {"device": "cpu"})  # where the inputs are
    compiled = torch.compile(model, backend=backend)
    gc.collect()
    first = T.timed_call(caller(compiled, inputs))
    steady_s = T.median([T.timed_call(caller(compiled, inputs)) for _ in range(steady)])
    del compiled, model
    return {"first_s": first, "steady_s": steady_s, "compile_s": first - steady_s}


def fig_compile(p: dict) -> list[Figure]:
    # One intra-op thread by default, as in figure 3: compiling is single-threaded Python,
    # and the steady call subtracted from the first one (10k tiny ops) would otherwise take
    # 0.05 s or 7 s depending on whether another process holds a core (OpenMP barriers).
    with intra_op_threads(p.get("threads")):
        return _compile(p)


def _compile(p: dict) -> list[Figure]:
    log: list = []
    runs: dict[str, list[dict]] = {"eager": [], "dlo": []}
    with timed_passes(log), T.CpuLoad() as load:
        for backend in runs:  # warm-up: one-time imports and lazy initialisation
            compile_once(p, backend, p["warm_depth"], 1)
        del log[:]
        for rep in range(p["reps"]):
            order = list(runs)[::-1] if rep % 2 else list(runs)
            for backend in order:
                runs[backend].append(compile_once(p, backend, p["depth"], p["steady"]))
    fresh()
    graphs_per_compile = len(log) / p["reps"]
    pass_s = [e["total_s"] for e in log]
    per_pass = {name: T.median([e["passes"].get(name, 0.0) for e in log])
                for name in log[0]["passes"]} if log else {}
    comp = {b: T.median([r["compile_s"] for r in v]) for b, v in runs.items()}
    ratio = comp["dlo"] / comp["eager"]
    setup = (f"reference DiT width {p['width']}, {p['depth']} layers, bf16, "
             f"{tokens(p['hw'])} tokens, {torch.get_num_threads()} intra-op thread(s); "
             f"{graphs_per_compile:g} graph(s) per compile, "
             f"{log[0]['nodes_in']} -> {log[0]['nodes_out']} nodes, {log[0]['blocks']} blocks")
    pass_med = T.median(pass_s)
    return [
        Figure(key="5a", name=f"run_passes time, {p['depth']}-layer graph", target="<= 1 s",
               measured=f"{pass_med:.3f} s", value=pass_med, n=len(pass_s),
               passed=pass_med <= 1.0, setup=setup,
               details={"run_passes_s": pass_s, "per_pass_median_s": per_pass,
                        "graphs": log, "cpu_load": load.as_dict()}),
        Figure(key="5b", name="compile time dlo / eager (first call - steady call)",
               target="<= 1.3",
               measured=f"{ratio:.3f} ({comp['dlo']:.2f} s / {comp['eager']:.2f} s)",
               value=ratio, n=p["reps"], passed=ratio <= 1.3, setup=setup,
               details={"runs": runs, "median_compile_s": comp,
                        "paired_ratio": T.median([d["compile_s"] / e["compile_s"] for d, e in
                                                  zip(runs["dlo"], runs["eager"])]),
                        "cpu_load": load.as_dict()}),
    ]


RUNNERS: dict[str, Callable[[dict], list[Figure]]] = {
    "compute": fig_compute, "transfer": fig_transfer, "overhead": fig_overhead,
    "slots": fig_slots, "compile": fig_compile,
}


# -- output -----------------------------------------------------------------------------------
def verdict(f: Figure) -> str:
    return "n/a" if f.passed is None else ("pass" if f.passed else "FAIL")


def text_table(figs: list[Figure]) -> str:
    rows = [("#", "figure", "target", "measured", "N", "")]
    rows += [(f.key, f.name, f.target, f.measured, str(f.n), verdict(f)) for f in figs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def other_cores(f: Figure) -> str:
    load = f.details.get("cpu_load", {}).get("other_cores")
    return "-" if load is None else f"{load:.2f}"


def markdown(figs: list[Figure], result: dict) -> str:
    m = result["machine"]
    waited = result.get("waited_s", 0.0)
    lines = [
        f"Machine: {m['nproc']} CPUs ({T.cpu_text(m)}), torch {m['torch']} "
        f"({m['torch_threads']} intra-op threads, {m['torch_parallel']}), "
        f"Python {m['python']}; dlo_fx at {result['source']['commit']}"
        + (" (with uncommitted changes)" if result["source"]["dlo_fx_dirty"] else "") + ".",
        f"Command: `{result['command']}` ({result['mode']} mode, "
        f"{result['elapsed_s'] - waited:.0f} s measuring"
        + (f" + {waited:.0f} s waiting for a quiet machine" if waited else "")
        + f"; load average at start {', '.join(f'{x:.2f}' for x in (m['loadavg'] or ()))}).",
        "",
        "| # | figure | setup | target | measured | median of N | other cores busy | result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in figs:
        lines.append(f"| {f.key} | {f.name} | {f.setup} | {f.target} | {f.measured} | "
                     f"{f.n} | {other_cores(f)} | {verdict(f)} |")
    lines += ["", "\"other cores busy\": CPU time other processes used while the figure was "
              "timed, in cores (from /proc/stat, this process's own time subtracted)."]
    return "\n".join(lines)


def source_info() -> dict:
    """The commit benchmarked and whether dlo_fx/ had uncommitted changes."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*a: str) -> Optional[str]:
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--", "dlo_fx")
    return {"commit": git("rev-parse", "--short", "HEAD"), "dlo_fx_dirty": bool(status),
            "dlo_fx_version": dlo_fx.__version__}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke mode: smaller models and fewer repetitions (< 60 s)")
    ap.add_argument("--out", default="bench-out/core.json", help="JSON output path")
    ap.add_argument("--markdown", action="store_true",
                    help="also print the table as Markdown (for docs/benchmarks.md)")
    ap.add_argument("--only", nargs="+", choices=FIGURES, default=list(FIGURES),
                    help="run only these figures")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="before each figure, wait up to SECONDS until other processes use "
                         "less than 0.3 cores (for shared machines); default 0: do not wait")
    ap.add_argument("--reps", type=int, default=None,
                    help="override the number of timed repetitions of every figure")
    args = ap.parse_args(argv)

    plan = {k: dict(v) for k, v in (QUICK if args.quick else FULL).items()}
    if args.reps is not None:
        for v in plan.values():
            if "reps" in v:
                v["reps"] = args.reps
    command = "python benchmarks/bench_core.py" + (" --quick" if args.quick else "")
    if args.only != list(FIGURES):
        command += " --only " + " ".join(args.only)
    if args.reps is not None:
        command += f" --reps {args.reps}"
    if args.wait_quiet > 0:
        command += f" --wait-quiet {args.wait_quiet:g}"
    result: dict[str, Any] = {"mode": "quick" if args.quick else "full", "command": command,
                              "machine": T.machine_info(), "source": source_info(), "plan": plan}
    start = time.perf_counter()
    figs: list[Figure] = []
    timings: dict[str, float] = {}
    quiet: dict[str, Optional[float]] = {}
    waited = 0.0
    with torch.inference_mode():
        for name in args.only:
            if args.wait_quiet > 0:
                w = time.perf_counter()
                quiet[name] = T.wait_quiet(args.wait_quiet, log=lambda msg: print(
                    f"[bench_core] {msg}", file=sys.stderr, flush=True))
                waited += time.perf_counter() - w
            t = time.perf_counter()
            print(f"[bench_core] {name} ...", file=sys.stderr, flush=True)
            figs += RUNNERS[name](plan[name])
            timings[name] = time.perf_counter() - t
            print(f"[bench_core] {name} done in {timings[name]:.1f} s", file=sys.stderr,
                  flush=True)
    result["elapsed_s"] = time.perf_counter() - start
    result["figure_elapsed_s"] = timings
    result["other_cores_before_figure"] = quiet
    result["waited_s"] = waited
    result["machine"]["loadavg_end"] = T._loadavg()
    result["figures"] = [asdict(f) for f in figs]
    result["all_passed"] = all(f.passed for f in figs if f.passed is not None)
    result["markdown"] = markdown(figs, result)

    print(text_table(figs))
    print(f"\n{'quick' if args.quick else 'full'} mode, {result['elapsed_s']:.0f} s; "
          f"JSON: {args.out}")
    if args.markdown:
        print("\n" + result["markdown"])
    if args.out:
        T.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One command that proves the device path: bit-identity, flat weight memory, latency
ratios, diffusers group offloading side by side, and no host syncs in steady state.

    python benchmarks/gpu_check.py                 # on the accelerator (< 8 minutes)
    python benchmarks/gpu_check.py --device cpu    # the same checks, tiny, in seconds

Prints a table and writes JSON (``--out``). Every figure is measured in this run; latency
ratios are medians of ``--runs`` timed runs after warm-up, variants interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
from _timing import write_json

import dlo_fx
from dlo_fx.apps.models import ReferenceDiT, example_inputs, reference_dit
from dlo_fx.runtime import platform
from dlo_fx.runtime.owners import reset_runtimes, runtimes_holding


def sizes(device: torch.device, quick: bool) -> dict:
    # CPU or --quick: every path, at the least depth that streams, every other budget
    if device.type == "cpu" or quick:
        return dict(small=(64, 2, 4), big=(128, 3, 4), depths=(2, 4), width_mem=64,
                    compute_hw=16, transfer_hw=4, runs=3, budget_stride=2)
    # ~1.2 B parameters at width 2048 x 16 layers (18 w^2 per layer), bf16
    return dict(small=(256, 4, 4), big=(2048, 16, 16), depths=(12, 48), width_mem=1024,
                compute_hw=128, transfer_hw=32, runs=5, budget_stride=1)


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        platform.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def fresh() -> None:
    torch._dynamo.reset()
    reset_runtimes()


def streamed(width: int, depth: int, heads: int, device: torch.device, options: dict):
    """A reference DiT whose weights live in a dlo host store for ``device``."""
    options = {"device": str(device), **options}
    if device.type == "cpu" and not VIA_LOAD:
        model = reference_dit(width=width, depth=depth, heads=heads)
        return torch.compile(model, backend="dlo", options=options, fullgraph=True), model
    from safetensors.torch import save_file

    source = reference_dit(width=width, depth=depth, heads=heads)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_file({k: v.contiguous() for k, v in source.state_dict().items()}, path)
        del source
        model = dlo_fx.load(lambda: ReferenceDiT(width=width, depth=depth, heads=heads),
                            path, options=options)
    return torch.compile(model, backend="dlo", options=options, fullgraph=True), model


def resident(width: int, depth: int, heads: int, device: torch.device):
    model = reference_dit(width=width, depth=depth, heads=heads).to(device)
    return torch.compile(model, backend="eager", fullgraph=True), model


def check_identity(cfg: dict, device: torch.device) -> dict:
    out = {}
    for label in ("small", "big"):
        fresh()
        w, d, h = cfg[label]
        ref_fn, ref_model = resident(w, d, h, device)
        inputs = [t.to(device) for t in example_inputs(ref_model.config, height=8, width=8)]
        with torch.inference_mode():
            ref = ref_fn(*inputs)
            del ref_fn, ref_model
            fn, _ = streamed(w, d, h, device, {})
            out[f"dit_{label}_w{w}_d{d}"] = all(torch.equal(fn(*inputs), ref) for _ in range(2))
    try:
        import diffusers  # noqa: F401  (tiny_wan needs it)

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from models import call, tiny_wan

        fresh()
        ref_model, inputs = tiny_wan()
        ref_model = ref_model.to(device)
        inputs = tuple(t.to(device) for t in inputs)
        with torch.inference_mode():
            ref = call(ref_model, inputs)
            model, _ = tiny_wan()
            if device.type != "cpu":
                model = model.to(device)  # fits: the small config is resident-sized
            fn = torch.compile(model, backend="dlo", options={"device": str(device)})
            out["wan_small"] = all(torch.equal(call(fn, inputs), ref) for _ in range(2))
    except ImportError as exc:
        out["wan_small"] = f"skipped: {exc}"
    return out


def check_memory(cfg: dict, device: torch.device) -> dict:
    out = {}
    for depth in cfg["depths"]:
        fresh()
        fn, model = streamed(cfg["width_mem"], depth, 8, device, {})
        inputs = [t.to(device) for t in example_inputs(model.config, height=8, width=8)]
        with torch.inference_mode():
            fn(*inputs)
            if device.type != "cpu":
                torch.get_device_module(device).reset_peak_memory_stats(device)
            fn(*inputs)
        report = dlo_fx.memory_report(model)
        weights = report.resident_bytes + report.slot_bytes
        peak = platform.max_memory_allocated(device)
        out[f"depth_{depth}"] = {
            "slot_bytes": report.slot_bytes, "max_block_bytes": report.max_block_bytes,
            "resident_bytes": report.resident_bytes, "weights_on_device": weights,
            "peak_allocated": peak,
            "activations_and_workspace": None if peak is None else peak - weights,
        }
    a, b = (out[f"depth_{d}"] for d in cfg["depths"])
    out["weights_flat_in_depth"] = a["weights_on_device"] == b["weights_on_device"]
    return out


def h2d_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Pinned host-to-device bytes per second, with the probe ``mode="auto"`` uses."""
    from dlo_fx.runtime.probes import probe_bandwidths
    from dlo_fx.runtime.collectives import ShardGroup

    return probe_bandwidths(device, ShardGroup(ranks=(0,), rank=0), nbytes)[0] * 1e9


def check_latency(cfg: dict, device: torch.device) -> dict:
    w, d, h = cfg["big"]
    out = {}
    bandwidth = h2d_bandwidth(device)
    out["h2d_GBps"] = bandwidth / 1e9
    for label, hw in (("compute_bound", cfg["compute_hw"]), ("transfer_bound", cfg["transfer_hw"])):
        fresh()
        ref_fn, ref_model = resident(w, d, h, device)
        fn, model = streamed(w, d, h, device, {})
        inputs = [t.to(device) for t in example_inputs(ref_model.config, height=hw, width=hw)]
        times = {"dlo": [], "resident": []}
        with torch.inference_mode():
            fn(*inputs), ref_fn(*inputs)  # warm-up
            for _ in range(cfg["runs"]):
                times["dlo"].append(timed(lambda: fn(*inputs), device))
                times["resident"].append(timed(lambda: ref_fn(*inputs), device))
        runtime = runtimes_holding(list(model.parameters()))[0]
        streamed_bytes = sum(b.slot_bytes for b in runtime.store.blocks)
        dlo_s, res_s = (statistics.median(times[k]) for k in ("dlo", "resident"))
        floor = streamed_bytes / bandwidth
        out[label] = {"tokens": (hw // 2) ** 2, "dlo_ms": dlo_s * 1e3, "resident_ms": res_s * 1e3,
                      "dlo_over_resident": dlo_s / res_s, "h2d_floor_ms": floor * 1e3,
                      "dlo_over_h2d_floor": dlo_s / floor}
        del ref_fn, ref_model
    return out


def check_group_offload(cfg: dict, device: torch.device) -> dict:
    if device.type == "cpu":
        return {"skipped": "diffusers group offloading streams need an accelerator"}
    from diffusers.hooks import apply_group_offloading

    w, d, h = cfg["big"]
    out = {}
    fresh()
    offloaded = reference_dit(width=w, depth=d, heads=h)
    apply_group_offloading(offloaded, onload_device=device, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    fn, model = streamed(w, d, h, device, {})
    inputs = [t.to(device) for t in example_inputs(model.config, height=cfg["transfer_hw"],
                                                   width=cfg["transfer_hw"])]
    module = torch.get_device_module(device)
    for label, run in (("group_offload", lambda: offloaded(*inputs)), ("dlo", lambda: fn(*inputs))):
        with torch.inference_mode():
            run()
            module.reset_peak_memory_stats(device)
            times = [timed(run, device) for _ in range(cfg["runs"])]
        out[label] = {"ms": statistics.median(times) * 1e3,
                      "peak_allocated": platform.max_memory_allocated(device)}
    out["dlo_over_group_offload"] = out["dlo"]["ms"] / out["group_offload"]["ms"]
    return out


def check_no_sync(cfg: dict, device: torch.device) -> dict:
    if device.type == "cpu":
        return {"skipped": "no host-device syncs exist on CPU"}
    fresh()
    w, d, h = cfg["small"]
    fn, model = streamed(w, d, h, device, {})
    inputs = [t.to(device) for t in example_inputs(model.config, height=8, width=8)]
    with torch.inference_mode():
        fn(*inputs)
        fn(*inputs)
        try:
            with platform.sync_debug(device, "error"):
                fn(*inputs)
            return {"steady_state_syncs": 0}
        except RuntimeError as exc:
            return {"steady_state_syncs": "found", "error": str(exc)[:300]}


def check_budget(cfg: dict, device: torch.device) -> dict:
    """Transfer-bound latency against ``device_budget`` (minimum + 0..100% of the streamed
    bytes), interleaved, medians after warm-up (the sweep of benchmarks/bench_budget.py)."""
    from bench_budget import FRACTIONS, budget_sweep

    w, d, h = cfg["big"]
    with torch.inference_mode():
        return budget_sweep(w, d, h, cfg["transfer_hw"], device, reps=cfg["runs"], warmup=1,
                            timer=lambda fn: timed(fn, device),
                            fractions=FRACTIONS[::cfg["budget_stride"]])


VIA_LOAD = False  # --via-load: the accelerator's path (dlo_fx.load) on any device

CHECKS = {"identity": check_identity, "memory": check_memory, "latency": check_latency,
          "group_offload": check_group_offload, "no_sync": check_no_sync,
          "budget": check_budget}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=str(platform.default_device()))
    parser.add_argument("--out", default="bench-out/gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes on any device")
    parser.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks")
    parser.add_argument("--via-load", action="store_true",
                        help="load streamed models with dlo_fx.load even on CPU")
    args = parser.parse_args(argv)
    global VIA_LOAD
    VIA_LOAD = args.via_load or VIA_LOAD
    device = torch.device(args.device)
    cfg = sizes(device, args.quick)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": str(device),
        "device_name": (torch.get_device_module(device).get_device_name(device)
                        if device.type != "cpu" else "cpu"),
    }
    failed = False
    for name in args.only.split(","):
        start = time.perf_counter()
        try:
            result[name] = CHECKS[name](cfg, device)
        except Exception:
            result[name] = {"error": traceback.format_exc()[-2000:]}
            failed = True
        result[name + "_s"] = round(time.perf_counter() - start, 1)
        print(f"== {name} ({result[name + '_s']} s)")
        print(json.dumps(result[name], indent=1, default=str))
    write_json(args.out, result, indent=1)
    identity = result.get("identity", {})
    failed |= any(v is False for v in identity.values()) if isinstance(identity, dict) else True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""host_store="mmap" against "memory": anonymous memory, latency warm and cold, disk rate.

One checkpoint of the reference DiT (bf16) and its ``dlo-fx shard --dp 1`` folder are
written first. Each variant then runs in its own process (so its memory figures are its
own):

* ``memory``: host_store="memory" from the checkpoint (today's behaviour);
* ``mmap``: host_store="mmap" from the checkpoint (fc2_weight is stored contiguous but the
  model holds it transposed, and the file is not 256-byte aligned: blocks are read tensor
  by tensor, fc2 converted through the store's reused scratch buffer);
* ``mmap-shards``: host_store="mmap" from the pre-sharded folder (one read per block).

In each process: Dynamo is warmed on a tiny model, then ``RssAnon`` (/proc/self/status)
is sampled every 2 ms by a thread; its peak above the pre-load value is reported for the
load and for the steady forwards. Latency: ``--runs`` timed calls after 2 warm-up calls
with a warm page cache, then ``--runs`` calls each preceded by dropping the served files
from the page cache (``posix_fadvise(DONTNEED)``); the achieved GB/s of a cold call is
streamed bytes / latency, against the disk's sequential read rate that this benchmark
measures on the checkpoint file (cache dropped, 16 MiB reads). Every output is compared
bit for bit with the resident model's.

    python benchmarks/bench_host_store.py --markdown     # width 1024, 12 layers
    python benchmarks/bench_host_store.py --width 512 --depth 4 --heads 8 --runs 5   # smaller

On a 2-core machine shared with other jobs one variant of width 1024 took about 12 minutes
(mostly compiling and the bf16 calls); on an idle machine it is minutes in all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

VARIANTS = {"memory": ("ckpt", "memory"), "mmap": ("ckpt", "mmap"),
            "mmap-shards": ("shards", "mmap")}


def drop_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_gbps(path: str, reps: int = 3) -> float:
    """Sequential read rate of ``path`` with its cache dropped (16 MiB preads)."""
    rates = []
    buf = bytearray(16 << 20)
    for _ in range(reps):
        drop_cache([path])
        fd = os.open(path, os.O_RDONLY)
        start, done = time.perf_counter(), 0
        try:
            while True:
                n = os.preadv(fd, [buf], done)
                if n <= 0:
                    break
                done += n
        finally:
            os.close(fd)
        rates.append(done / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


class AnonPeak:
    """Peak RssAnon seen by a 2 ms sampling thread."""

    def __init__(self) -> None:
        from dlo_fx.runtime import anon_memory

        self._read = lambda: anon_memory()["rss_anon"] or 0
        self.peak = self._read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._read())

    def reset(self) -> int:
        peak, self.peak = max(self.peak, self._read()), self._read()
        return peak

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._read())


def _warm_dynamo() -> None:
    """Compile a tiny model once, so Dynamo's imports and caches are not counted."""
    import gc

    import torch

    import dlo_fx
    from dlo_fx.apps.models import example_inputs, reference_dit
    from dlo_fx.runtime import reset_runtimes

    with torch.inference_mode():
        tiny = dlo_fx.offload(reference_dit(width=64, depth=2, heads=4), {"device": "cpu"})
        torch.compile(tiny, backend="dlo")(*example_inputs(tiny.config, batch=1, height=8, width=8))
    torch._dynamo.reset()
    reset_runtimes()
    del tiny
    gc.collect()


def _load(args, name: str):
    import dlo_fx
    from dlo_fx.apps.models import DiTConfig, ReferenceDiT, example_inputs

    where, store = VARIANTS[name]
    config = DiTConfig(width=args.width, depth=args.depth, heads=args.heads)
    options = {"host_store": store, "num_slots": 2}
    model = dlo_fx.load(ReferenceDiT, args.ckpt if where == "ckpt" else args.shards,
                        config=config, options=options)
    inputs = example_inputs(config, batch=1, height=args.size, width=args.size, seed=1)
    return model, options, inputs


def memory_child(args) -> None:
    """One variant in a fresh process: peak anonymous memory of the load and of steady
    forwards, above the value before the load."""
    import torch

    from dlo_fx.runtime import anon_memory
    from dlo_fx.runtime import runtimes_holding

    torch.set_num_threads(1)
    _warm_dynamo()
    base = anon_memory()["rss_anon"]
    sampler = AnonPeak()
    start = time.perf_counter()
    model, options, inputs = _load(args, args.child)
    load_s = time.perf_counter() - start
    load_peak = sampler.reset()
    compiled = torch.compile(model, backend="dlo", options=options)
    with torch.inference_mode():
        compiled(*inputs)  # compiles
        compile_peak = sampler.reset()
        for _ in range(3):
            out = compiled(*inputs)
        steady_peak = sampler.stop()
    runtime = runtimes_holding(list(model.parameters()))[0]
    from safetensors.torch import save_file

    save_file({"out": out.contiguous()}, args.result + ".out.safetensors")
    blocks = runtime.store.blocks
    result = {
        "variant": args.child, "load_s": load_s, "base_rss_anon": base,
        "load_peak_anon": load_peak - base, "compile_peak_anon": compile_peak - base,
        "steady_peak_anon": steady_peak - base, "slot_bytes": runtime.slots.total_bytes,
        "model_bytes": sum(b.nbytes for b in blocks), "blocks": len(blocks),
        "streamed_bytes": sum(b.shard_nbytes for b in blocks),
    }
    with open(args.result, "w") as f:
        json.dump(result, f)


def latency(args) -> dict:
    """Every variant loaded in this process and timed in turn (A B C, C B A, ...): warm
    page cache, then with the served files dropped from the page cache before each call."""
    import torch

    from dlo_fx.runtime import runtimes_holding
    from _timing import interleaved

    torch.set_num_threads(1)  # a core left for the copy and read-ahead threads
    calls, models = {}, {}
    for name in VARIANTS:
        model, options, inputs = _load(args, name)
        compiled = torch.compile(model, backend="dlo", options=options)
        calls[name] = (lambda c=compiled, i=inputs: c(*i))
        models[name] = model
    files = [args.ckpt] + [os.path.join(args.shards, f) for f in os.listdir(args.shards)]
    outs = {}
    with torch.inference_mode():
        warm = interleaved(calls, reps=args.runs, warmup=2)
        cold = {name: [] for name in calls}
        for rep in range(args.runs):
            for name in (list(calls) if rep % 2 == 0 else list(calls)[::-1]):
                drop_cache(files)
                t0 = time.perf_counter()
                outs[name] = calls[name]()
                cold[name].append(time.perf_counter() - t0)
    stats = {}
    for name, model in models.items():  # per model (the two mmap variants share a store)
        store = runtimes_holding(list(model.parameters()))[0].store
        ids = {store.entry(p).block for p in model.parameters() if p in store}
        shards = [store.blocks[i].source for i in sorted(ids) if store.blocks[i].source]
        stats[name] = {"blocks": len(shards),
                       "reads_per_block": sum(len(s.runs) for s in shards) / len(shards),
                       "converted_per_call": sum(r.convert is not None for s in shards
                                                 for r in s.runs),
                       "store": dict(store.files.stats)} if shards else None
    return {"warm_s": warm.times, "cold_s": cold, "file_stats": stats,
            "outputs_equal": all(torch.equal(o, outs["memory"]) for o in outs.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--size", type=int, default=8, help="latent side (tokens = size^2/4)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint")
    parser.add_argument("--out", default="bench-out/host_store.json")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--shards", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        memory_child(args)
        return 0
    import torch
    from safetensors.torch import load_file, save_file

    from dlo_fx.apps.models import DiTConfig, ReferenceDiT, example_inputs
    from dlo_fx.loading.shards import write_shard_dir

    work = tempfile.mkdtemp(dir=args.dir)
    ckpt, shards = os.path.join(work, "dit.safetensors"), os.path.join(work, "shards")
    config = DiTConfig(width=args.width, depth=args.depth, heads=args.heads)
    torch.manual_seed(0)
    model = ReferenceDiT(config).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, ckpt)
    torch.set_num_threads(1)
    with torch.inference_mode():
        expected = model(*example_inputs(config, batch=1, height=args.size, width=args.size,
                                         seed=1))
    del model
    write_shard_dir(ReferenceDiT, ckpt, shards, dp=1, config=config)
    disk = disk_read_gbps(ckpt)
    results = {}
    for name in VARIANTS:
        path = os.path.join(work, f"{name}.json")
        cmd = [sys.executable, __file__, "--child", name, "--ckpt", ckpt, "--shards", shards,
               "--result", path, "--width", str(args.width), "--depth", str(args.depth),
               "--heads", str(args.heads), "--size", str(args.size), "--runs", str(args.runs)]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        with open(path) as f:
            results[name] = json.load(f)
        out = load_file(path + ".out.safetensors")["out"]
        results[name]["equal_resident"] = bool(torch.equal(out, expected))
    args.ckpt, args.shards = ckpt, shards
    timing = latency(args)
    mem_warm = statistics.median(timing["warm_s"]["memory"])
    summary = {"disk_read_gbps": disk, "runs": args.runs, "loadavg": os.getloadavg(),
               "model": f"reference DiT width {args.width}, {args.depth} layers, bf16, "
                        f"{(args.size // 2) ** 2} tokens, num_slots=2, 1 intra-op thread"}
    for name, r in results.items():
        warm = statistics.median(timing["warm_s"][name])
        cold = statistics.median(timing["cold_s"][name])
        summary[name] = {
            "warm_ms": warm * 1e3, "cold_ms": cold * 1e3,
            "warm_over_memory": statistics.median(
                [a / b for a, b in zip(timing["warm_s"][name], timing["warm_s"]["memory"])]),
            "cold_over_memory_warm": cold / mem_warm,
            "cold_gbps": r["streamed_bytes"] / cold / 1e9,
            "load_peak_over_model": r["load_peak_anon"] / r["model_bytes"],
            "steady_peak_over_model": r["steady_peak_anon"] / r["model_bytes"],
            "bound_over_model": (0.25 * r["model_bytes"] + r["slot_bytes"]) / r["model_bytes"],
            "equal_resident": r["equal_resident"] and timing["outputs_equal"],
        }
        r["file_stats"] = timing["file_stats"][name]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "results": results}, f, indent=2)
    if args.markdown:
        mib = results["memory"]["model_bytes"] / 2**20
        print(f"Model: {summary['model']}; {mib:.0f} MiB streamed per call, "
              f"slots {results['memory']['slot_bytes'] / 2**20:.0f} MiB; disk sequential read "
              f"{disk:.2f} GB/s (median of 3, cache dropped). Latency: median of {args.runs} "
              "calls after 2 warm-up calls, variants in turn in one process; warm ratio = "
              f"median of paired ratios. Load average {summary['loadavg'][0]:.1f}.\n")
        print("| variant | load peak anon / model | steady peak anon / model | bound "
              "(0.25 + slots/model) | warm ms (paired / memory) | cold ms (/ memory warm) | cold GB/s "
              "(/ disk) | reads per block, converted per call | bit-exact |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, r in results.items():
            s = summary[name]
            st = r["file_stats"]
            reads = f"{st['reads_per_block']:.1f}, {st['converted_per_call']}" if st else "-"
            print(f"| {name} | {s['load_peak_over_model']:.3f} | "
                  f"{s['steady_peak_over_model']:.3f} | {s['bound_over_model']:.3f} | "
                  f"{s['warm_ms']:.1f} ({s['warm_over_memory']:.2f}) | {s['cold_ms']:.1f} "
                  f"({s['cold_over_memory_warm']:.2f}) | {s['cold_gbps']:.2f} "
                  f"({s['cold_gbps'] / disk:.2f}) | {reads} | {s['equal_resident']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

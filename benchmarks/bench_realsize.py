#!/usr/bin/env python
"""Real-size models from disk: FLUX.1-dev and Wan2.1-T2V (14B, 1.3B) with random weights.

For each model (its real diffusers configuration) the script:

1. writes a random bfloat16 checkpoint tensor by tensor into safetensors shards of about
   5 GB (`write`): values are slices of one 64 MiB pool of N(0, 0.02) numbers taken at
   random offsets, so writing is disk-bound and the model is never materialised;
2. measures the disk's rate in the same run (`disk`): the page cache of one shard dropped
   (``POSIX_FADV_DONTNEED``), then one ``O_DIRECT`` sequential stream of 64 MiB reads (as
   ``dd iflag=direct``) and four streams of 8 MiB reads; the larger is the disk's rate;
3. times ``torch.compile(backend="eager")`` of the same model on the meta device
   (`eager-compile`: Dynamo's trace, no weights) and the compute of one call from a
   resident model with fewer blocks, extrapolated to the real depth (`compute`);
4. runs `run` in a fresh process per variant: ``dlo_fx.load(..., host_store="mmap")`` from
   the checkpoint, or from ``dlo-fx shard`` folders at dp 1 and 2 (two processes on one
   disk, gloo), and ``host_store="memory"`` where the model fits in RAM; a first call and
   ``--calls - 1`` steady calls, the bytes read per call and their rate, peak RSS
   (``VmHWM``) and peak anonymous memory (``RssAnon`` sampled every 50 ms);
5. deletes each folder once its runs are done (never more than one checkpoint and one
   shard folder on disk).

Every variant's output is saved and compared bit for bit with the others of that model;
where the model fits in RAM (the 1.3B) also with the resident model.

    nice -n 5 python benchmarks/bench_realsize.py all --root DATA --models flux,wan14b,wan13b
    python benchmarks/bench_realsize.py all --root DATA --models tiny   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from _timing import machine_info, write_json  # noqa: E402

FLUX = dict(_class_name="FluxTransformer2DModel", attention_head_dim=128, guidance_embeds=True,
            in_channels=64, joint_attention_dim=4096, num_attention_heads=24, num_layers=19,
            num_single_layers=38, patch_size=1, pooled_projection_dim=768,
            axes_dims_rope=[16, 56, 56])
WAN14B = dict(_class_name="WanTransformer3DModel", added_kv_proj_dim=None, attention_head_dim=128,
              cross_attn_norm=True, eps=1e-06, ffn_dim=13824, freq_dim=256, image_dim=None,
              in_channels=16, num_attention_heads=40, num_layers=40, out_channels=16,
              patch_size=[1, 2, 2], qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
              text_dim=4096)
WAN13B = dict(WAN14B, ffn_dim=8960, num_attention_heads=12, num_layers=30)
TINY = dict(WAN14B, ffn_dim=256, num_attention_heads=2, num_layers=3, text_dim=64)
CONFIGS = {"flux": FLUX, "wan14b": WAN14B, "wan13b": WAN13B, "tiny": TINY}
NAMES = {"flux": "FLUX.1-dev (FluxTransformer2DModel)", "wan14b": "Wan2.1-T2V-14B",
         "wan13b": "Wan2.1-T2V-1.3B", "tiny": "tiny Wan"}
SHARD_BYTES = 5 << 30
DTYPE = torch.bfloat16


def model_class(config: dict):
    import diffusers

    return getattr(diffusers, config["_class_name"])


def build(config: dict, device: str = "meta", **changes) -> torch.nn.Module:
    kw = {k: v for k, v in config.items() if not k.startswith("_")}
    kw.update(changes)
    with torch.device(device):
        return model_class(config)(**kw).to(DTYPE).eval()


def inputs(config: dict, device: str = "cpu") -> dict:
    """One image token and one text token: a read-bound call (docs/benchmarks.md)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(DTYPE).to(device)

    if config["_class_name"] == "FluxTransformer2DModel":
        return dict(hidden_states=r(1, 1, 64), encoder_hidden_states=r(1, 1, 4096),
                    pooled_projections=r(1, 768), timestep=torch.ones(1, dtype=DTYPE, device=device),
                    img_ids=torch.zeros(1, 3, device=device), txt_ids=torch.zeros(1, 3, device=device),
                    guidance=torch.full((1,), 3.5, dtype=DTYPE, device=device), return_dict=False)
    return dict(hidden_states=r(1, config["in_channels"], 1, 2, 2),
                timestep=torch.full((1,), 500, device=device),
                encoder_hidden_states=r(1, 1, config["text_dim"]), return_dict=False)


def output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


# -- writing ------------------------------------------------------------------------------------
def write_checkpoint(name: str, folder: str) -> dict:
    """Random bfloat16 weights of ``name``'s state dict, tensor by tensor, in shards."""
    config = CONFIGS[name]
    model = build(config)
    state = model.state_dict()
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    pool = (torch.randn(32 << 20, generator=g) * 0.02).to(DTYPE)
    pool_bytes = memoryview(pool.view(torch.uint8).numpy())
    groups: list[list[str]] = [[]]
    size = 0
    for key, t in state.items():
        n = t.numel() * 2
        if size and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    weight_map, start, total = {}, time.perf_counter(), 0
    for i, keys in enumerate(groups):
        fname = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, offset = {}, 0
        for key in keys:
            n = state[key].numel() * 2
            header[key] = {"dtype": "BF16", "shape": list(state[key].shape),
                           "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[key] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(folder, fname), "wb", buffering=0) as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for key in keys:
                left = state[key].numel() * 2
                at = int(torch.randint(0, len(pool_bytes) // 2, (1,), generator=g)) * 2
                while left:
                    n = min(left, len(pool_bytes) - at)
                    f.write(pool_bytes[at : at + n])
                    left -= n
                    at = 0
            os.fsync(f.fileno())
        total += offset
    seconds = time.perf_counter() - start
    with open(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return {"bytes": total, "files": len(groups), "params": sum(t.numel() for t in state.values()),
            "write_s": seconds, "write_gbps": total / seconds / 1e9}


def drop_cache(path: str) -> None:
    for p in ([os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]):
        if os.path.isfile(p):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_rate(path: str, limit: int = 4 << 30) -> dict:
    """O_DIRECT sequential reads of ``path`` (its first ``limit`` bytes), cache dropped:
    one stream of 64 MiB reads, then four streams of 8 MiB reads."""
    size = min(os.path.getsize(path), limit)
    size -= size % (64 << 20) if size >= 64 << 20 else size % 4096
    out = {"path_bytes": size}
    for label, threads, chunk in (("one_stream", 1, 64 << 20), ("four_streams", 4, 8 << 20)):
        chunk = min(chunk, size)
        drop_cache(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        offsets = list(range(0, size, chunk))
        lock = threading.Lock()

        def work() -> None:
            buf = mmap.mmap(-1, chunk)
            while True:
                with lock:
                    if not offsets:
                        return
                    o = offsets.pop(0)
                os.preadv(fd, [buf], o)

        start = time.perf_counter()
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out[label + "_gbps"] = size / (time.perf_counter() - start) / 1e9
        os.close(fd)
    out["gbps"] = max(out["one_stream_gbps"], out["four_streams_gbps"])
    out["loadavg"] = os.getloadavg()
    return out


# -- compile and compute references -------------------------------------------------------------
def eager_compile(name: str) -> dict:
    """First minus second call of torch.compile(backend="eager") on the meta device."""
    config = CONFIGS[name]
    model = build(config)
    compiled = torch.compile(model, backend="eager")
    args = inputs(config, "meta")
    times = []
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            compiled(**args)
            times.append(time.perf_counter() - start)
    return {"first_s": times[0], "second_s": times[1], "compile_s": times[0] - times[1]}


def compute(name: str, threads: int, reps: int = 3) -> dict:
    """Seconds of one call of the resident model, from models of 1 and 2 blocks of each
    kind (random weights in memory), extrapolated to the real depth."""
    torch.set_num_threads(threads)
    config = CONFIGS[name]
    flux = config["_class_name"] == "FluxTransformer2DModel"
    shapes = ([(1, 1), (2, 1), (1, 2)] if flux else [(1,), (2,)])

    def timed(shape) -> float:
        kw = ({"num_layers": shape[0], "num_single_layers": shape[1]} if flux
              else {"num_layers": shape[0]})
        model = build(config, "cpu", **kw)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
            args = inputs(config)
            model(**args)
            ts = []
            for _ in range(reps):
                start = time.perf_counter()
                model(**args)
                ts.append(time.perf_counter() - start)
        return statistics.median(ts)

    t = [timed(s) for s in shapes]
    if flux:
        double, single = t[1] - t[0], t[2] - t[0]
        base = t[0] - double - single
        total = base + config["num_layers"] * double + config["num_single_layers"] * single
        return {"compute_s": total, "double_s": double, "single_s": single, "base_s": base,
                "threads": threads, "loadavg": os.getloadavg()}
    layer = t[1] - t[0]
    return {"compute_s": t[0] - layer + config["num_layers"] * layer, "layer_s": layer,
            "threads": threads, "loadavg": os.getloadavg()}


# -- one variant, in a fresh process ------------------------------------------------------------
class _AnonPeak(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, _status("RssAnon"))
            time.sleep(0.05)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def run_variant(a) -> dict:
    sampler = _AnonPeak()
    sampler.start()
    import dlo_fx
    from dlo_fx.runtime import runtimes_holding

    torch.set_num_threads(a.threads)
    if a.world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world)
    config = CONFIGS[a.model]
    options: dict[str, Any] = {"host_store": a.store}
    if a.store == "mmap":
        options["file_reads"] = a.reads
    if a.world > 1:
        options["mode"] = "allgather"
    drop_cache(a.ckpt)
    start = time.perf_counter()
    model = dlo_fx.load(model_class(config), a.ckpt, dtype=DTYPE, options=options)
    load_s = time.perf_counter() - start
    compiled = torch.compile(model, backend="dlo", options=options)
    files = runtimes_holding(list(model.parameters()))[0].store.files
    args = inputs(config)
    calls, bytes_read, out = [], [], None
    with torch.no_grad():
        for i in range(a.calls):
            before = files.stats["bytes"] if files is not None else 0
            start = time.perf_counter()
            out = output(compiled(**args))
            calls.append(time.perf_counter() - start)
            bytes_read.append((files.stats["bytes"] if files is not None else 0) - before)
    from torch._dynamo.utils import compile_times

    report = dlo_fx.memory_report(model)
    sampler.stop = True
    result = {
        "model": a.model, "store": a.store, "reads": a.reads, "world": a.world, "rank": a.rank,
        "ckpt": os.path.basename(a.ckpt.rstrip("/")), "load_s": load_s, "calls_s": calls,
        "bytes_per_call": bytes_read, "peak_rss_bytes": _status("VmHWM"),
        "peak_anon_bytes": sampler.peak, "slot_bytes": report.slot_bytes,
        "resident_bytes": report.resident_bytes, "num_blocks": report.num_blocks,
        "stats": dict(files.stats) if files is not None else None,
        "direct": files.direct if files is not None else None,
        "compile_times": compile_times(repr="str", aggregate=True),
        "loadavg": os.getloadavg(),
        "nan": bool(out.isnan().any()),
    }
    if a.save:
        torch.save(out, a.save)
    if a.resident:  # fits in RAM: the same model the plain way, compared bit for bit
        ref = model_class(config).from_pretrained(a.ckpt, torch_dtype=DTYPE).eval()
        with torch.no_grad():
            result["equal_resident"] = torch.equal(output(ref(**args)), out)
    return result


def spawn_variant(model: str, ckpt: str, store: str, reads: str, world: int, calls: int,
                  save: str, resident: bool = False) -> dict:
    """`run` in ``world`` fresh processes; the ranks' figures, slowest call per index."""
    init = f"file://{ckpt.rstrip('/')}.rdzv-{time.time_ns()}"
    threads = max(1, (os.cpu_count() or 1) // world)
    procs = []
    for rank in range(world):
        cmd = [sys.executable, __file__, "run", "--model", model, "--ckpt", ckpt, "--store", store,
               "--reads", reads, "--world", str(world), "--rank", str(rank), "--init", init,
               "--calls", str(calls), "--threads", str(threads),
               "--save", save if rank == 0 else ""] + (["--resident"] if resident else [])
        env = dict(os.environ, LOCAL_WORLD_SIZE=str(world))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
    ranks = []
    for p in procs:
        text, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"{model} {store} {reads} dp{world}: rank exited {p.returncode}")
        ranks.append(json.loads(text.strip().splitlines()[-1]))
    if os.path.exists(init[len("file://"):]):
        os.unlink(init[len("file://"):])
    merged = dict(ranks[0])
    merged["calls_s"] = [max(r["calls_s"][i] for r in ranks) for i in range(calls)]
    merged["bytes_per_call"] = [sum(r["bytes_per_call"][i] for r in ranks) for i in range(calls)]
    merged["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in ranks)
    merged["peak_anon_bytes"] = max(r["peak_anon_bytes"] for r in ranks)
    merged["ranks"] = ranks
    return merged


def shard(ckpt: str, out: str, dp: int) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dlo_fx.apps.cli", "shard", ckpt, "--dp", str(dp),
                    "--out", out, "--dtype", "bfloat16"], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def summarise(v: dict, disk: float, compute_s: float, eager_s: float) -> dict:
    steady = statistics.median(v["calls_s"][1:]) if len(v["calls_s"]) > 1 else None
    per_call = statistics.median(v["bytes_per_call"][1:] or v["bytes_per_call"])
    floor = per_call / (disk * 1e9)  # every rank's reads, from one disk
    out = {"first_s": v["calls_s"][0], "steady_s": steady, "steady_n": len(v["calls_s"]) - 1,
           "bytes_per_call": per_call, "read_floor_s": floor,
           "read_gbps": per_call / steady / 1e9 if steady else None,
           "steady_vs_floor": steady / max(floor, compute_s) if steady else None,
           "first_vs_goal": (v["calls_s"][0] / ((steady + eager_s) * 1.1)) if steady else None,
           "peak_rss_gib": v["peak_rss_bytes"] / 2**30,
           "peak_anon_gib": v["peak_anon_bytes"] / 2**30,
           "slots_gib": v["slot_bytes"] / 2**30,
           "rss_minus_slots_gib": (v["peak_rss_bytes"] - v["slot_bytes"]) / 2**30}
    return out


def run_all(a) -> dict:
    results: dict[str, Any] = {"machine": machine_info(), "models": {}}
    os.makedirs(a.root, exist_ok=True)
    for name in a.models.split(","):
        started = time.perf_counter()
        res: dict[str, Any] = {"name": NAMES[name], "variants": {}}
        results["models"][name] = res
        ckpt = os.path.join(a.root, name)
        print(f"[{name}] writing", file=sys.stderr, flush=True)
        res["write"] = write_checkpoint(name, ckpt)
        shard_file = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))[0]
        res["disk_before"] = disk_rate(os.path.join(ckpt, shard_file))
        print(f"[{name}] {res['write']} {res['disk_before']}", file=sys.stderr, flush=True)
        res["eager_compile"] = _child("eager-compile", name)
        res["compute"] = {t: _child("compute", name, "--threads", str(t)) for t in (2, 1)}
        fits = res["write"]["bytes"] * 1.6 < (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        saves = {}

        def variant(key, path, store, reads, world, resident=False):
            print(f"[{name}] {key}", file=sys.stderr, flush=True)
            saves[key] = os.path.join(a.root, f"{name}-{key}.pt")
            v = spawn_variant(name, path, store, reads, world, a.calls, saves[key], resident)
            res["variants"][key] = v
            print(f"[{name}] {key}: calls {v['calls_s']} rss {v['peak_rss_bytes'] / 2**30:.2f} GiB",
                  file=sys.stderr, flush=True)

        variant("mmap-direct", ckpt, "mmap", "direct", 1)
        if "buffered" in a.variants:
            variant("mmap-buffered", ckpt, "mmap", "buffered", 1)
        if fits:
            variant("memory", ckpt, "memory", "auto", 1, resident=True)
            variant("mmap-auto", ckpt, "mmap", "auto", 1)
        for dp in (1, 2):
            if f"dp{dp}" not in a.variants:
                continue
            folder = os.path.join(a.root, f"{name}-dp{dp}")
            res[f"shard_dp{dp}_s"] = shard(ckpt, folder, dp)
            variant(f"shards-dp{dp}", folder, "mmap", "auto", dp)
            shutil.rmtree(folder)
        res["disk_after"] = disk_rate(os.path.join(ckpt, shard_file))
        shutil.rmtree(ckpt)
        outs = {k: torch.load(p) for k, p in saves.items()}
        first = next(iter(outs.values()))
        res["outputs_equal"] = all(torch.equal(first, o) for o in outs.values())
        for p in saves.values():
            os.unlink(p)
        disk = max(res["disk_before"]["gbps"], res["disk_after"]["gbps"])
        res["disk_gbps"] = disk
        threads = {1: 2, 2: 1}
        for key, v in res["variants"].items():
            v["summary"] = summarise(v, disk, res["compute"][threads[v["world"]]]["compute_s"],
                                     res["eager_compile"]["compile_s"])
        res["wall_s"] = time.perf_counter() - started
        write_json(a.out, results)
    return results


def _child(*args: str) -> dict:
    text = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True,
                          text=True).stdout
    return json.loads(text.strip().splitlines()[-1])


def markdown(results: dict) -> str:
    rows = ["| model | variant | bytes/call | first call | steady (median of N) | read rate | "
            "disk | steady / max(floor, compute) | first / (1.1 (steady + eager compile)) | "
            "peak RSS (slots) | peak anon | load avg |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, res in results["models"].items():
        for key, v in res["variants"].items():
            s = v["summary"]
            rows.append(
                f"| {res['name']} | {key} | {s['bytes_per_call'] / 1e9:.1f} GB | {s['first_s']:.1f} s | "
                f"{s['steady_s']:.1f} s ({s['steady_n']}) | {s['read_gbps']:.2f} GB/s | "
                f"{res['disk_gbps']:.2f} GB/s | {s['steady_vs_floor']:.2f} | {s['first_vs_goal']:.2f} | "
                f"{s['peak_rss_gib']:.2f} GiB ({s['slots_gib']:.2f}) | {s['peak_anon_gib']:.2f} GiB | "
                f"{v['loadavg'][0]:.1f} |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    al = sub.add_parser("all")
    al.add_argument("--root", required=True, help="folder for the checkpoints (deleted after)")
    al.add_argument("--models", default="flux,wan14b,wan13b")
    al.add_argument("--variants", default="buffered,dp1,dp2")
    al.add_argument("--calls", type=int, default=3)
    al.add_argument("--out", default=os.path.join(ROOT, "bench-out", "realsize.json"))
    al.add_argument("--markdown", action="store_true")
    r = sub.add_parser("run")
    for flag, kw in (("--model", {}), ("--ckpt", {}), ("--store", {}), ("--reads", {}),
                     ("--init", {"default": ""}), ("--save", {"default": ""})):
        r.add_argument(flag, **kw)
    for flag, default in (("--world", 1), ("--rank", 0), ("--calls", 3), ("--threads", 2)):
        r.add_argument(flag, type=int, default=default)
    r.add_argument("--resident", action="store_true")
    for cmd in ("eager-compile", "compute"):
        c = sub.add_parser(cmd)
        c.add_argument("model")
        c.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if a.cmd == "run":
        print(json.dumps(run_variant(a)))
    elif a.cmd == "eager-compile":
        print(json.dumps(eager_compile(a.model)))
    elif a.cmd == "compute":
        print(json.dumps(compute(a.model, a.threads)))
    else:
        results = run_all(a)
        if a.markdown:
            print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

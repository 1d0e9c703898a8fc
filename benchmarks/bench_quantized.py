#!/usr/bin/env python
"""CPU benchmark of low-precision and quantized weights: bytes and latency, bf16 vs fp8 vs int8.

Part 1 (default): the reference DiT in bfloat16 compiled with ``backend="dlo"`` three ways:
its weights stored as bf16, stored as fp8 (``options={"storage_dtype": torch.float8_e4m3fn}``:
the linear layers diffusers' layerwise casting would cast, cast back to bf16 in the graph),
and quantized by torchao (``Int8WeightOnlyConfig``, streamed as int8 data and scales). For
each: host bytes, bytes streamed per call, slot bytes, and the latency of a call, the three
interleaved in one run (medians over ``--reps`` after warm-up), each checked bit-identical
against the same model run resident (bf16 plain; fp8: the same layers rounded to fp8 in
their own dtype, which is what layerwise casting computes; int8: the torchao model).

Part 2 (``--realsize``): a FLUX.1-dev-sized ``FluxTransformer2DModel`` (19 + 38 blocks, width
3072) written as a random bf16 safetensors checkpoint tensor by tensor (never materialised),
then ``dlo-fx shard --storage-dtype float8_e4m3fn`` at dp 1 and dp 2 (peak RSS of the
command, file bytes per rank), then one forward from the dp-1 fp8 folder with the
file-backed host store (two calls, peak RSS). Needs about 50 GB of free disk in ``--dir``.

    python benchmarks/bench_quantized.py              # part 1, 5 reps
    python benchmarks/bench_quantized.py --quick      # tiny model, 2 reps (smoke test)
    python benchmarks/bench_quantized.py --realsize --dir /path/with/50GB
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleaved, machine_info  # noqa: E402

FP8 = torch.float8_e4m3fn
FULL = dict(width=512, depth=8, heads=8, reps=7)
QUICK = dict(width=128, depth=2, heads=4, reps=2)


# -- part 1: the reference DiT ----------------------------------------------------------------
def _dit(p: dict):
    from dlo_fx.apps.models import reference_dit

    return reference_dit(width=p["width"], depth=p["depth"], heads=p["heads"],
                         dtype=torch.bfloat16)


def _figures(model) -> dict:
    import dlo_fx

    r = dlo_fx.memory_report(model)
    # The slots are shared by every model on the device (sized for the largest block of
    # any): what this model needs is num_slots of its own largest block.
    return {"host_shard_bytes": r.host_shard_bytes,
            "slot_bytes": r.num_slots * r.max_block_bytes,
            "streamed_bytes_per_call": r.streamed_bytes_per_call}


def part1(p: dict) -> dict:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    import dlo_fx
    from dlo_fx.apps.models.reference_dit import example_inputs
    from dlo_fx.model.storage_dtype import layerwise_layers

    warnings.simplefilter("ignore")
    torch.set_grad_enabled(False)
    inputs = example_inputs(_dit(p).config, height=16, width=16)

    def int8(model):
        quantize_(model, Int8WeightOnlyConfig())
        return model

    def rounded(model):  # resident, with fp8 values in each layer's own dtype (the DiT's
        # time embedding is float32: one compute dtype, as diffusers' hooks take, fails it)
        for _, layer in layerwise_layers(model):
            for w in layer.parameters():
                w.copy_(w.to(FP8).to(w.dtype))
        return model

    refs = {"bf16": _dit(p), "fp8": rounded(_dit(p)), "int8": int8(_dit(p))}
    want = {k: m(*inputs) for k, m in refs.items()}
    del refs
    models = {"bf16": _dit(p), "fp8": _dit(p), "int8": int8(_dit(p))}
    options = {"bf16": {}, "fp8": {"storage_dtype": FP8}, "int8": {}}
    compiled = {}
    for name, model in models.items():
        dlo_fx.offload(model, {"device": "cpu", **options[name]})  # where the inputs are
        compiled[name] = torch.compile(model, backend="dlo")
        got = [compiled[name](*inputs) for _ in range(2)]
        assert all(torch.equal(g, want[name]) for g in got), f"{name}: not bit-identical"
    samples = interleaved({n: (lambda c=c: c(*inputs)) for n, c in compiled.items()},
                          reps=p["reps"], warmup=1)
    out = {"model": f"reference DiT width {p['width']}, depth {p['depth']}, bf16",
           "reps": p["reps"], "exact": True, "variants": {}}
    for name, model in models.items():
        out["variants"][name] = {**_figures(model), "median_s": samples.median(name)}
    out["ratios"] = {"fp8/bf16": samples.paired_ratio("fp8", "bf16"),
                     "int8/bf16": samples.paired_ratio("int8", "bf16")}
    return out


# -- part 2: a FLUX.1-dev-sized checkpoint on disk --------------------------------------------
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
SHARD_BYTES = 5 << 30


def write_random_checkpoint(root: str, config: dict) -> int:
    """A diffusers folder of random bf16 safetensors shards, written tensor by tensor from
    the meta model's shapes; returns its bytes."""
    from diffusers import FluxTransformer2DModel

    os.makedirs(root, exist_ok=True)
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"_class_name": "FluxTransformer2DModel", **config}, f)
    named = [(n, tuple(p.shape)) for n, p in model.state_dict().items()]
    groups, current, size = [], [], 0
    for name, shape in named:
        n = 2 * int(torch.Size(shape).numel())
        if current and size + n > SHARD_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append((name, shape, n))
        size += n
    groups.append(current)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, cursor = {}, 0
        for name, shape, n in group:
            header[name] = {"dtype": "BF16", "shape": list(shape),
                            "data_offsets": [cursor, cursor + n]}
            cursor += n
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(root, fname), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape, n in group:
                t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
                f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
                total += n
    with open(os.path.join(root, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _peak_rss_of(cmd: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of ``cmd`` run as a child (its own getrusage)."""
    code = ("import resource,subprocess,sys,time;t=time.perf_counter();"
            "subprocess.run(sys.argv[1:],check=True);"
            "print(time.perf_counter()-t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code, *cmd], check=True, capture_output=True,
                         text=True).stdout.split()
    return float(out[-2]), int(out[-1]) * 1024


def _forward_case(folder: str) -> None:
    """Run in a child: load the fp8 folder, two calls, print the figures as JSON."""
    import dlo_fx
    from dlo_fx.runtime import anon_memory
    from diffusers import FluxTransformer2DModel

    warnings.simplefilter("ignore")
    torch.set_grad_enabled(False)
    start = time.perf_counter()
    model = dlo_fx.load(FluxTransformer2DModel, folder, dtype=torch.bfloat16, options={
        "storage_dtype": "float8_e4m3fn", "host_store": "mmap"})
    load_s = time.perf_counter() - start
    model.compile(backend="dlo")
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 16, 64, generator=g).bfloat16(),
              encoder_hidden_states=torch.randn(1, 16, 4096, generator=g).bfloat16(),
              pooled_projections=torch.randn(1, 768, generator=g).bfloat16(),
              timestep=torch.tensor([0.5]).bfloat16(), guidance=torch.tensor([3.5]).bfloat16(),
              img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(16, 3))
    calls = []
    for _ in range(2):
        t = time.perf_counter()
        model(**kw)
        calls.append(time.perf_counter() - t)
    r = dlo_fx.memory_report(model)
    print(json.dumps({"load_s": load_s, "calls_s": calls,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "anon_bytes": anon_memory()["rss_anon"],
                      "slot_bytes": r.slot_bytes,
                      "streamed_bytes_per_call": r.streamed_bytes_per_call}))


def _drop_cache(folder: str) -> None:
    for dirpath, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def part2(base: str) -> dict:
    free = shutil.disk_usage(base).free
    if free < 52e9:
        raise SystemExit(f"--realsize needs about 52 GB free in {base}; {free / 1e9:.1f} GB free")
    root, out = os.path.join(base, "flux-bf16"), {}
    try:
        t = time.perf_counter()
        out["checkpoint_bytes"] = write_random_checkpoint(root, FLUX_DEV)
        out["write_s"] = time.perf_counter() - t
        cli = [sys.executable, "-m", "dlo_fx.apps.cli", "shard", root, "--dtype", "bfloat16",
               "--storage-dtype", "float8_e4m3fn"]
        for dp in (2, 1):
            folder = os.path.join(base, f"flux-fp8-dp{dp}")
            seconds, peak = _peak_rss_of(cli + ["--dp", str(dp), "--out", folder])
            sizes = sorted(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                           if f.startswith("rank"))
            out[f"shard_dp{dp}"] = {"seconds": seconds, "peak_rss_bytes": peak,
                                    "rank_file_bytes": sizes}
            if dp == 2:
                shutil.rmtree(folder)
        shutil.rmtree(root)
        folder = os.path.join(base, "flux-fp8-dp1")
        _drop_cache(folder)
        got = subprocess.run([sys.executable, __file__, "--forward-case", folder], check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        out["forward_dp1_mmap"] = json.loads(got)
    finally:
        for name in ("flux-bf16", "flux-fp8-dp1", "flux-fp8-dp2"):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return out


def shard_rss(base: str, depths: list) -> dict:
    """Peak RSS of ``dlo-fx shard --dp 2 --storage-dtype float8_e4m3fn`` over FLUX.1-dev's
    width at several depths: flat in the depth when no process holds the whole model."""
    out = {}
    for double, single in depths:
        config = {**FLUX_DEV, "num_layers": double, "num_single_layers": single}
        root, folder = os.path.join(base, "ckpt"), os.path.join(base, "fp8")
        try:
            size = write_random_checkpoint(root, config)
            seconds, peak = _peak_rss_of([sys.executable, "-m", "dlo_fx.apps.cli", "shard", root,
                                          "--dp", "2", "--dtype", "bfloat16", "--storage-dtype",
                                          "float8_e4m3fn", "--out", folder])
            ranks = sorted(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                           if f.startswith("rank"))
            out[f"{double}+{single}"] = {"checkpoint_bytes": size, "seconds": seconds,
                                         "peak_rss_bytes": peak, "rank_file_bytes": ranks}
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--realsize", action="store_true")
    parser.add_argument("--dir", default=None, help="scratch folder for --realsize")
    parser.add_argument("--shard-rss", action="store_true",
                        help="peak RSS of dlo-fx shard --storage-dtype at FLUX.1-dev's width, "
                        "2+4, 4+8 and 8+16 blocks (--dir: about 12 GB free)")
    parser.add_argument("--forward-case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.forward_case:
        _forward_case(args.forward_case)
        return
    result = {"machine": machine_info()}
    if args.shard_rss:
        if not args.dir:
            raise SystemExit("--shard-rss needs --dir")
        result["shard_rss"] = shard_rss(args.dir, [(2, 4), (4, 8), (8, 16)])
    elif args.realsize:
        if not args.dir:
            raise SystemExit("--realsize needs --dir (about 52 GB free)")
        result["realsize"] = part2(args.dir)
    else:
        p = dict(QUICK if args.quick else FULL)
        if args.reps:
            p["reps"] = args.reps
        result["reference_dit"] = part1(p)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

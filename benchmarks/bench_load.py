#!/usr/bin/env python
"""CPU benchmark of loading: host memory of ``dlo_fx.load`` vs a plain ``load_state_dict``.

A reference DiT checkpoint (about 3.1 GB of bfloat16, written once into a cache folder) is
loaded by ``--ranks`` fresh processes joined by a gloo file rendezvous, each then compiling
the model with ``backend="dlo"`` (``mode="allgather"``) and running one forward. The parent
samples the PSS of every worker's process tree (`dlo_fx.runtime.device.procfs.tree_pss`) at
``--hz`` from process start until every rank's first forward finished, and reports the peak
of the sum.

Variants, each in fresh processes:

* ``idle``: ranks that import torch and dlo_fx, join the process group and wait: the
  baseline every rank pays whatever it loads;
* ``dlo_fx.load``: meta init, mmap views, each rank copies only its host shard;
* ``load_state_dict``: the model built normally, then
  ``model.load_state_dict(safetensors.torch.load_file(path))`` on every rank.

Goal: peak(dlo_fx.load) <= 1.25 x model + ranks x idle, and host weight bytes per rank
(steady state) = that rank's shard bytes. Figures are medians over ``--reps`` repetitions,
after one warm-up load (no compile) that reads the checkpoint into the page cache; the
script prints (peak - idle ranks) / model against the bound. Where the peak goes: each
sample splits the PSS into anonymous memory (shards, slots, heap), file-backed pages
(libraries; the checkpoint, were it mapped) and shared memory, with the page-locked bytes
beside; each rank reports its PSS before loading, after loading and after the forward, and
its slot bytes.

    python benchmarks/bench_load.py              # 3.1 GB checkpoint, 2 ranks, 5 reps
    python benchmarks/bench_load.py --layout words --width 1024 --depth 24
        # 0.92 GB of word-keyed layers: compiling and the slots weigh more against it
    python benchmarks/bench_load.py --quick      # tiny model, 1 rep (smoke test)
    python benchmarks/bench_load.py --markdown   # also print the docs/benchmarks.md table
    python benchmarks/bench_load.py --layout words --width 1024 --depth 32 --reps 1
        # the same DiT with word-keyed layers (``blocks.layer_a``, ...): blocks by footprint
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import torch

FULL = dict(width=1152, depth=64, heads=16, hw=8, reps=5)
QUICK = dict(width=128, depth=4, heads=4, hw=8, reps=1)
OPTIONS = {"mode": "allgather"}
# Read by every block: the backend keeps it on the device; loading it resident avoids a
# gathered resident copy of a stored parameter, which the runtime issues outside its
# copy worker (a collective that can race the worker's block gathers).
RESIDENT = ("modulation_table",)
VARIANTS = ("idle", "dlo", "baseline")
BOUND = 1.25  # peak <= BOUND x model + the idle ranks
# /proc/PID/smaps_rollup fields each sample sums over the ranks' process trees
SPLIT = ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Locked")
NAMES = {"idle": "idle ranks", "dlo": "dlo_fx.load", "baseline": "load_state_dict"}
_CODES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


# -- the checkpoint -------------------------------------------------------------------------
def dit_config(p: dict):
    from dlo_fx.apps.models import DiTConfig

    return DiTConfig(width=p["width"], depth=p["depth"], heads=p["heads"])


def model_class(p: dict) -> type:
    """`ReferenceDiT`, or with ``layout="words"`` the same model whose layers sit in a
    ``ModuleDict`` under word keys: no layer is numbered, the blocks come from footprint."""
    from torch import nn

    from dlo_fx.apps.models import ReferenceDiT
    from dlo_fx.apps.models.reference_dit import _modulate, _timestep_features

    if p.get("layout", "numbered") == "numbered":
        return ReferenceDiT

    class WordKeyedDiT(ReferenceDiT):
        def __init__(self, config) -> None:
            super().__init__(config)
            self.blocks = nn.ModuleDict((_word(i), b) for i, b in enumerate(self.blocks))

        def forward(self, latents, timestep, text):  # ReferenceDiT.forward over .values()
            dtype = self.config.dtype
            height, width = latents.shape[-2:]
            image = self.patch_embed(self.patchify(latents.to(dtype)))
            temb = self.time_embed(_timestep_features(timestep)).to(dtype)
            text_tokens = self.text_proj(text.to(dtype))
            cond = torch.nn.functional.silu(temb)
            x = torch.cat((text_tokens, image), dim=1)
            for block in self.blocks.values():
                x = block(x, cond, self.modulation_table, self.rope_freqs)
            x = x[:, text_tokens.shape[1]:]
            shift, scale = self.final_adaLN(cond).chunk(2, dim=-1)
            x = self.proj_out(_modulate(self.norm_out(x), shift, scale))
            return self.unpatchify(x, height, width)

    return WordKeyedDiT


def _word(i: int) -> str:
    letters = ""
    while True:
        letters = chr(ord("a") + i % 26) + letters
        i = i // 26 - 1
        if i < 0:
            return "layer_" + letters


def write_checkpoint(path: str, p: dict) -> int:
    """Stream a reference DiT state dict into ``path`` one tensor at a time (no model in
    memory); deterministic N(0, 0.02) values. Returns the file size."""
    from dlo_fx.loading.build import meta_parameters

    with meta_parameters():
        model = model_class(p)(dit_config(p))
    state = [(k, v.dtype, tuple(v.shape)) for k, v in model.state_dict(keep_vars=True).items()]
    # Like safetensors' own writer: larger items first, so every tensor is aligned.
    state.sort(key=lambda item: (-torch.empty((), dtype=item[1]).element_size(), item[0]))
    header, offset = {}, 0
    for key, dtype, shape in state:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _CODES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for i, (key, dtype, shape) in enumerate(state):
            gen = torch.Generator().manual_seed(i)
            values = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
            f.write(values.reshape(-1).view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)
    return os.path.getsize(path)


def ensure_checkpoint(cache_dir: str, p: dict) -> str:
    from dlo_fx.loading.checkpoint import CheckpointError
    from dlo_fx.loading.discover import resolve_checkpoint

    os.makedirs(cache_dir, exist_ok=True)
    words = "-words" if p.get("layout", "numbered") == "words" else ""
    path = os.path.join(cache_dir, f"reference-dit{words}-w{p['width']}-d{p['depth']}.safetensors")
    if os.path.exists(path):
        try:
            resolve_checkpoint(path)
            return path
        except CheckpointError:
            os.remove(path)
    start = time.perf_counter()
    size = write_checkpoint(path, p)
    print(f"wrote {path} ({size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    return path


# -- one rank (a fresh process) ---------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import datetime

    import torch.distributed as dist

    import dlo_fx  # noqa: F401  (an idle rank imports it too)

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=600))
    p = json.loads(args.params)
    result: dict[str, Any] = {"rank": args.rank}
    if args.worker == "idle":
        dist.barrier()
        time.sleep(0.5)
        from dlo_fx.runtime import process_memory

        result["pss"] = process_memory()["pss"]
        dist.barrier()  # every rank measured while all were alive
    else:
        result.update(_load_and_run(args.worker, args.ckpt, p))
    result["seconds"] = time.perf_counter() - t0
    with open(args.out + ".partial", "w") as f:
        json.dump(result, f)
    os.replace(args.out + ".partial", args.out)
    dist.barrier()
    dist.destroy_process_group()


def _load_and_run(variant: str, ckpt: str, p: dict) -> dict:
    from safetensors.torch import load_file

    import dlo_fx
    from dlo_fx.loading.loader import load
    from dlo_fx.apps.models import example_inputs
    from dlo_fx.runtime import runtimes_holding

    from dlo_fx.runtime import process_memory

    config = dit_config(p)
    cls = model_class(p)
    pss_before = process_memory()["pss"]
    start = time.perf_counter()
    marks = {"start": time.monotonic()}
    if variant == "dlo":
        # The shared modulation table stays resident, as the backend keeps it when it
        # compiles a materialised model (see RESIDENT).
        model = load(cls, ckpt, config=config, options=OPTIONS, resident=RESIDENT)
    else:
        model = cls(config).eval().requires_grad_(False)
        model.load_state_dict(load_file(ckpt))
    loaded = time.perf_counter()
    marks["loaded"] = time.monotonic()
    pss_loaded = process_memory()["pss"]
    if p.get("load_only"):  # loading figures only: no compile, no forward
        marks["done"] = marks["loaded"]
        holders = runtimes_holding(list(model.parameters())) if variant == "dlo" else []
        blocks = holders[0].store.blocks if holders else []
        shard = sum(b.shard.numel() for b in blocks)
        return {"load_s": loaded - start, "forward_s": 0.0, "host_shard_bytes": shard,
                "expected_shard_bytes": shard, "dp": 0, "blocks": len(blocks),
                "max_block_bytes": max((b.spec.padded_bytes for b in blocks), default=0),
                "model_bytes": sum(x.numel() * x.element_size() for x in model.parameters()),
                "marks": marks, "pss_before": pss_before, "pss_loaded": pss_loaded,
                "pss_done": pss_loaded, "slot_bytes": holders[0].machine.slots.total_bytes
                if holders else 0}
    compiled = torch.compile(model, backend="dlo", options=OPTIONS, fullgraph=True)
    inputs = example_inputs(config, batch=1, height=p["hw"], width=p["hw"])
    with torch.no_grad():
        compiled(*inputs)
    done = time.perf_counter()
    marks["done"] = time.monotonic()
    holder = runtimes_holding(list(model.parameters()))[0]
    store = holder.store
    report = dlo_fx.memory_report(model)
    return {
        "load_s": loaded - start,
        "forward_s": done - loaded,
        "host_shard_bytes": report.host_shard_bytes,
        "expected_shard_bytes": sum(b.spec.shard_bytes for b in store.blocks),
        "model_bytes": sum(x.numel() * x.element_size() for x in model.parameters()),
        "dp": store.dp,
        "blocks": len(store.blocks),
        "max_block_bytes": max((b.spec.padded_bytes for b in store.blocks), default=0),
        "marks": marks,
        "pss_before": pss_before,
        "pss_loaded": pss_loaded,
        "pss_done": process_memory()["pss"],
        "slot_bytes": holder.machine.slots.total_bytes,
    }


# -- the parent: start ranks, sample their PSS ------------------------------------------------
def run_variant(variant: str, ckpt: str, p: dict, ranks: int, hz: float,
                timeout: float, thp: bool = True) -> dict:
    """Start ``ranks`` fresh workers and sample the sum of their process trees' PSS."""
    from dlo_fx.runtime import tree_rollup

    env = dict(os.environ)
    if thp:
        # PyTorch's CPU allocator then asks for transparent huge pages, which makes
        # /proc/PID/smaps_rollup cheap enough to read at >= 20 Hz.
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(ranks)]
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--init", init,
               "--world", str(ranks), "--ckpt", ckpt, "--params", json.dumps(p)]
        start = time.monotonic()
        procs = [subprocess.Popen(cmd + ["--rank", str(r), "--out", outs[r]], env=env,
                                  preexec_fn=lambda: os.nice(5))  # the sampler runs first
                 for r in range(ranks)]
        timeline: list[tuple[float, int]] = []
        split_at_peak: dict[str, int] = dict.fromkeys(SPLIT, 0)
        period = 1.0 / hz
        try:
            while not all(os.path.exists(o) for o in outs):
                if any(pr.poll() not in (None, 0) for pr in procs):
                    raise RuntimeError(f"a {variant} rank failed: exit codes "
                                       f"{[pr.poll() for pr in procs]}")
                if time.monotonic() - start > timeout:
                    raise RuntimeError(f"{variant} ranks did not finish within {timeout} s")
                tick = time.monotonic()
                splits = [tree_rollup(pr.pid, SPLIT) for pr in procs]
                split = {k: sum(x[k] for x in splits) for k in SPLIT}
                if split["Pss"] > split_at_peak["Pss"]:
                    split_at_peak = split
                timeline.append((tick, split["Pss"]))
                time.sleep(max(0.0, period - (time.monotonic() - tick)))
            elapsed = time.monotonic() - start
            results = [json.load(open(o)) for o in outs]
            for pr in procs:
                pr.wait(timeout=60)
        finally:
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
                    pr.wait()
    gaps = [b[0] - a[0] for a, b in zip(timeline, timeline[1:])]
    out = {"peak_pss": max(v for _, v in timeline), "split_at_peak": split_at_peak,
           "samples": len(timeline),
           "hz": len(timeline) / elapsed, "max_gap_s": max(gaps, default=0.0),
           "wall_s": elapsed, "ranks": results}
    if "marks" in results[0]:
        loaded = max(r["marks"]["loaded"] for r in results)
        out["peak_pss_loading"] = max((v for t, v in timeline if t <= loaded), default=0)
        out["peak_pss_compile_forward"] = max((v for t, v in timeline if t > loaded), default=0)
    return out


def measure(p: dict, *, ranks: int, reps: int, hz: float, cache_dir: str,
            timeout: float, variants: tuple[str, ...] = VARIANTS, warmup: bool = True) -> dict:
    ckpt = ensure_checkpoint(cache_dir, p)
    if warmup:  # the checkpoint into the page cache, so that every timed load reads it alike
        run_variant("dlo", ckpt, {**p, "load_only": True}, ranks, hz, timeout)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for rep in range(reps):
        order = VARIANTS if rep % 2 == 0 else ("idle", "baseline", "dlo")
        for variant in (v for v in order if v in variants):
            runs[variant].append(run_variant(variant, ckpt, p, ranks, hz, timeout))
            print(f"rep {rep + 1}/{reps} {NAMES[variant]}: peak PSS "
                  f"{runs[variant][-1]['peak_pss'] / 1e9:.2f} GB", file=sys.stderr)
    return summarise(runs, ckpt, p, ranks, reps, hz)


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def summarise(runs: dict, ckpt: str, p: dict, ranks: int, reps: int, hz: float) -> dict:
    idle = _median([sum(r["pss"] for r in run["ranks"]) for run in runs["idle"]])
    model = runs["dlo"][0]["ranks"][0]["model_bytes"]
    out: dict[str, Any] = {
        "checkpoint_bytes": os.path.getsize(ckpt), "model_bytes": model, "ranks": ranks,
        "reps": reps, "target_hz": hz, "params": p, "idle_pss_sum": idle,
        "goal_bytes": BOUND * model + idle, "machine": f"{platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}", "variants": {},
    }
    for variant in ("dlo", "baseline"):
        rs = runs[variant]
        if not rs:  # not measured (--variants)
            continue
        peak = _median([r["peak_pss"] for r in rs])
        per_rank = [rank for r in rs for rank in r["ranks"]]
        out["variants"][variant] = {
            "peak_pss": peak,
            "peak_over_idle_x_model": (peak - idle) / model,
            "peak_pss_loading": _median([r["peak_pss_loading"] for r in rs]),
            "peak_pss_compile_forward": _median([r["peak_pss_compile_forward"] for r in rs]),
            "pss_loaded_sum": _median([sum(x["pss_loaded"] for x in r["ranks"]) for r in rs]),
            "pss_done_sum": _median([sum(x["pss_done"] for x in r["ranks"]) for r in rs]),
            "host_shard_bytes": sorted({x["host_shard_bytes"] for x in per_rank}),
            "shard_bytes_match": all(x["host_shard_bytes"] == x["expected_shard_bytes"]
                                     for x in per_rank),
            "load_s": _median([x["load_s"] for x in per_rank]),
            "forward_s": _median([x["forward_s"] for x in per_rank]),
            "blocks": per_rank[0]["blocks"],
            "max_block_bytes": per_rank[0]["max_block_bytes"],
            "min_hz": min(r["hz"] for r in rs),
            "max_gap_s": max(r["max_gap_s"] for r in rs),
            "peaks": [r["peak_pss"] for r in rs],
            # the run whose peak is the median's (the lower middle one for an even count)
            "split_at_peak": sorted(rs, key=lambda r: r["peak_pss"])[(len(rs) - 1) // 2][
                "split_at_peak"],
            "pss_before_sum": _median([sum(x["pss_before"] for x in r["ranks"]) for r in rs]),
            "slot_bytes_sum": sum(x["slot_bytes"] for x in rs[0]["ranks"]),
        }
    dlo = out["variants"]["dlo"]
    out["goal_met"] = dlo["peak_pss"] <= out["goal_bytes"] and dlo["shard_bytes_match"]
    out["bound"] = BOUND
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def verdict(s: dict) -> str:
    """One line: the dlo peak against the bound."""
    d = s["variants"]["dlo"]
    over = (d["peak_pss"] - s["idle_pss_sum"]) / s["model_bytes"]
    return (f"dlo_fx.load: (peak - idle ranks) / model = {over:.3f} x against the bound "
            f"{s['bound']:.2f} x (ratio {over / s['bound']:.3f}; peak / goal "
            f"{d['peak_pss'] / s['goal_bytes']:.3f}): "
            f"{'met' if s['goal_met'] else 'NOT met'}")


def markdown(s: dict) -> str:
    d = s["variants"]["dlo"]
    b = s["variants"].get("baseline")
    model, idle = s["model_bytes"], s["idle_pss_sum"]
    p = s["params"]
    measured = [v for v in (d, b) if v is not None]

    def row(name: str, key: str, fmt=_gb) -> str:
        return f"| {name} | {fmt(d[key])} | {fmt(b[key]) if b else '-'} |"

    def x_model(key: str) -> str:
        base = f"{(b['peak_pss'] - idle) / model:.2f} x" if b else "-"
        return f"| {key} | {(d['peak_pss'] - idle) / model:.2f} x | {base} |"

    def split(name: str, key: str) -> str:
        return (f"| {name} | {_gb(d['split_at_peak'][key])} | "
                f"{_gb(b['split_at_peak'][key]) if b else '-'} |")

    lines = [
        f"Reference DiT width {p['width']}, depth {p['depth']}"
        f"{' (layers under word keys)' if p.get('layout') == 'words' else ''} (bfloat16): model "
        f"{_gb(model)}, checkpoint {_gb(s['checkpoint_bytes'])}; {s['ranks']} ranks, each a "
        f"fresh process (gloo), `mode=\"allgather\"`; each loads, compiles with "
        f"`backend=\"dlo\"` and runs one forward. PSS of every rank's process tree summed, "
        f"sampled at {min(v['min_hz'] for v in measured):.0f} Hz or more (longest gap "
        f"{max(v['max_gap_s'] for v in measured) * 1000:.0f} ms) from process start to the "
        f"first finished forward; median of {s['reps']} repetition(s) after a warm-up load; "
        f"{s['machine']}.",
        "",
        "| figure (all ranks) | dlo_fx.load | load_state_dict |",
        "| --- | --- | --- |",
        row("peak PSS, start to first forward", "peak_pss"),
        x_model("(peak - idle ranks) / model"),
        split("... of it anonymous (shards, slots, heap)", "Pss_Anon"),
        split("... of it file-backed (libraries, a mapped checkpoint)", "Pss_File"),
        split("... of it page-locked", "Locked"),
        row("PSS before loading", "pss_before_sum"),
        row("peak PSS while loading", "peak_pss_loading"),
        row("PSS after loading", "pss_loaded_sum"),
        row("peak PSS, compile + first forward", "peak_pss_compile_forward"),
        row("PSS after the first forward", "pss_done_sum"),
        row("slots (num_slots x largest block, per rank, summed)", "slot_bytes_sum"),
        f"| host weight bytes per rank (steady) | "
        f"{', '.join(_gb(x) for x in d['host_shard_bytes'])} | "
        f"{', '.join(_gb(x) for x in b['host_shard_bytes']) if b else '-'} |",
        f"| = that rank's shard bytes | {'yes' if d['shard_bytes_match'] else 'NO'} | "
        f"{('yes' if b['shard_bytes_match'] else 'NO') if b else '-'} |",
        row("load time per rank", "load_s", lambda v: f"{v:.1f} s"),
        row("compile + first forward per rank", "forward_s", lambda v: f"{v:.1f} s"),
        f"| host blocks (largest) | {d['blocks']} ({_gb(d['max_block_bytes'])}) | "
        f"{b['blocks'] if b else '-'} |",
        "",
        f"Idle ranks (torch and dlo_fx imported, process group joined): {_gb(idle)} in all. "
        f"Goal for dlo_fx.load: peak <= {s['bound']} x model + idle ranks = "
        f"{_gb(s['goal_bytes'])}: **{'met' if s['goal_met'] else 'not met'}** (peak / goal = "
        f"{d['peak_pss'] / s['goal_bytes']:.2f}).",
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one repetition")
    parser.add_argument("--reps", type=int, help="repetitions (median); default 3 (1 quick)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hz", type=float, default=50.0, help="target PSS sampling rate")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(),
                                                            "dlo_fx_bench_load"),
                        help="where the checkpoint is written once and reused")
    parser.add_argument("--timeout", type=float, default=900.0, help="per variant run, s")
    parser.add_argument("--markdown", action="store_true", help="print the docs table")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--layout", choices=("numbered", "words"), default="numbered",
                        help="layers in a ModuleList (blocks.0) or a ModuleDict (blocks.layer_a)")
    parser.add_argument("--width", type=int, help="override the model width")
    parser.add_argument("--depth", type=int, help="override the number of layers")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="which of idle,dlo,baseline to run (idle and dlo always)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the warm-up load that fills the page cache")
    parser.add_argument("--load-only", action="store_true",
                        help="measure loading only (no compile, no forward)")
    # worker-only arguments
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    for name in ("--init", "--ckpt", "--params", "--out"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    p = dict(QUICK if args.quick else FULL)
    reps = args.reps or p.pop("reps")
    p.pop("reps", None)
    p["layout"] = args.layout
    p["load_only"] = args.load_only
    p.update({k: v for k, v in (("width", args.width), ("depth", args.depth)) if v})
    variants = tuple(v for v in VARIANTS if v in {"idle", "dlo", *args.variants.split(",")})
    summary = measure(p, ranks=args.ranks, reps=reps, hz=args.hz, cache_dir=args.cache_dir,
                      timeout=args.timeout, variants=variants, warmup=not args.no_warmup)
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if args.markdown:
        print(markdown(summary))
    print(verdict(summary))
    return 0 if summary["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())

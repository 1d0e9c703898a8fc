"""DLO AllGather vs FSDP2 on CPU (gloo, 2 ranks), plus dp=2 vs dp=1, AllGather vs
rank-local, and the cost of the auto device budget's per-call agreement, all measured in
one run.

    python benchmarks/bench_sharding.py [--markdown]
    python benchmarks/bench_sharding.py --groups [--markdown]

``--groups`` measures the engine's gather groups instead: 4 ranks as 2 replicas of 2
(DP2 x SP2, `Topology(2, 2)`), each variant the same reference DiT compiled with one
rank's ``shard_group`` of ``gather="sp"`` (the replica's pair), ``"dp"`` (the strided
pair), ``"world"`` (all 4) and ``"none"`` (rank-local), timed interleaved the same way,
with each rank's host bytes, all against rank-local. Every rank computes the same input
here (no context parallelism: the gathers are what differs).

Each rank is a process with one thread. Every variant is built and warmed up first, then
the variants are timed interleaved (A B C D, A B C D, ...); a forward's latency is the
slowest rank's, and each figure is the median of ``--runs``. FSDP2 is ``fully_shard`` per
DiT block and at the root with ``reshard_after_forward=True`` on a CPU mesh, running the
same reference DiT eagerly (its hooks would break the graph under torch.compile).
``dlo_allgather_auto`` is ``dlo_allgather`` with ``device_budget="auto"`` and a declared
capacity of 1 GiB, which leaves no room for resident blocks (the margin alone is 1 GiB):
the same schedule, plus the ranks' agreement on each call's plan (one clock exchange per
graph call, see [Note: the auto budget of ranks gathering]).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _timing import write_json


def build_variants(args, rank: int):
    from dlo_fx.apps.models import reference_dit
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def dit():
        return reference_dit(width=args.width, depth=args.depth, heads=args.heads, seed=0)

    variants, host_bytes, models = {}, {}, {}
    for name, options in (("dlo_allgather", {"mode": "allgather"}),
                          ("dlo_rank_local", {"mode": "rank_local"}),
                          ("dlo_allgather_auto", {"mode": "allgather", "device_budget": "auto",
                                                  "device_memory": 1 << 30})):
        model = dit()
        variants[name] = torch.compile(model, backend="dlo", fullgraph=True, options=options)
        models[name] = model  # not an attribute of the wrapper: it would set one on the model
    fsdp = dit()
    for block in fsdp.blocks:  # FSDP2 refuses non-contiguous parameters
        block.fc2_weight = torch.nn.Parameter(block.fc2_weight.detach().contiguous(),
                                              requires_grad=False)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(fsdp, mesh=mesh, reshard_after_forward=True)
    variants["fsdp2"] = fsdp
    host_bytes["fsdp2"] = sum(p.to_local().numel() * p.element_size() for p in fsdp.parameters())
    if rank == 0:  # dp = 1: one process streams the whole model while the other idles
        model = dit()
        variants["dlo_dp1"] = torch.compile(model, backend="dlo", fullgraph=True,
                                            options={"shard_group": [0]})
        models["dlo_dp1"] = model
    return variants, host_bytes, models


def worker(rank: int, world: int, init: str, args, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import dlo_fx
    from dlo_fx.apps.models import DiTConfig, example_inputs

    config = DiTConfig(width=args.width, depth=args.depth, heads=args.heads)
    inputs = example_inputs(config, height=args.size, width=args.size, seed=rank)
    variants, host_bytes, models = build_variants(args, rank)
    order = ["dlo_allgather", "fsdp2", "dlo_rank_local", "dlo_allgather_auto", "dlo_dp1"]
    times: dict[str, list[float]] = {k: [] for k in order}
    outputs = {}

    def run(name: str, record: bool) -> None:
        dist.barrier()
        if name == "dlo_dp1" and rank != 0:
            dist.barrier()
            return
        start = time.perf_counter()
        with torch.inference_mode():
            out = variants[name](*inputs)
        elapsed = time.perf_counter() - start
        if name == "dlo_dp1":
            dist.barrier()
        if record:
            times[name].append(elapsed)
            outputs[name] = out

    for _ in range(args.warmup):
        for name in order:
            run(name, False)
    for _ in range(args.runs):
        for name in order:
            run(name, True)
    for name in ("dlo_allgather", "dlo_rank_local", "dlo_allgather_auto", "dlo_dp1"):
        if name in variants:
            host_bytes[name] = dlo_fx.memory_report(models[name]).host_shard_bytes
    # a forward's latency is the slowest rank's
    slowest = {}
    for name in order:
        mine = torch.tensor(times[name] or [0.0] * args.runs, dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        slowest[name] = mine.tolist()
    same = (torch.equal(outputs["dlo_allgather"], outputs["dlo_rank_local"])
            and torch.equal(outputs["dlo_allgather"], outputs["dlo_allgather_auto"]))
    if rank == 0:
        same &= torch.equal(outputs["dlo_allgather"], outputs["dlo_dp1"])
        with open(out_path, "w") as f:
            json.dump({"latency_s": slowest, "host_weight_bytes_per_rank": host_bytes,
                       "dlo_modes_bit_identical": same}, f)
    dist.destroy_process_group()


GROUPS = ("sp", "dp", "world", "none")


def groups_worker(rank: int, world: int, init: str, args, out_path: str) -> None:
    """The gather groups of DP2 x SP2 (see the module docstring), on one rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import dlo_fx
    from dlo_fx.apps.engine import Topology
    from dlo_fx.apps.models import DiTConfig, example_inputs, reference_dit

    topology = Topology(2, 2)
    config = DiTConfig(width=args.width, depth=args.depth, heads=args.heads)
    inputs = example_inputs(config, height=args.size, width=args.size, seed=0)
    variants, models = {}, {}
    for name in GROUPS:
        model = reference_dit(width=args.width, depth=args.depth, heads=args.heads, seed=0)
        options = {"shard_group": list(topology.gather_group(rank, name))}
        variants[name] = torch.compile(model, backend="dlo", fullgraph=True, options=options)
        models[name] = model
    times: dict[str, list[float]] = {k: [] for k in GROUPS}
    outputs = {}
    for record in [False] * args.warmup + [True] * args.runs:
        for name in GROUPS:
            dist.barrier()
            start = time.perf_counter()
            with torch.inference_mode():
                out = variants[name](*inputs)
            if record:
                times[name].append(time.perf_counter() - start)
                outputs[name] = out
    host = {name: dlo_fx.memory_report(models[name]).host_shard_bytes for name in GROUPS}
    slowest, hosts = {}, {}
    for name in GROUPS:
        mine = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        slowest[name] = mine.tolist()
        most = torch.tensor([host[name]], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        hosts[name] = int(most.item())
    same = all(torch.equal(outputs[name], outputs["none"]) for name in GROUPS)
    flag = torch.tensor([int(same)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"latency_s": slowest, "host_weight_bytes_per_rank": hosts,
                       "bit_identical": bool(flag.item())}, f)
    dist.destroy_process_group()


def summarize_groups(raw: dict, args) -> dict:
    med = {k: statistics.median(v) for k, v in raw["latency_s"].items()}
    hb = raw["host_weight_bytes_per_rank"]
    return {"setup": vars(args), "topology": "dp=2 x sp=2", "median_latency_s": med,
            "host_weight_bytes_per_rank": hb,
            "latency_over_rank_local": {k: med[k] / med["none"] for k in GROUPS},
            "host_bytes_over_rank_local": {k: hb[k] / hb["none"] for k in GROUPS},
            "bit_identical": raw["bit_identical"]}


def markdown_groups(s: dict) -> str:
    a = s["setup"]
    med, hb = s["median_latency_s"], s["host_weight_bytes_per_rank"]
    lat, host = s["latency_over_rank_local"], s["host_bytes_over_rank_local"]
    names = {"sp": "sp: the replica's pair (0,1), (2,3)", "dp": "dp: the strided pair (0,2), "
             "(1,3)", "world": "world: all 4 ranks", "none": "none: rank-local"}
    lines = [f"Reference DiT width {a['width']}, {a['depth']} layers, bf16, "
             f"{(a['size'] // 2) ** 2 + 8} tokens; 4 ranks (gloo) as DP2 x SP2, one thread "
             f"each; median of {a['runs']} interleaved runs after {a['warmup']} warm-up; "
             "latency = slowest rank; host bytes = the largest rank's.", "",
             "| gather group | median latency | / rank-local | host weight bytes per rank "
             "| / rank-local |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {names[k]} | {med[k] * 1e3:.1f} ms | {lat[k]:.2f} | {hb[k] / 2**20:.1f} MiB "
              f"| {host[k]:.3f} |" for k in GROUPS]
    lines += ["", f"- outputs bit-identical across the groups: {s['bit_identical']}"]
    return "\n".join(lines)


def summarize(raw: dict, args) -> dict:
    med = {k: statistics.median(v) for k, v in raw["latency_s"].items()}
    hb = raw["host_weight_bytes_per_rank"]
    return {
        "setup": vars(args), "median_latency_s": med, "host_weight_bytes_per_rank": hb,
        "dlo_over_fsdp2_latency": med["dlo_allgather"] / med["fsdp2"],
        "dlo_over_fsdp2_host_bytes": hb["dlo_allgather"] / hb["fsdp2"],
        "dp2_over_dp1_throughput": (2 / med["dlo_allgather"]) / (1 / med["dlo_dp1"]),
        "allgather_over_rank_local_latency": med["dlo_allgather"] / med["dlo_rank_local"],
        "allgather_over_rank_local_host_bytes": hb["dlo_allgather"] / hb["dlo_rank_local"],
        "auto_agreement_over_allgather_latency": med["dlo_allgather_auto"] / med["dlo_allgather"],
        "auto_agreement_extra_ms": (med["dlo_allgather_auto"] - med["dlo_allgather"]) * 1e3,
        "dlo_modes_bit_identical": raw["dlo_modes_bit_identical"],
    }


def markdown(s: dict) -> str:
    a = s["setup"]
    med, hb = s["median_latency_s"], s["host_weight_bytes_per_rank"]
    rows = [
        ("DLO allgather, dp=2", med["dlo_allgather"], hb["dlo_allgather"]),
        ("FSDP2 fully_shard per block, dp=2", med["fsdp2"], hb["fsdp2"]),
        ("DLO rank-local, dp=2", med["dlo_rank_local"], hb["dlo_rank_local"]),
        ("DLO allgather, dp=2, device_budget='auto' (no block fits: agreement only)",
         med["dlo_allgather_auto"], hb["dlo_allgather_auto"]),
        ("DLO dp=1 (one process)", med["dlo_dp1"], hb["dlo_dp1"]),
    ]
    lines = [f"Reference DiT width {a['width']}, {a['depth']} layers, bf16, "
             f"{(a['size'] // 2) ** 2 + 8} tokens; 2 ranks (gloo), one thread each; median of "
             f"{a['runs']} interleaved runs after {a['warmup']} warm-up; latency = slowest rank.",
             "", "| variant | median latency | host weight bytes per rank |", "| --- | --- | --- |"]
    lines += [f"| {n} | {t * 1e3:.1f} ms | {b / 2**20:.1f} MiB |" for n, t, b in rows]
    lines += ["", f"- DLO / FSDP2 latency: **{s['dlo_over_fsdp2_latency']:.3f}** (target <= 1)",
              f"- DLO / FSDP2 host weight bytes per rank: **{s['dlo_over_fsdp2_host_bytes']:.3f}** "
              "(target <= 1)",
              f"- throughput dp=2 / dp=1: {s['dp2_over_dp1_throughput']:.2f}x",
              f"- allgather / rank-local: latency {s['allgather_over_rank_local_latency']:.3f}, "
              f"host bytes {s['allgather_over_rank_local_host_bytes']:.3f}",
              f"- the auto budget's per-call agreement: {s['auto_agreement_extra_ms']:+.2f} ms "
              f"per forward ({s['auto_agreement_over_allgather_latency']:.3f} x allgather)",
              f"- DLO outputs bit-identical across modes and dp: {s['dlo_modes_bit_identical']}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--size", type=int, default=16, help="latent height/width")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="bench-out/sharding.json")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--groups", action="store_true",
                        help="the engine's gather groups at DP2 x SP2 (4 ranks) instead")
    args = parser.parse_args(argv)
    target, ranks = (groups_worker, 4) if args.groups else (worker, 2)
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = os.path.join(tmp, "raw.json")
        mp.spawn(target, args=(ranks, "file://" + os.path.join(tmp, "rdzv"), args, raw_path),
                 nprocs=ranks, join=True)
        with open(raw_path) as f:
            raw = json.load(f)
    if args.groups:
        summary = summarize_groups(raw, args)
        out = args.out.replace("sharding.json", "sharding-groups.json")
        write_json(out, summary, indent=1)
        print(markdown_groups(summary) if args.markdown else json.dumps(summary, indent=1))
        return 0
    summary = summarize(raw, args)
    write_json(args.out, summary, indent=1)
    print(markdown(summary) if args.markdown else json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

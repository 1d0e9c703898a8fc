"""Case functions run on every rank by `distributed.spawn` (many sub-cases per spawn)."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.fx.node import has_side_effect

from dlo_fx.runtime.weights.owners import reset_runtimes

from errors import described, error_text
from models import MODELS, call, offloaded, run_dlo, runtime_figures, tiny_dit


def _fresh() -> None:
    torch._dynamo.reset()
    reset_runtimes()


def run_model(name: str, options: dict, fullgraph: bool = True, calls: int = 2, **kw):
    """Bit-identity against the resident model, and the runtime's figures."""
    _fresh()
    ref, outs, model = run_dlo(MODELS[name], options, calls=calls, fullgraph=fullgraph, **kw)
    return {"equal": all(torch.equal(out, ref) for out in outs), **runtime_figures(model)}


def sharding_cases(rank: int, world: int, models: tuple[str, ...], folder: str) -> dict:
    out = {}
    for name in models:
        for mode in ("allgather", "rank_local"):
            out[(name, mode)] = run_model(name, {"mode": mode})
    out[("dit-break", "allgather")] = run_model("dit", {"mode": "allgather", "num_slots": 3},
                                                fullgraph=False, calls=3, graph_break=True)
    out["offload"] = {(name, mode): run_model(name, {"mode": mode})
                      for name in ("dit", "flux") for mode in ("allgather", "rank_local")}
    # Ranks that schedule different plans must all raise, naming the block, not hang.
    _fresh()
    model, inputs = tiny_dit()
    budget = 20_000 if rank == 0 else 60_000
    try:  # the ranks plan the blocks at the offload
        offloaded(model, {"block_bytes": budget, "collective_timeout_s": 30})
        compiled = torch.compile(model, backend="dlo", fullgraph=True)
        with torch.no_grad():
            call(compiled, inputs)
        out["mismatch"] = None
    except Exception as exc:  # the ValueError
        out["mismatch"] = described(exc)
    out.update(process_group_changes(rank, world, folder))  # last: it replaces the group
    return out


def process_group_changes(rank: int, world: int, folder: str) -> dict:
    """Compiles before ``init_process_group`` (dp = 1), after it, and after a destroy and
    a new init: each uses the process group of its time, never a group resolved before."""
    out = {}
    dist.destroy_process_group()
    out["before-init"] = run_model("dit", {"mode": "allgather"})
    for n in (1, 2):
        dist.init_process_group("gloo", init_method=f"file://{folder}/world-{n}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        out[f"init-{n}"] = run_model("dit", {"mode": "allgather"})
        if n == 1:
            dist.destroy_process_group()
    return out


def group_cases(rank: int, world: int) -> dict:
    """World 4 gathering over two 2-rank groups (DP replicas each hold their own copy)."""
    group = [0, 1] if rank < 2 else [2, 3]
    out = {name: run_model(name, {"shard_group": group}) for name in ("dit", "wan")}
    auto = run_model("dit", {"shard_group": group, "mode": "auto"})
    runtime_reason = auto.pop("reason")
    return {**out, "auto": auto, "auto_reason": runtime_reason}


def _peak_rss_reset() -> int:
    """Reset this process's peak RSS (``VmHWM``) to its RSS now, and return that."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def host_gather_case(rank: int, world: int, shard_bytes: int) -> dict:
    """A block gathered on the host (gloo): exact, and the peak RSS it adds to the
    process (``VmHWM``, reset just before) -- gloo's AllGather held a second block."""
    from dlo_fx.runtime.ranks.collectives import gather_in_place, resolve_shard_group

    group = resolve_shard_group(None, 60.0)
    flat = torch.zeros(shard_bytes * world, dtype=torch.uint8)
    out = {}
    for turn in ("warm", "measured"):  # the first gather opens the group's connections
        flat.zero_()
        flat[rank * shard_bytes : (rank + 1) * shard_bytes].fill_(rank + 1)
        expected = torch.arange(1, world + 1, dtype=torch.uint8).repeat_interleave(shard_bytes)
        before = _peak_rss_reset()
        gather_in_place(flat, shard_bytes, group, f"a {turn} test block")
        out[turn] = {"equal": torch.equal(flat, expected),
                     "peak_growth": _status_bytes("VmHWM") - before}
        del expected
    return out


# -- failures ----------------------------------------------------------------------------
def _fail_here(how: str, rank: int) -> None:
    if dist.get_rank() != rank:
        return
    if how == "die":
        os._exit(17)
    raise RuntimeError(f"injected failure on rank {rank}")


has_side_effect(_fail_here)


def _inject(how: str, rank: int):
    def fail_after_second_wait(gm, ctx):
        waits = [n for n in gm.graph.nodes if n.meta.get("dlo", {}).get("kind") == "wait"]
        with gm.graph.inserting_after(waits[1]):
            gm.graph.call_function(_fail_here, (how, rank))
        return gm
    return fail_after_second_wait


def failure_cases(rank: int, world: int, timeout_s: float) -> dict:
    out = {}
    for how in ("raise", "die"):
        _fresh()
        model, inputs = tiny_dit(depth=6)
        options = {"collective_timeout_s": timeout_s, "user_passes": [_inject(how, 1)],
                   "block_bytes": 40_000}
        compiled = torch.compile(offloaded(model, options), backend="dlo", fullgraph=True,
                                 options=options)
        start = time.monotonic()
        try:
            with torch.no_grad():
                call(compiled, inputs)
            out[how] = None
        except Exception as exc:
            out[how] = (time.monotonic() - start, error_text(exc))
    return out  # rank 1 never gets here: it died in the second case

"""Case function of the diffusers zoo, run on every rank by `distributed.spawn`.

A spawn of two ranks runs a group of models through the matrix: dp=1 with a shard
group of one rank (the models split between the ranks, the ``rank_local`` and
``allgather`` options alternating; one rank has nothing to gather, so both run
rank-local), then dp=2 over both ranks in the modes asked for (`make test`: allgather;
`make zoo`: both). Every case is caught and reported,
so one failing model does not hide the rest of the table.
"""

from __future__ import annotations

import time

import torch


from dlo_fx.runtime.weights.stored import is_stored
from dlo_fx.runtime.weights.owners import reset_runtimes, runtimes_holding

from errors import error_text
from models import offloaded
from zoo_models import build, by_name, outputs

MODES = ("rank_local", "allgather")


def run_case(name: str, options: dict, calls: int = 2) -> dict:
    """Resident reference vs ``calls`` calls of the dlo-compiled twin, with the figures."""
    torch._dynamo.reset()
    reset_runtimes()
    entry = by_name(name)
    start, cpu = time.monotonic(), time.process_time()
    result: dict = {"exact": False, "error": None}
    try:
        ref_model, inputs = build(entry)
        with torch.no_grad():
            ref = outputs(ref_model(**inputs))
        model, inputs = build(entry)
        offloaded(model, options)
        compiled = torch.compile(model, backend="dlo")  # inherits the options
        worst = 0.0
        exact = True
        for _ in range(calls):
            with torch.no_grad():
                outs = outputs(compiled(**inputs))
            exact &= len(outs) == len(ref) and all(torch.equal(o, r) for o, r in zip(outs, ref))
            if len(outs) == len(ref):
                worst = max([worst] + [(o.double() - r.double()).abs().max().item()
                                       for o, r in zip(outs, ref) if o.shape == r.shape])
        result.update(exact=bool(exact), max_abs_diff=worst, **_figures(model))
    except Exception as exc:  # reported per case; the test fails on it
        result["error"] = error_text(exc)[-600:]
    result["seconds"] = time.monotonic() - start
    result["cpu_seconds"] = time.process_time() - cpu
    return result


def _figures(model: torch.nn.Module) -> dict:
    """Streamed share of the parameter bytes, from the runtime's own accounting."""
    params = list(dict.fromkeys(model.parameters()))
    total = sum(p.numel() * p.element_size() for p in params)
    runtimes = runtimes_holding(params)
    stored = [p for p in params if any(p in rt.store for rt in runtimes)]
    blocks = {(id(rt), rt.store.entry(p).block) for rt in runtimes for p in stored if p in rt.store}
    return {
        "param_bytes": total,
        "streamed_bytes": sum(p.numel() * p.element_size() for p in stored),
        # Every parameter in the host store is a StoredWeight (after the first call)
        "stored": all(is_stored(p) for p in stored),
        "blocks": len(blocks),
        "runtimes": len(runtimes),  # one model, one runtime (however Dynamo splits its frames)
        "mode": runtimes[0].mode if runtimes else None,
        "dp": runtimes[0].store.dp if runtimes else None,
    }


def zoo_cases(rank: int, world: int, names: tuple[str, ...], timeout_s: float,
              modes: tuple[str, ...] = MODES) -> dict:
    out = {}
    for i, name in enumerate(names):  # dp=1: each rank alone on its share of the models
        if i % world != rank:
            continue
        mode = MODES[(i // world) % 2]
        options = {"mode": mode, "shard_group": [rank], "resident_bytes": 0,
                   "collective_timeout_s": timeout_s}
        out[(name, 1, mode)] = run_case(name, options)
    for name in names:
        for mode in modes:
            options = {"mode": mode, "resident_bytes": 0, "collective_timeout_s": timeout_s}
            out[(name, world, mode)] = run_case(name, options)
    return out


def table(results: dict, world: int) -> str:
    """The zoo table in Markdown: one row per model, one column group per (dp, mode)."""
    columns = [(1, None), (world, "rank_local"), (world, "allgather")]
    head = "| model | dp=1 | " + " | ".join(f"dp={dp} {mode}" for dp, mode in columns[1:]) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for name in dict.fromkeys(key[0] for key in results):
        cells = []
        for dp, mode in columns:
            r = (results.get((name, dp, mode)) if mode else
                 results.get((name, 1, "rank_local")) or results.get((name, 1, "allgather")))
            if r is None:
                cells.append("")
            elif r["error"]:
                cells.append("error: " + r["error"].splitlines()[-1][:60].replace("|", "/"))
            else:
                share = r["streamed_bytes"] / max(r["param_bytes"], 1)
                verdict = "exact" if r["exact"] else f"WRONG ({r['max_abs_diff']:.1e})"
                cells.append(f"{verdict}, {r['blocks']} blocks, {share:.0%}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

"""Case functions for the multi-rank safety tests (run on every rank by `distributed.spawn`)."""

from __future__ import annotations

import torch

from dlo_fx.runtime.graph_call import ClockMismatch
from dlo_fx.runtime.runtime import reset_runtimes

from models import call, run_dlo, tiny_dit
import safety_models
from safety_models import FAIL, eager_head_dit, fail_after_half_the_waits, tiny_hidream


def _fresh() -> None:
    torch._dynamo.reset()
    reset_runtimes()
    FAIL.update(rank=None, at=-1, seen=0)


def _outcome(fn):
    try:
        return fn()
    except ClockMismatch:
        return "clock"
    except KeyboardInterrupt:
        return "interrupt"
    except IndexError:
        return "index"


def _exact(factory, options, calls: int = 2, fullgraph: bool = False, **kw) -> list:
    _fresh()
    ref, outs, _ = run_dlo(factory, options, calls=calls, fullgraph=fullgraph, **kw)
    return [torch.equal(out, ref) for out in outs]


def _failing(rank: int, mode: str, kind: str, graph_break: bool, calls: int) -> list:
    """Rank 1 fails once in its second call, half-way through a graph; the outcome of
    every call on this rank (True: exact)."""
    _fresh()
    ref_model, inputs = tiny_dit(depth=6, graph_break=graph_break)
    with torch.no_grad():
        ref = call(ref_model, inputs)
    model, _ = tiny_dit(depth=6, graph_break=graph_break)
    options = {"mode": mode, "block_bytes": 40_000, "collective_timeout_s": 30,
               "user_passes": [fail_after_half_the_waits]}
    compiled = torch.compile(model, backend="dlo", options=options)
    with torch.no_grad():
        first = torch.equal(call(compiled, inputs), ref)  # every graph compiled
        FAIL.update(rank=1, at=FAIL["seen"] + 1, kind=kind)
        return [first] + [_outcome(lambda: torch.equal(call(compiled, inputs), ref))
                          for _ in range(calls)]


def safety_cases(rank: int, world: int) -> dict:
    out = {}
    # 1. allgather with several graphs per forward (a copy racing a gather into its slot)
    out["hidream"] = _exact(tiny_hidream, {"mode": "allgather", "resident_bytes": 0,
                                           "collective_timeout_s": 30})
    # 2. eager code reading streamed parameters: fetched (a gather) in step on both ranks
    out["eager"] = _exact(eager_head_dit, {"mode": "allgather", "resident_bytes": 0,
                                           "collective_timeout_s": 30}, calls=3)
    # 5. one rank raises mid-graph: it completes the graph's gathers, both stay exact
    for mode in ("allgather", "rank_local"):
        for kind in ("index", "interrupt"):
            out[("fail", mode, kind)] = _failing(rank, mode, kind, False, calls=3)
    # ... between graphs: the clock makes both raise once, then both are exact again
    out[("fail", "allgather", "index", "break")] = _failing(
        rank, "allgather", "index", True, calls=3 if rank == 0 else 4)
    # 8. different weights of the same shapes on each rank
    _fresh()
    model, inputs = tiny_dit(seed=rank)
    compiled = torch.compile(model, backend="dlo", options={"mode": "allgather"})
    try:
        with torch.no_grad():
            call(compiled, inputs)
        out["weights"] = None
    except Exception as exc:
        inner = getattr(exc, "inner_exception", exc)
        out["weights"] = (type(inner).__name__, str(inner))
    _fresh()
    return out

"""The device budget's runs, shared by tests/test_budget.py at dp=1 and in a dp=2 spawn."""

from __future__ import annotations

from typing import Optional

import torch

import dlo_fx
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.runtime.weights.stored import is_stored
from dlo_fx.runtime.weights.owners import reset_runtimes, runtimes_holding

from models import call, offloaded, tiny_dit

DEPTH = 6


def fresh() -> None:
    torch._dynamo.reset()
    reset_runtimes()


def plan_of(model: torch.nn.Module):
    (plan,) = runtimes_holding(list(model.parameters()))[0].budget_plans.values()
    return plan


def run(options: dict, *, checkpoint: Optional[str] = None, calls: int = 2) -> dict:
    """A budgeted compile of the tiny DiT (loaded from ``checkpoint`` when given): whether
    every call equals the resident model, and the budget plan."""
    fresh()
    ref_model, inputs = tiny_dit(depth=DEPTH)
    with torch.no_grad():
        ref = call(ref_model, inputs)
    if checkpoint is None:
        model = offloaded(tiny_dit(depth=DEPTH)[0], options)
    else:
        model = dlo_fx.load(lambda: ReferenceDiT(ref_model.config), checkpoint, options=options)
    compiled = torch.compile(model, backend="dlo", fullgraph=True, options=options)
    with torch.no_grad():
        outs = [call(compiled, inputs) for _ in range(calls)]
    runtime = runtimes_holding(list(model.parameters()))[0]
    copies = runtime.machine.copies
    with torch.no_grad():
        call(compiled, inputs)
    plan = plan_of(model)
    return {"equal": all(torch.equal(o, ref) for o in outs), "resident": plan.resident,
            "blocks": len(plan.block_bytes), "minimum": plan.minimum,
            "capacity": plan.capacity, "predicted_s": plan.predicted_s,
            "streamed_s": plan.streamed_s, "compute_s": plan.compute_s, "flops": plan.flops,
            "block_bytes": plan.block_bytes, "mode": runtime.mode,
            "copies_per_call": runtime.machine.copies - copies,
            "stored": sum(is_stored(p) for p in model.parameters()),
            "report": dlo_fx.memory_report(model), "plan": plan,
            "plan_budget": plan.device_budget}


def sweep(mode: Optional[str] = None, checkpoint: Optional[str] = None,
          names: tuple[str, ...] = ("full", "minimum", "partial"), room: int = 3) -> dict:
    """Budgets with room for every block, at the minimum, and with room for ``room``
    blocks (the full run tells the minimum and the block sizes)."""
    extra = {} if mode is None else {"mode": mode}
    out = {"full": run({**extra, "device_budget": 10**12}, checkpoint=checkpoint)}
    minimum, sizes = out["full"]["minimum"], out["full"]["block_bytes"]
    budgets = {"minimum": minimum, "partial": minimum + room * max(sizes)}
    for name in names[1:]:
        out[name] = run({**extra, "device_budget": budgets[name]}, checkpoint=checkpoint)
    return out


def one_rank_resolutions(rank: int, checkpoint: str, budget: int) -> dict:
    """Allgather, loaded, a partial budget: rank 1 alone calls at another resolution, then
    rank 0 alone. Each new resolution recompiles on that rank only and keeps the first
    compile's resident blocks (planned anew from its FLOPs, it kept others: the ranks
    streamed different blocks and raised ClockMismatch at every call)."""
    from dlo_fx.apps.models import example_inputs

    fresh()
    ref_model, _ = tiny_dit(depth=DEPTH)
    options = {"mode": "allgather", "device_budget": budget}
    model = dlo_fx.load(lambda: ReferenceDiT(ref_model.config), checkpoint, options=options)
    compiled = torch.compile(model, backend="dlo", options=options)
    equal, resident = [], []
    for i, sizes in enumerate([(8, 8), (8, 32), (8, 32), (32, 8), (8, 8)]):
        inputs = example_inputs(model.config, batch=1, height=sizes[rank], width=sizes[rank],
                                seed=i)
        with torch.no_grad():
            equal.append(torch.equal(call(compiled, inputs), call(ref_model, inputs)))
        resident.append(plan_of(model).resident)
    return {"equal": equal, "resident": resident}


def budget_cases(rank: int, world: int, checkpoint: str) -> dict:
    """dp=2: both modes, compiled from a whole model; allgather loaded from a checkpoint."""
    out = {}
    for key, mode, ckpt in (("allgather", "allgather", None), ("rank_local", "rank_local", None),
                            ("loaded", "allgather", checkpoint)):
        runs = sweep(mode, ckpt, names=("full", "partial"))
        for r in runs.values():
            r.pop("plan"), r.pop("report")
        out[key] = runs
    budget = out["loaded"]["partial"]["plan_budget"]
    out["one_rank_resolutions"] = one_rank_resolutions(rank, checkpoint, budget)
    return out

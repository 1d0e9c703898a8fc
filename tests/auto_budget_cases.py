"""The auto device budget with two ranks gathering, run by tests/test_auto_budget.py in a
dp=2 spawn: the compile's plan, one budget agreed over the ranks, no re-plan per call."""

from __future__ import annotations

import torch

import dlo_fx
from dlo_fx.apps.models import example_inputs
from dlo_fx.runtime import probes
from dlo_fx.runtime.weights.owners import reset_runtimes, runtimes_holding

from models import call, tiny_dit


def allgather_keeps_the_compile_plan(rank: int, world: int) -> dict:
    """``device_budget="auto"`` with ``device_memory`` in allgather mode: the budget is the
    capacity less a quarter, agreed once; every call at two shapes runs that plan, exactly."""
    torch._dynamo.reset()
    reset_runtimes()
    probes.probe_bandwidths = lambda device, group, nbytes=0: (1.0, 1e9)  # the same figures
    probes.probe_matmul_flops = lambda device, dtype, group: 1e10  # on both ranks
    ref, small = tiny_dit(depth=6)
    model, _ = tiny_dit(depth=6)
    dlo_fx.offload(model, options={"device": "cpu", "mode": "allgather",
                                   "device_memory": 800_000})
    compiled = torch.compile(model, backend="dlo")
    large = example_inputs(model.config, batch=2, height=16, width=16, seed=2)
    equal, resident = [], []
    runtime = runtimes_holding(list(model.parameters()))[0]
    with torch.no_grad():
        for inputs in (small, small, large, small):
            equal.append(torch.equal(call(compiled, inputs), call(ref, inputs)))
            resident.append([p.resident for p in runtime.budget_plans.values()])
    # Out of device memory on rank 1 only (a resident read that does not fit): rank 1
    # raises DeviceMemoryError, rank 0 completes (the failed graph's schedule ran without
    # compute), and the next calls run the same plan on both, exactly.
    errors, real = [], runtime.reads.resident_tensor
    if rank == 1:
        def once(param, clock=False):
            runtime.reads.resident_tensor = real
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        runtime.reads.resident_tensor = once
    after = []
    with torch.no_grad():
        for _ in range(3):
            try:
                after.append(torch.equal(call(compiled, small), call(ref, small)))
            except torch.OutOfMemoryError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
    (plan,) = runtime.budget_plans.values()
    return {"equal": equal, "resident": resident, "budget": plan.device_budget,
            "agreed": runtime.agreed_auto_budget, "records": len(runtime.device_memory),
            "mode": runtime.mode, "after": after, "errors": errors,
            "resident_after": [p.resident for p in runtime.budget_plans.values()]}

"""The auto device budget with two ranks gathering, run by tests/test_auto_budget.py in a
dp=2 spawn: each call re-planned from measured memory and agreed over the ranks (the
smallest budget), a 4x larger input re-planned before it runs, out-of-memory on one rank
(in a call, and allocating a resident block's copy), and the engine's gather-only padding
forwards. See [Note: the auto budget of ranks gathering] in dlo_fx/dynamo/auto_budget.py."""

from __future__ import annotations

import torch

import dlo_fx
from dlo_fx.apps.engine.clock import ForwardClock
from dlo_fx.apps.models import example_inputs
from dlo_fx.planning.device_memory import GIB
from dlo_fx.runtime import probes
from dlo_fx.runtime.weights.owners import reset_runtimes, runtimes_holding

from models import call, tiny_dit


def _elements(inputs) -> int:
    return sum(v.numel() for v in inputs if isinstance(v, torch.Tensor))


def _fresh() -> None:
    torch._dynamo.reset()
    reset_runtimes()
    probes.probe_bandwidths = lambda device, group, nbytes=0: (1.0, 1e9)  # the same figures
    probes.probe_matmul_flops = lambda device, dtype, group: 1e10  # on both ranks


def _sizes() -> tuple[int, list[int]]:
    """(minimum, block bytes) of the tiny DiT's plan in allgather mode on two ranks."""
    _fresh()
    model, inputs = tiny_dit(depth=6)
    dlo_fx.offload(model, options={"device": "cpu", "mode": "allgather",
                                   "device_memory": GIB + 10**9})
    with torch.no_grad():
        call(torch.compile(model, backend="dlo"), inputs)
    (plan,) = runtimes_holding(list(model.parameters()))[0].budget_plans.values()
    return plan.minimum, plan.block_bytes


def _model(rank: int, capacity: int, per_element: int, extra: int):
    """The offloaded tiny DiT, its resident twin and its runtime; this rank's activation
    peak is ``per_element`` per input element, plus ``extra`` bytes on rank 1 (its budget
    is the smaller one)."""
    _fresh()
    ref, _ = tiny_dit(depth=6)
    model, _ = tiny_dit(depth=6)
    dlo_fx.offload(model, options={"device": "cpu", "mode": "allgather",
                                   "device_memory": capacity})
    runtime = runtimes_holding(list(model.parameters()))[0]
    runtime.activation_peak_of = lambda key: per_element * sum(
        torch.Size(k[0]).numel() for k in key if isinstance(k, tuple)) + extra * rank
    return ref, model, runtime


def _resident(runtime) -> list[int]:
    (plan,) = runtime.budget_plans.values()
    return list(plan.resident)


def _error(fn) -> str:
    try:
        fn()
    except torch.OutOfMemoryError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


class _FailCopy:
    """``torch.empty`` that raises out-of-memory once for a buffer of ``nbytes`` uint8
    bytes (a resident block's device copy), as a device short of memory would."""

    def __init__(self, nbytes: set[int]) -> None:
        self.nbytes, self.real, self.raised = nbytes, torch.empty, 0

    def __call__(self, *size, **kw):
        if (not self.raised and kw.get("dtype") is torch.uint8 and len(size) == 1
                and size[0] in self.nbytes):
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB")
        return self.real(*size, **kw)


def allgather_plans_agreed_per_call(rank: int, world: int) -> dict:
    minimum, sizes = _sizes()
    small = example_inputs(tiny_dit(depth=6)[0].config, seed=1)
    large = example_inputs(tiny_dit(depth=6)[0].config, batch=2, height=16, width=16, seed=2)
    per_element = 3 * max(sizes) // (_elements(large) - _elements(small)) + 1
    capacity = GIB + per_element * _elements(large) + minimum + 3 * max(sizes)
    out: dict = {}

    # 1. Per-call plans, agreed: rank 1's activations are one block larger, so its budget
    # is the smaller and both ranks plan with it; the large input re-plans before it runs.
    ref, model, runtime = _model(rank, capacity, per_element, max(sizes))
    compiled = torch.compile(model, backend="dlo")
    equal, resident = [], []
    with torch.no_grad():
        for inputs in (small, small, large, large, small):
            equal.append(torch.equal(call(compiled, inputs), call(ref, inputs)))
            resident.append(_resident(runtime))
    (plan,) = runtime.budget_plans.values()
    out["agreed"] = {"equal": equal, "resident": resident, "lines": plan.budget_lines,
                     "budget": plan.device_budget, "records": len(runtime.device_memory)}

    # 2. Out of memory on rank 1 during a call (a resident read that does not fit): rank 1
    # raises DeviceMemoryError, rank 0's call completes exactly; at the next call both
    # agree on rank 1's lowered floor and move the same blocks back, exactly.
    real = runtime.reads.resident_tensor
    if rank == 1:
        def once(param, clock=False):
            runtime.reads.resident_tensor = real
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        runtime.reads.resident_tensor = once
    before = _resident(runtime)
    with torch.no_grad():
        error = _error(lambda: equal.append(torch.equal(call(compiled, small),
                                                        call(ref, small))))
        after = []
        for _ in range(2):
            after.append(torch.equal(call(compiled, small), call(ref, small)))
    (memory,) = runtime.device_memory.values()
    out["oom"] = {"error": error, "before": before, "after": after,
                  "resident_after": _resident(runtime), "floor": memory.floor,
                  "first_exact": equal[-1] if rank == 0 else None}

    # 3. A resident block's copy that cannot be allocated on rank 1: no rank gathers it,
    # both raise naming rank 1, and the next calls are exact on both.
    ref, model, runtime = _model(rank, capacity, per_element, 0)
    compiled = torch.compile(model, backend="dlo")
    slot_bytes = {b.slot_bytes for b in runtime.store.blocks}
    with torch.no_grad():
        first = torch.equal(call(compiled, small), call(ref, small))  # measures
        fail = _FailCopy(slot_bytes)
        if rank == 1:
            torch.empty = fail
        try:
            copy_error = _error(lambda: call(compiled, small))
        finally:
            torch.empty = fail.real
        later = [torch.equal(call(compiled, small), call(ref, small)) for _ in range(2)]
    out["copy"] = {"first": first, "error": copy_error, "later": later,
                   "resident": _resident(runtime), "raised": fail.raised}

    # 4. The engine's padding: after a warm-up, rank 0 runs the small input three times
    # (more blocks resident than at the large one: new copies, gathered) while rank 1
    # replays its last forward, at the large input, gather-only: it takes part in each
    # agreement and makes the same copies. Then both run both inputs.
    ref, model, runtime = _model(rank, capacity, per_element, 0)
    compiled = torch.compile(model, backend="dlo")
    clock = ForwardClock(lambda *a: compiled(*a))
    padded, plans = [], []
    with torch.no_grad():
        for inputs in (small, large, small, large):  # both shapes planned on both
            padded.append(torch.equal(clock(*inputs), call(ref, inputs)))
            plans.append(_resident(runtime))
        if rank == 0:
            for _ in range(3):
                padded.append(torch.equal(clock(*small), call(ref, small)))
        else:
            clock.pad(3)
        plans.append(_resident(runtime))
        for inputs in (large, small):
            padded.append(torch.equal(clock(*inputs), call(ref, inputs)))
            plans.append(_resident(runtime))
    out["padding"] = {"exact": padded, "plans": plans, "gather_only": clock.gather_only,
                      "in_step": clock.in_step}

    # 5. A call of rank 1 fails at its first slot view, before the resident copies of the
    # blocks after it are made: completing its schedule, rank 1 fetches those blocks where
    # rank 0 gathers them (and keeps them), and cuts their copies at the next call without
    # gathering alone. Both ranks' next calls are exact.
    ref, model, runtime = _model(rank, capacity, per_element, 0)
    compiled = torch.compile(model, backend="dlo")
    machine, failed = runtime.machine, []
    with torch.no_grad():
        first = torch.equal(call(compiled, small), call(ref, small))  # measures
        if rank == 1:
            real_view = machine.view

            def view_once(*a, **kw):
                machine.view = real_view
                failed.append(True)
                raise RuntimeError("injected failure")
            machine.view = view_once
        try:
            second = torch.equal(call(compiled, small), call(ref, small))
        except RuntimeError as exc:
            second = str(exc)
        kept = sorted(runtime.reads._kept_blocks)
        later = [torch.equal(call(compiled, small), call(ref, small)) for _ in range(2)]
    out["completed"] = {"first": first, "second": second, "kept": kept, "later": later,
                        "failed": failed, "resident": _resident(runtime)}
    return out

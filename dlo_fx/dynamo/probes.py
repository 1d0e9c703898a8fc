"""The measurements and collectives a compile runs around planning, outside the passes.

Planning (`dlo_fx.planning.stages.plan_graph`) and the schedule (`insert_schedule`) only
compute: every collective a compile issues is here or in `commit` (backend.py), called by
the backend in this order: `resolve_budget` (the device budget, settled by
`dlo_fx.planning.settle`), `probe_for_budget` (the device budget's bandwidth and matmul
probes, once per runtime), planning, the schedule, `commit` (the plan digest and
fingerprints agreed across ranks). The mode is settled before: by `dlo_fx.offload` or
`dlo_fx.load`, which make every runtime (`loading.plan.settle_mode`). Planning sees the
runtime through its frozen `StoreView` (`runtime.store_view`), made after the probes.
"""

from __future__ import annotations

from typing import Optional

from ..config import DLOConfig
from ..planning.settle import Budget, settle_budget
from ..planning.stages.resident_set import RATE_DTYPES
from ..runtime import Runtime, compile_clock, probes, store_view


def resolve_budget(config: DLOConfig, runtime: Optional[Runtime]) -> Budget:
    """The device budget this compile plans with (`dlo_fx.planning.settle.settle_budget`),
    the device's free memory measured where ``"auto"`` needs it."""
    if runtime is None:
        return settle_budget(config, None)
    measure = config.device_budget == "auto" and config.device_memory is None
    return settle_budget(config, store_view(runtime, free_memory=measure))


def probe_runtime(runtime: Runtime) -> None:
    """Measure the runtime's bandwidths and the matmul rate of every float dtype, once: at
    the first compile that plans a device budget, which every rank reaches together. The
    caller holds ``runtime.lock`` and drained it (the probes agree over the group on this
    thread). A later compile, which may run on one rank alone, needs no collective: see
    [Note: a compile on one rank only]. In allgather mode a clock exchange goes first, so
    a rank that compiles here while another runs a graph raises `ClockMismatch` on both
    instead of pairing a probe with the other's clock (gloo aborts the process on that)."""
    if runtime.probed_bandwidths is not None:
        return
    if runtime.gathers:
        compile_clock(runtime, 0, "probing the device budget's bandwidths")
    bandwidths = probes.probe_bandwidths(runtime.device, runtime.group)
    rates = {d: probes.probe_matmul_flops(runtime.device, d, runtime.group)
             for d in RATE_DTYPES}
    runtime.probed_flops.update(rates)
    runtime.probed_bandwidths = bandwidths


def probe_for_budget(runtime: Runtime) -> None:
    """The device budget's probes, before planning a graph with a budget (bytes, or the
    auto budget's capacity), where there is a runtime to measure on: once per runtime, with
    nothing of its own in flight (the probes' exchanges run on this thread, so none of the
    copy worker's gathers may be queued meanwhile)."""
    if runtime is None:
        return
    with runtime.lock:
        runtime.machine.drain()
        probe_runtime(runtime)


__all__ = ["probe_runtime", "probe_for_budget", "resolve_budget"]

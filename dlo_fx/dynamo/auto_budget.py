"""`AutoResidency`: a graph under ``device_budget="auto"``, planned from measured memory.

The compile plans every block streamed and keeps a copy of the graph before the passes.
Each call then (see [Note: the auto device budget] in dlo_fx/planning/device_memory.py):

1. finds the weights budget for its input shape (`DeviceMemory.budget_for`: measured,
   or predicted per element from the largest shape measured; nothing known yet: every
   block streams), and the resident blocks for it (`planning.device_memory.replan`, the
   budget planner on the first plan's figures);
2. runs the graph variant of that resident set: scheduled once from the kept copy, with
   the blocks forced resident (`PassContext.forced_plan`), cached per resident set, so a
   shape seen before reuses its variant. Blocks that stop being resident drop their
   device copies before the call; new resident blocks are copied once, at their first
   read (`WeightReads.resident_tensor`);
3. on the first call at a shape, measures the device's peak during the call minus what
   was allocated before it and the resident copies it made (`platform`; on the CPU and
   the meta device ``runtime.activation_peak_of``, else 0) and records it. That call
   resets the device's peak statistics (`platform.reset_peak_memory`): a caller reading
   ``max_memory_allocated`` across it sees the peak since then;
4. on ``torch.OutOfMemoryError`` moves every resident block back to streaming, lowers the
   OOM floor and raises `DeviceMemoryError` (no retry: the call's hooks may hold state).
5. at its end and at the next call's start reads the allocator's counters (no reset): the
   work in between (a pipeline's VAE, other graphs, user code) enters the next plan, and
   an out-of-memory error in between moves the resident blocks back, with a warning.
6. streams every block while ``runtime.hold_resident`` says why (a pipeline's first run,
   measured whole: see [Note: a pipeline's first run is measured whole] in pipelines.py).

Several ranks gathering keep the compile's plan (no `AutoResidency`): every rank must run
the same blocks, and a per-call agreement would be a collective a call on one rank alone
could not pair. Their budget is agreed once (`dlo_fx.dynamo.probes.probe_runtime`).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx

from ..planning.budget import BudgetPlan
from ..planning.device_memory import DeviceMemory, replan
from ..runtime.device import platform
from ..runtime.weights.owners import owner_of
from ..runtime.weights.stored import _caller_level
from .errors import DeviceMemoryError

log = logging.getLogger(__name__)

__all__ = ["AutoResidency", "copy_graph", "fixed_residency"]


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes the passes may change (node metadata shallow-copied)."""
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    return new


def shape_key(args: Sequence[Any]) -> tuple[tuple, int]:
    """(key, elements) of a call: the shapes and dtypes of its tensor inputs that are not
    parameters (buffers included), and their element count. Sizes passed as integers (a
    graph Dynamo made dynamic) are left out: they repeat the tensors' shapes, and a shape
    keeps one key whichever graph of the model runs it."""
    key, elements = [], 0
    for a in args:
        if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter):
            key.append((tuple(a.shape), str(a.dtype)))
            elements += a.numel()
    return tuple(key), elements


class AutoResidency:
    """The callable a graph's compile returns under the auto device budget.

    A graph Dynamo reuses for other parameters (the next layer's after a graph break in
    the blocks, another model of the class) plans those parameters on their own: the
    memory record, the resident set and the copies are per runtime and per the parameters
    a call passes (`_bound`); the graph variants are shared, since each call binds the
    parameters it is called with."""

    def __init__(self, runtime: Any, base: BudgetPlan, key: tuple[str, ...],
                 first: Callable, build: Callable[[BudgetPlan], Callable],
                 positions: dict[str, int], first_param: Optional[torch.Tensor]) -> None:
        self.base = base  # every block streamed: the figures every re-plan starts from
        self.key = key
        self.build = build
        self.positions = positions  # FQN -> position of the parameter among the arguments
        self._first_position = min(positions.values(), default=None)
        # the parameter there when compiled: weakly (see backend.auto_residency)
        self._first = weakref.ref(first_param) if first_param is not None else None
        self.variants: dict[frozenset, tuple[Callable, BudgetPlan]] = {frozenset(): (first, base)}
        self.plans: dict[int, BudgetPlan] = {}  # weights budget -> plan (a planned budget)
        self.num_slots = runtime.config.num_slots
        self._lock = threading.Lock()

    def _bound(self, args: Sequence[Any]) -> Optional[tuple[Any, tuple, DeviceMemory]]:
        """(runtime, key, memory record) of the parameters this call passes; None where no
        live runtime stores them (the call then streams every block)."""
        if self._first_position is None:
            return None
        first = args[self._first_position]
        runtime = owner_of([first])
        if runtime is None or runtime.closed:
            return None
        key = self.key if self._first is not None and first is self._first() else (
            *self.key, f"(reused for the parameters at {id(first):#x})")
        memory = runtime.device_memory.get(key)
        if memory is None:
            capacity = runtime.config.device_memory or self.base.device_budget
            memory = runtime.device_memory[key] = DeviceMemory(
                capacity=capacity, reserve=runtime.config.activation_reserve_bytes)
        return runtime, key, memory

    def __call__(self, *args: Any) -> Any:
        bound = self._bound(args)
        if bound is None:
            return self.variants[frozenset()][0](*args)
        runtime, key, memory = bound
        shapes, elements = shape_key(args)
        mine = (runtime.token, key)
        with self._lock:  # calls of one graph from several threads plan one at a time
            self._between(runtime, key, memory, args)
            other = sum(b for k, b in runtime.shared.auto_resident.items() if k != mine)
            found = None if runtime.hold_resident else memory.budget_for(shapes, elements,
                                                                         other)
            plan = self.base if found is None else self._plan(found.weights, found.lines())
            run = self._switch(plan, runtime, key, args)
            measure = memory.reserve is None and shapes not in memory.peaks.measured
            before = self._start(runtime, measure)
        start = time.perf_counter()
        try:
            out = run(*args)
        except torch.OutOfMemoryError as exc:
            if isinstance(exc, DeviceMemoryError):
                raise
            raise self._out_of_memory(exc, plan, runtime, key, memory, args) from exc
        plan.measured_s = time.perf_counter() - start
        if measure:
            memory.peaks.record(shapes, elements, self._peak(runtime, shapes, before))
        self._ended(runtime, memory)
        return out

    # -- planning and variants ----------------------------------------------------------
    def _plan(self, weights: int, lines: list[str]) -> BudgetPlan:
        plan = self.plans.get(weights)
        if plan is None:
            plan = self.plans[weights] = replan(self.base, weights, self.num_slots, lines)
        else:
            plan.budget_lines = lines
        return plan

    def _switch(self, plan: BudgetPlan, runtime: Any, key: tuple,
                args: Sequence[Any]) -> Callable:
        """The variant of ``plan``'s resident set (scheduled at its first use), after
        dropping the device copies of the call's blocks that stream again."""
        resident = frozenset(plan.resident)
        found = self.variants.get(resident)
        if found is None:
            found = self.variants[resident] = (self.build(plan), plan)
            log.info("dlo: device_budget='auto' keeps %d of %d blocks resident (%d B): %s",
                     len(plan.resident), len(plan.block_bytes), plan.resident_bytes,
                     plan.budget_lines[0] if plan.budget_lines else "")
        run = found[0]  # another budget with the same blocks runs the same graph
        if runtime.auto_resident.get(key) != resident:
            drop = [args[self.positions[f]] for g, fqns in enumerate(self.base.fqns)
                    if g not in resident for f in fqns if f in self.positions]
            with runtime.lock:
                runtime.reads.drop_resident(drop)
            runtime.auto_resident[key] = resident
            runtime.shared.auto_resident[(runtime.token, key)] = plan.resident_bytes
        runtime.budget_plans[key] = plan  # this budget's lines, for memory_report
        return run

    # -- measuring ------------------------------------------------------------------------
    def _start(self, runtime: Any, measure: bool) -> Optional[tuple[int, int]]:
        if not measure:
            return None
        allocated = platform.memory_allocated(runtime.device)
        if allocated is not None:
            platform.reset_peak_memory(runtime.device)
        return (allocated if allocated is not None else -1, runtime.reads.resident_copy_bytes)

    def _peak(self, runtime: Any, shapes: tuple, before: tuple[int, int]) -> int:
        """Activations and workspace of the call just made (see [Note: the auto device
        budget]): the device's peak minus what was allocated before and minus the resident
        copies the call made."""
        allocated, copies = before
        peak = platform.max_memory_allocated(runtime.device) if allocated >= 0 else None
        if peak is None:
            hook = runtime.activation_peak_of
            return int(hook(shapes)) if hook is not None else 0
        return max(peak - allocated - (runtime.reads.resident_copy_bytes - copies), 0)

    # -- the work between two calls -------------------------------------------------------
    def _ended(self, runtime: Any, memory: DeviceMemory) -> None:
        allocated = platform.memory_allocated(runtime.device)
        if allocated is not None:
            memory.ended(allocated, platform.max_memory_allocated(runtime.device) or 0)

    def _between(self, runtime: Any, key: tuple, memory: DeviceMemory,
                 args: Sequence[Any]) -> None:
        """Record what the work since the graph's last call allocated (see [Note: the auto
        device budget]); where an allocation failed with out-of-memory in between while
        blocks were resident, move them back to streaming under the OOM floor and warn.
        The caller holds ``self._lock``."""
        peak = platform.max_memory_allocated(runtime.device)
        if peak is None or not memory.started(peak, platform.oom_count(runtime.device)):
            return
        plan = runtime.budget_plans.get(key)
        if plan is None or not plan.resident:
            return
        moved, moved_bytes = list(plan.resident), plan.resident_bytes
        floor = memory.after_oom(plan.device_budget, moved_bytes,
                                 f"out of memory between two calls with {len(moved)} "
                                 f"blocks resident ({moved_bytes:,} B)")
        self._switch(self.base, runtime, key, args)
        warnings.warn(
            f"dlo: an allocation on {runtime.device} failed with out-of-memory between two "
            f"calls of this model (in code dlo does not run: a pipeline's VAE or text "
            f"encoder, say) while dlo kept {len(moved)} of its blocks resident "
            f"({moved_bytes:,} B). dlo moved them back to streaming and keeps this graph's "
            f"weights within {floor:,} B from now on, so that work fits when run again "
            "(device_budget='auto'; device_budget=None streams every block from the start)",
            RuntimeWarning, stacklevel=_caller_level())

    # -- out of memory --------------------------------------------------------------------
    def _out_of_memory(self, exc: BaseException, plan: BudgetPlan, runtime: Any, key: tuple,
                       memory: DeviceMemory, args: Sequence[Any]) -> DeviceMemoryError:
        moved = list(plan.resident)
        moved_bytes = plan.resident_bytes
        floor = memory.after_oom(plan.device_budget, moved_bytes,
                                 f"out of memory with {len(moved)} blocks resident "
                                 f"({moved_bytes:,} B, weights budget "
                                 f"{plan.device_budget:,} B)")
        with self._lock:
            self._switch(self.base, runtime, key, args)
        first = _first_line(exc)
        if moved:
            changed = (f"dlo moved {len(moved)} resident blocks back to streaming (blocks "
                       f"{_named(self.base, moved)}; {moved_bytes:,} B) and keeps this "
                       f"graph's weights within {floor:,} B from now on")
        else:
            changed = ("every block already streamed, so dlo changed nothing: this call's "
                       "activations do not fit on the device even so; lower the resolution "
                       "or the batch")
        return DeviceMemoryError(
            f"dlo: the call ran out of device memory ({first}). {changed}. Nothing was "
            "retried; the slots, the host store and the model are intact, so calling again "
            "reruns it exactly. (device_budget='auto'; device_budget=None streams every "
            "block from the start, activation_reserve_bytes reserves more for activations)",
            moved, moved_bytes)


def fixed_residency(run: Callable, plan: BudgetPlan, why: str) -> Callable:
    """``run``, a graph whose resident blocks were planned once, at its compile (``why``:
    an explicit ``device_budget``, or ``"auto"`` with several ranks gathering, which must
    keep one plan): a call that runs out of device memory raises `DeviceMemoryError`
    saying so, naming what stays resident and how to plan less. dlo changes nothing (the
    plan is the one compiled, the same on every rank) and retries nothing; the slots, the
    host store and the model are intact (the failed graph's remaining schedule ran
    without compute, `graph_call.complete`)."""
    blocks = _named(plan, plan.resident)

    def call(*args: Any) -> Any:
        try:
            return run(*args)
        except torch.OutOfMemoryError as exc:
            if isinstance(exc, DeviceMemoryError):
                raise
            raise DeviceMemoryError(
                f"dlo: the call ran out of device memory ({_first_line(exc)}). This graph "
                f"keeps {len(plan.resident)} blocks resident ({blocks}; "
                f"{plan.resident_bytes:,} B) within a device budget of "
                f"{plan.device_budget:,} B planned once, at its compile ({why}); dlo changed "
                "nothing, and nothing was retried: the slots, the host store and the model "
                "are intact. Compile with a smaller device_budget (device_budget=None "
                "streams every block), or reserve more for activations "
                "(activation_reserve_bytes)") from exc
    return call


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _named(plan: BudgetPlan, blocks: Sequence[int]) -> str:
    """``blocks`` of ``plan`` with their first..last FQNs, the first four."""
    names = ", ".join(f"{g} ({plan.labels[g]})" for g in blocks[:4])
    return names + (f" and {len(blocks) - 4} more" if len(blocks) > 4 else "")

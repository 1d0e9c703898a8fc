"""`AutoResidency`: a graph under ``device_budget="auto"``, planned from measured memory.

The compile plans every block streamed and keeps a copy of the graph before the passes.
Each call then (see [Note: the auto device budget] in dlo_fx/planning/device_memory.py):

1. finds the weights budget for its input shape (`DeviceMemory.budget_for`: measured,
   or predicted per element from the largest shape measured; nothing known yet: every
   block streams), and the resident blocks for it (`planning.device_memory.replan`, the
   budget planner on the first plan's figures);
2. runs the graph variant of that resident set: scheduled once from the kept copy, with
   the blocks forced resident (`Budget.forced`, planning/settle.py), cached per resident set, so a
   shape seen before reuses its variant. Blocks that stop being resident drop their
   device copies before the call; new resident blocks are copied once, at their first
   read (`WeightReads.resident_tensor`);
3. on the first call at a shape, measures the device's peak during the call minus what
   was allocated before it and the resident copies it made (`platform`; on the CPU and
   the meta device ``runtime.activation_peak_of``, else 0) and records it. That call
   resets the device's peak statistics (`platform.reset_peak_memory`): a caller reading
   ``max_memory_allocated`` across it sees the peak since then;
4. on ``torch.OutOfMemoryError`` moves every resident block back to streaming, lowers the
   OOM floor and raises `DeviceMemoryError` (no retry: the call's hooks may hold state);
   several ranks gathering move them at the next call's agreement (the Note below).
5. at its end and at the next call's start reads the allocator's counters (no reset): the
   work in between (a pipeline's VAE, other graphs, user code) enters the next plan, and
   an out-of-memory error in between moves the resident blocks back, with a warning.
6. streams every block while ``runtime.hold_resident`` says why (a pipeline's first run,
   measured whole: see [Note: a pipeline's first run is measured whole] in pipelines.py).

[Note: the auto budget of ranks gathering]
Several ranks gathering (allgather mode, dp > 1) must stream the same blocks, or their
gathers would not pair. Each call of such a graph plans as above on every rank, then the
ranks agree before anything is gathered: they exchange their weights budgets as clock
words (`graph_call.agree_budget`: ``[graph, blocks, budget, PLAN]``, behind every gather
queued) and all plan with the smallest. A rank that has not measured the call's shape yet
offers 0 (every block streams); a rank that ran out of memory offers its lowered floor, so
at the next call every rank moves the blocks back. The choice is a function of the agreed
budget and of figures every rank holds alike: the first plan of these parameters on the
runtime (`DeviceMemory.base`: block bytes, the agreed bandwidths and matmul rates, the
FLOPs of the first graph compiled), not the FLOPs of the graph at hand, so ranks that run
different resolutions (different Dynamo graphs) choose the same blocks. If they still
differ, the clock before the graph refuses it on every rank (the variant's clock word
names its streamed blocks).
A call always exchanges, since a peer may want a new plan whatever this rank wants; that
is one exchange of four words per graph call, beside the graph clock's. A gather-only
forward (the engine's padding, ranks/forward_log.py) replays a call of such a graph as one
step: the exchange, offering `graph_call.NO_WISH` (it takes the others' budget), then the
schedule of the resident set agreed; the real call's own graph is not noted.
"""

from __future__ import annotations

import contextlib
import copy
import functools
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
from ..runtime import (NO_WISH, agree_budget, caller_level, forward_log, gather_only, owner_of,
                       platform, word)
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
                 first: tuple[Callable, Any], build: Callable[[BudgetPlan], tuple[Callable, Any]],
                 positions: dict[str, int], first_param: Optional[torch.Tensor]) -> None:
        self.base = base  # every block streamed: the figures every re-plan starts from
        self.key = key
        self.build = build  # plan -> (the variant's call, its GraphSchedule)
        self.positions = positions  # FQN -> position of the parameter among the arguments
        self._first_position = min(positions.values(), default=None)
        # the parameter there when compiled: weakly (see backend.auto_residency)
        self._first = weakref.ref(first_param) if first_param is not None else None
        self.variants: dict[frozenset, tuple[Callable, BudgetPlan, Any]] = {
            frozenset(): (first[0], base, first[1])}
        self.plans: dict[tuple[int, int], BudgetPlan] = {}  # (base, weights budget) -> plan
        self.num_slots = runtime.config.num_slots
        self._word = word(repr(list(key)))  # this graph's clock word when ranks agree
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
            if runtime.device.type == "meta":  # no allocator: nothing is measured there
                memory.peaks.found_as = ("given by activation_peak_of on the meta device"
                                         if runtime.activation_peak_of is not None else
                                         "0: the meta device has no allocator to measure")
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
            lines = found.lines() if found is not None else []
            if runtime.gathers:  # see [Note: the auto budget of ranks gathering]
                plan = self._agreed(runtime, memory, 0 if found is None else found.weights,
                                    lines)
            else:
                plan = self.base if found is None else self._plan(self.base, found.weights,
                                                                  lines)
            run = self._switch(plan, runtime, key, args)[0]
            measure = memory.reserve is None and shapes not in memory.peaks.measured
            before = self._start(runtime, measure)
        log = forward_log.current() if runtime.gathers else None
        if log is not None:  # the call's collectives replay as one step: the Note above
            log.step(functools.partial(self._replay, tuple(
                a if isinstance(a, torch.nn.Parameter) else None for a in args)))
        start = time.perf_counter()
        try:
            with forward_log.logging_to(_Within(log)) if log is not None else \
                    contextlib.nullcontext():
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
    def _plan(self, base: BudgetPlan, weights: int, lines: list[str]) -> BudgetPlan:
        plan = self.plans.get((id(base), weights))
        if plan is None:
            plan = self.plans[id(base), weights] = replan(base, weights, self.num_slots, lines)
        else:
            plan.budget_lines = lines
        return plan

    def _agreed(self, runtime: Any, memory: DeviceMemory, wish: int,
                lines: list[str]) -> BudgetPlan:
        """The plan of the smallest weights budget the ranks offer (``wish``: this rank's;
        0 streams every block): see [Note: the auto budget of ranks gathering]."""
        group, blocks = runtime.group, len(self.base.fqns)
        least, who = agree_budget(runtime, self._word, blocks, wish,
                                  f"planning the resident blocks of a graph of {blocks} blocks "
                                  f"(first {self.key[0]!r}) under device_budget='auto'")
        if least <= 0 or least >= NO_WISH:
            return self.base
        if memory.base is None:
            memory.base = self.base  # the first plan of these parameters: see the Note
        whose = "this rank's" if who == group.rank else f"global rank {group.ranks[who]}'s"
        lines = [*lines, f"the {group.dp} ranks gathering plan with the smallest of their "
                         f"weights budgets, {whose}: {least:,} B"]
        return self._plan(memory.base, least, lines)

    def _replay(self, args: Sequence[Any]) -> None:
        """A gather-only forward's step for a call of this graph (``args``: its parameters,
        the rest None): the ranks' agreement, offering nothing, then the collectives of the
        resident set agreed (`graph_call.gather_only`)."""
        bound = self._bound(args)
        if bound is None:
            return
        runtime, key, memory = bound
        with self._lock:
            plan = self._agreed(runtime, memory, NO_WISH, [])
            sched = self._switch(plan, runtime, key, args)[2]
        if sched is not None:
            gather_only(sched, [args[i] for i in sched.bound_at], args)

    def _switch(self, plan: BudgetPlan, runtime: Any, key: tuple,
                args: Sequence[Any]) -> tuple[Callable, BudgetPlan, Any]:
        """The variant of ``plan``'s resident set, (call, plan, schedule), scheduled at its
        first use, after dropping the device copies of the call's blocks that stream
        again."""
        resident = frozenset(plan.resident)
        found = self.variants.get(resident)
        if found is None:
            call, sched = self.build(plan)
            found = self.variants[resident] = (call, plan, sched)
            log.info("dlo: device_budget='auto' keeps %d of %d blocks resident (%d B): %s",
                     len(plan.resident), len(plan.block_bytes), plan.resident_bytes,
                     plan.budget_lines[0] if plan.budget_lines else "")
        # another budget with the same blocks runs the same graph
        if runtime.auto_resident.get(key) != resident:
            drop = [args[self.positions[f]] for g, fqns in enumerate(self.base.fqns)
                    if g not in resident for f in fqns if f in self.positions]
            with runtime.lock:
                runtime.reads.drop_resident(drop)
            runtime.auto_resident[key] = resident
            runtime.shared.auto_resident[(runtime.token, key)] = plan.resident_bytes
        runtime.budget_plans[key] = plan  # this budget's lines, for memory_report
        return found

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
        if not runtime.gathers:  # ranks gathering move them at the agreement that follows
            self._switch(self.base, runtime, key, args)
        warnings.warn(
            f"dlo: an allocation on {runtime.device} failed with out-of-memory between two "
            f"calls of this model (in code dlo does not run: a pipeline's VAE or text "
            f"encoder, say) while dlo kept {len(moved)} of its blocks resident "
            f"({moved_bytes:,} B). dlo moved them back to streaming and keeps this graph's "
            f"weights within {floor:,} B from now on, so that work fits when run again "
            "(device_budget='auto'; device_budget=None streams every block from the start)",
            RuntimeWarning, stacklevel=caller_level())

    # -- out of memory --------------------------------------------------------------------
    def _out_of_memory(self, exc: BaseException, plan: BudgetPlan, runtime: Any, key: tuple,
                       memory: DeviceMemory, args: Sequence[Any]) -> DeviceMemoryError:
        moved = list(plan.resident)
        moved_bytes = plan.resident_bytes
        floor = memory.after_oom(plan.device_budget, moved_bytes,
                                 f"out of memory with {len(moved)} blocks resident "
                                 f"({moved_bytes:,} B, weights budget "
                                 f"{plan.device_budget:,} B)")
        first = _first_line(exc)
        if not runtime.gathers:  # ranks gathering move them at the next agreement
            with self._lock:
                self._switch(self.base, runtime, key, args)
        if not moved:
            changed = ("every block already streamed, so dlo changed nothing: this call's "
                       "activations do not fit on the device even so; lower the resolution "
                       "or the batch")
        elif runtime.gathers:  # see [Note: the auto budget of ranks gathering]
            changed = (f"dlo keeps this graph's weights within {floor:,} B from now on: at "
                       f"the next call the ranks of the {runtime.group.describe()} agree on "
                       f"at most that, which moves {len(moved)} resident blocks back to "
                       f"streaming on every rank (blocks {_named(self.base, moved)}; "
                       f"{moved_bytes:,} B)")
        else:
            changed = (f"dlo moved {len(moved)} resident blocks back to streaming (blocks "
                       f"{_named(self.base, moved)}; {moved_bytes:,} B) and keeps this "
                       f"graph's weights within {floor:,} B from now on")
        return DeviceMemoryError(
            f"dlo: the call ran out of device memory ({first}). {changed}. Nothing was "
            "retried; the slots, the host store and the model are intact, so calling again "
            "reruns it exactly. (device_budget='auto'; device_budget=None streams every "
            "block from the start, activation_reserve_bytes reserves more for activations)",
            moved, moved_bytes)


class _Within:
    """The forward log while a gathering graph's variant runs: its own graph step is not
    noted (the `AutoResidency` step replays it); a compile still is."""

    def __init__(self, outer: Any) -> None:
        self.outer, self.steps = outer, 0

    def step(self, replay: Callable[[], None]) -> None:
        self.steps += 1
        if self.steps > 1:  # more than the graph's own step: this forward is not replayed
            self.outer.compiled()

    def compiled(self) -> None:
        self.outer.compiled()


def fixed_residency(run: Callable, plan: BudgetPlan) -> Callable:
    """``run``, a graph whose resident blocks were planned once, at its compile (an
    explicit ``device_budget``): a call that runs out of device memory raises `DeviceMemoryError`
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
                f"{plan.device_budget:,} B planned once, at its compile "
                f"(device_budget={plan.device_budget!r}); dlo changed "
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

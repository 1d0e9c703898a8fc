"""The schedule nodes' targets: plain functions the scheduled graph calls.

Each takes the graph's `GraphSchedule` (a ``get_attr`` node named ``_dlo``) and the graph
block index. Blocks are bound to host blocks at run time from the parameters the graph is
called with, never from those seen while compiling: Dynamo may reuse one graph for every
layer of the same shape. They are registered as side-effecting so dead-code elimination
keeps them. See [Note: slot reuse and stream ordering] in slot_machine.py.

Each op counts itself in ``sched.step`` once done, so a graph whose call fails can run the
rest of its schedule (see [Note: the collective clock of a shard group] in ranks/clock.py);
every op is idempotent on the slot state, so one interrupted half-way simply runs again.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch.fx.node import has_side_effect

from ..ranks.clock import word
from ..weights.owners import owner_of
from ..slot_machine import SlotMachine
from ..runtime import Runtime
from ...config import conflict_error, runtime_conflicts
from ...torch_private import profiler_enabled


_GRAPH_IDS = itertools.count()


class GraphSchedule(torch.nn.Module):
    """Per-graph state: slot of each graph block and its binding for the current call.

    A (parameter-free) submodule of the scheduled GraphModule, reached by a ``get_attr``
    node, so the graph prints and lints like any other.
    """

    def __init__(self, runtime: Runtime, slot_of: list[int], fqns: list[list[str]], *,
                 trace: bool = False, made_with: Sequence[tuple[str, Any]] = ()) -> None:
        super().__init__()
        self.runtime = runtime
        self.trace = trace  # the compile's option: the runtime may not record yet
        if trace:
            runtime.machine.trace()
        # runtime options the compile was given: a runtime bound later must have them
        self.made_with = dict(made_with)
        self.mode = runtime.mode
        self.num_slots = runtime.config.num_slots  # as the graph was scheduled
        self._device = runtime.device
        self.slot_of = slot_of
        self.fqns = fqns
        self.bound = [-1] * len(slot_of)
        self.graph = next(_GRAPH_IDS)
        """A process-wide id; the tracer tags this graph's spans with it."""
        self.step = 0  # schedule ops done in the current call
        # True while `graph_call.complete` runs the rest of a failed call's schedule: the
        # ops issue their collectives and make no tensor (see `slot_view`, `resident`)
        self.completing = False
        # Held around each call's bind and run: runtime, bound and step above belong to one
        # call, and Dynamo shares the graph between models whose runtimes may hold
        # different locks (another slot count), so another thread's call of this graph
        # waits here (backend.scheduled_call, graph_call.gather_only).
        self.call_lock = threading.RLock()
        self.replay: list = []  # (target, argument sources) of every schedule op, in order
        self.arg_positions: frozenset = frozenset()  # placeholders the schedule ops read
        self.direct: tuple = ()  # parameter placeholders the graph reads itself
        self.bound_at: tuple = ()  # every parameter placeholder, as a call binds them
        self.key = 0  # clock word naming this graph (`record`)

    def record(self, replay: list) -> None:
        """What `dlo_fx.passes.insert_schedule` wrote: ``replay``, every schedule node's
        target and argument sources in graph order (what `graph_call.complete` runs of a
        failed call); from it, the placeholders they read, and the graph's clock key."""
        self.replay = replay
        self.arg_positions = frozenset(v for _, spec in replay for kind, v in spec
                                       if kind == "arg")
        self.key = word(repr([[len(f), f[0] if f else ""] for f in self.fqns]))

    def enter(self) -> SlotMachine:
        """The runtime's slot machine, its tracer told that this graph's nodes run now."""
        machine = self.runtime.machine
        tracer = machine.tracer
        if tracer is not None:
            tracer.graph = self.graph
        return machine

    # The runtime is held weakly: it belongs to the model (see [Note: the model owns its
    # runtime]); a graph that Dynamo keeps cached must not keep a dead model's store.
    @property
    def runtime(self) -> Runtime:
        runtime = self._runtime_ref()
        if runtime is None:
            raise RuntimeError("dlo: internal error: the graph is not bound to a runtime")
        return runtime

    @runtime.setter
    def runtime(self, runtime: Optional[Runtime]) -> None:
        # None: a graph that streams nothing (no parameters) and has no runtime
        self._runtime_ref = weakref.ref(runtime) if runtime is not None else lambda: None

    def bind(self, params: Sequence[torch.Tensor]) -> Runtime:
        """Bind this call to the runtime of the model whose ``params`` it is called with.

        Dynamo reuses one graph for every model of the same class compiled with the same
        options, so the runtime is found from the parameters on every call. No runtime is
        made here: parameters no live runtime stores (a model released and called through
        a graph Dynamo kept) raise, as do runtime options the compile was given that the
        bound runtime does not have (see [Note: options belong to a verb]).
        """
        runtime = self._runtime_ref()
        if runtime is not None and params and owner_of(params[:1]) is runtime:
            return runtime
        runtime = owner_of(params)
        if runtime is None or runtime.closed:
            first = next((f[0] for f in self.fqns if f), "its weights")
            raise RuntimeError(
                f"dlo: this graph streams {first!r} and the blocks after it, but it is called "
                "with parameters no dlo runtime stores (the model was released with "
                "dlo_fx.release, or is another model of the class never offloaded); offload "
                "the model again (dlo_fx.offload(model, options)) or compile it again after "
                "torch._dynamo.reset()")
        conflicts = runtime_conflicts(self.made_with, runtime.config)
        if conflicts:
            raise conflict_error(conflicts, "torch.compile(backend='dlo')")
        if runtime.slots.num_slots < len(set(self.slot_of)):
            raise ValueError(
                f"dlo: this graph was scheduled for {len(set(self.slot_of))} slots but the "
                f"model it is called with has a runtime of {runtime.slots.num_slots} "
                "(num_slots); compile each model with its own options, or call "
                "torch._dynamo.reset() before compiling this one")
        if self.trace:
            runtime.machine.trace()
        self.runtime = runtime
        return runtime

    def extra_repr(self) -> str:
        return f"blocks={len(self.slot_of)}, slots={self.num_slots}"


# [Note: profiler spans]
# Under `torch.profiler.profile`, prefetch, allgather and wait each open a
# ``record_function`` span named ``dlo::<kind> block <b>`` on the thread that runs the
# graph, so a trace shows when a copy or a gather was issued and how long compute stood
# waiting for a block, beside the kernels (on a device the copies and gathers themselves
# show as the stream's memcpy and collective kernels). `_profiled` is the one place that
# decides: without a profiler a call pays one flag read per op
# (`torch_private.profiler_enabled`): no span, no context manager.
def _profiled(kind: str) -> Callable[[Callable], Callable]:
    """An op ``(sched, block, ...)`` run inside a span named for its block while a profiler
    records. See [Note: profiler spans]."""
    def wrap(op: Callable) -> Callable:
        @functools.wraps(op)
        def spanned(sched: GraphSchedule, block: int, *args: Any) -> Any:
            if not profiler_enabled():
                return op(sched, block, *args)
            with torch.profiler.record_function(f"dlo::{kind} block {block}"):
                return op(sched, block, *args)
        return spanned
    return wrap


@_profiled("prefetch")
def prefetch(sched: GraphSchedule, block: int, *params: torch.nn.Parameter) -> None:
    """Start copying graph block ``block``'s host shard into its slot."""
    machine = sched.enter()
    host_block = machine.resolve(params, sched.fqns[block])
    sched.bound[block] = host_block
    machine.prefetch(host_block, sched.slot_of[block])
    sched.step += 1


@_profiled("allgather")
def allgather(sched: GraphSchedule, block: int) -> None:
    """Complete graph block ``block`` in its slot from every rank's shard (in place)."""
    sched.enter().allgather(sched.bound[block], sched.slot_of[block])
    sched.step += 1


@_profiled("wait")
def wait(sched: GraphSchedule, block: int) -> None:
    """Block until graph block ``block`` is complete in its slot."""
    sched.enter().wait(sched.bound[block], sched.slot_of[block])
    sched.step += 1


def slot_view(sched: GraphSchedule, block: int, token: None, param: torch.nn.Parameter,
              cast: Optional[torch.dtype] = None) -> torch.Tensor:
    """``param`` as a view of its slot; ``token`` is the block's ``wait`` (ordering only).
    ``cast``: the parameter is stored in another dtype and the graph's next node casts
    the view to ``cast`` (see [Note: a storage dtype] in host/layout.py)."""
    machine = sched.runtime.machine
    if sched.completing:  # no view to make, only the collectives a view may need
        machine.view_reads(sched.bound[block], param)
        sched.step += 1
        return None
    view = machine.view(sched.slot_of[block], sched.bound[block], param, cast)
    sched.step += 1
    return view


def swap_slot(sched: GraphSchedule, block: int) -> None:
    """Graph block ``block`` has been read for the last time: its slot may be refilled."""
    sched.enter().swap(sched.slot_of[block])
    sched.step += 1


def resident(sched: GraphSchedule, param: torch.nn.Parameter) -> torch.Tensor:
    """A stored parameter this graph keeps on the device (a shared table, say)."""
    if sched.completing:  # the block's collectives, no copy (weight_reads.py)
        sched.runtime.reads.fetch_resident(param)
        sched.step += 1
        return None
    tensor = sched.runtime.reads.resident_tensor(param)
    sched.step += 1
    return tensor


for _fn in (prefetch, allgather, wait, swap_slot):
    has_side_effect(_fn)

SCHEDULE_OPS = {prefetch: "prefetch", allgather: "allgather", wait: "wait", swap_slot: "swap_slot",
                slot_view: "slot_view", resident: "resident"}

#: The schedule ops by name: the targets `dlo_fx.passes.insert_schedule` writes, reached
#: through the `GraphSchedule` it is given (the passes import nothing of the runtime).
GraphSchedule.OPS = {name: fn for fn, name in SCHEDULE_OPS.items()}

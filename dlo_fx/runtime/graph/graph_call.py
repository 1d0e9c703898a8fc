"""Running one scheduled graph: one at a time per runtime, behind the ranks' collective clock
(ranks/clock.py), completing the schedule of a graph whose call failed, and running a graph's
schedule alone (a gather-only forward, ranks/forward_log.py).

[Note: one call at a time]
At most one scheduled graph of a runtime runs at a time: a runtime has one slot state
machine (which block each slot holds, what is pending) and, in allgather mode, one order of
collectives shared with the other ranks. Every scheduled graph runs under the runtime's
lock (`run_graph`), so calls from several threads into one model are serialised graph by
graph. Each graph is self-contained -- a ``wait`` on a slot that does not hold its block
copies it -- so another thread's graph running between two graphs of a call never changes
a result. With several ranks the threads must run their graphs in the same order on every
rank (one calling thread per rank, as the engine does); a different interleaving is caught
by the collective clock and raises. A graph Dynamo shares between models of a class holds
one call's binding (its runtime, the host blocks bound, the step reached), and the
runtimes it serves may hold different locks (another slot count), so each call also holds
the graph's own ``call_lock`` from its bind to its end; without it, two models of a class
called on two threads would read each other's stores.

[Note: a compile on one rank only]
A compile issues collectives only when it brings new parameters into the host store;
then it compares plans and fingerprints with the other ranks, which must compile the same
graph at the same time. Dynamo recompiles a frame on one rank alone whenever only that
rank's call fails a guard: a new input shape (ranks serving different resolutions, a batch
doubled by guidance on one of them), grad mode, autocast. So a compile whose blocks are
all stored already (the model's second resolution, or any graph of a model from
`dlo_fx.load`) issues no collective: its gathers are of host blocks the ranks agreed on
when they stored them, and the clock before each graph call still proves that every rank
runs a graph of the same blocks. If it exchanged its plan, the ranks that did not
recompile (they run their cached graph and exchange a clock word) would raise
`ClockMismatch` at every call until they all recompiled together. For the same reason the
device budget's probes run once per runtime at its first compile, every dtype's matmul
rate with them (`dlo_fx.dynamo.probes.probe_runtime`), and a recompile keeps the resident
blocks its parameters' first plan chose, so every rank streams the same blocks.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch

from ..ranks.clock import COMPILE, GRAPH, PLAN, Clock, ClockMismatch, word
from ..ranks import forward_log
from ..interrupts import deferred
from .ops import GraphSchedule
from ..runtime import Runtime


def _args_of(spec: tuple, args: Sequence[Any]) -> list:
    return [args[v] if kind == "arg" else None if kind == "none" else v for kind, v in spec]


def _first_host_block(runtime: Runtime, sched: GraphSchedule, args: Sequence[Any]) -> int:
    for target, spec in sched.replay:
        for kind, v in spec:
            if kind == "arg" and isinstance(args[v], torch.nn.Parameter):
                entry = runtime.store.entry(args[v])
                return entry.block if entry is not None else -1
    return -1


def _clock(runtime: Runtime, words: Sequence[int], what: str) -> Clock:
    return Clock(runtime.executor, runtime.group, runtime.device, words, what)


def check_clock(runtime: Runtime, clock: Clock, free: Optional[int] = None) -> list[list[int]]:
    """`Clock.check`; an exchange that failed closes ``runtime`` (the group is unusable)."""
    try:
        return clock.check(free)
    except BaseException as exc:
        if clock.failed():
            runtime.life.fail(exc)
        raise


_COMPILE_WORD = word("dlo-compile")


def compile_clock(runtime: Runtime, blocks: int, what: str) -> None:
    """Exchange clock words before a compile's own collectives (plan digest, fingerprints):
    a rank still compiling while another already runs graphs raises instead of pairing a
    plan exchange with a clock or a gather."""
    if runtime.group.dp > 1:
        # the clock first, then the agreement (ranks/agreement.py)
        check_clock(runtime, _clock(runtime, [_COMPILE_WORD, 0, 0, COMPILE], what))


NO_WISH = 1 << 62
"""The weights budget a gather-only replay offers `agree_budget`: it takes the others'."""


def agree_budget(runtime: Runtime, key: int, blocks: int, wish: int, what: str) -> tuple[int, int]:
    """(the smallest of the ranks' ``wish``, the index in the group of the first rank that
    offered it): the weights budget a call of a graph of ``blocks`` blocks (clock word
    ``key``) plans with when several ranks gather (see [Note: the auto budget of ranks
    gathering] in dlo_fx/dynamo/auto_budget.py). The ranks exchange the clock words
    ``[key, blocks, wish, PLAN]``, behind every gather queued, under the runtime's lock: a
    rank at another graph or another step raises `ClockMismatch` with them."""
    life = runtime.life
    with life.lock:
        life.check_open()
        rows = check_clock(runtime, _clock(runtime, [key, blocks, wish, PLAN], what), free=2)
    wishes = [row[2] for row in rows]
    least = min(wishes)
    return least, wishes.index(least)


def complete(runtime: Runtime, sched: GraphSchedule, args: Sequence[Any],
             clock: Optional[Clock], failed: bool = True) -> None:
    """Run the rest of the graph's schedule without computing: after a failure (its ops
    make no tensor, `GraphSchedule.completing`), or as a gather-only forward
    (``failed=False``: resident copies are made as a real call makes them)."""
    if runtime.life.broken is not None:
        return  # the group is unusable: the other ranks raise within the timeout
    if clock is not None:
        check_clock(runtime, clock)  # raises `ClockMismatch`: nobody gathers anything for this graph
    sched.completing = failed
    try:
        while sched.step < len(sched.replay):
            target, spec = sched.replay[sched.step]
            target(sched, *_args_of(spec, args))
    finally:
        sched.completing = False


def run_graph(runtime: Runtime, sched: GraphSchedule, compiled: Optional[Callable],
              args: Sequence[Any]) -> Any:
    """Call ``compiled(*args)`` under the runtime's lock, keeping the collective clock.
    With ``compiled=None`` the graph's schedule runs without computing (a gather-only
    forward, see [Note: gather-only forwards] in ranks/forward_log.py). A failure after the
    clock completes the graph's gathers, so its peers stay in step."""
    life = runtime.life
    with life.lock:
        life.check_open()  # also raises when another thread released the model
        sched.step = 0
        clock: Optional[Clock] = None
        try:
            if runtime.gathers and sched.replay:
                what = f"a graph of {len(sched.fqns)} blocks (first {sched.fqns[0][0]!r})" \
                    if sched.fqns and sched.fqns[0] else "a graph"
                clock = _clock(runtime, [sched.key, len(sched.fqns),
                                         _first_host_block(runtime, sched, args), GRAPH], what)
                check_clock(runtime, clock)
                clock = None
            if compiled is None:  # the gathers a call makes, in its order
                runtime.reads.direct_reads(args, sched.direct)
                complete(runtime, sched, args, None, failed=False)
                return None
            # Before the check, which may refuse on one rank only: the resident copies
            # gathered here are no schedule step that `complete` would run for the peers.
            args = runtime.reads.direct_reads(args, sched.direct)
            return compiled(*args)
        except ClockMismatch:
            raise
        except BaseException:
            with deferred():
                complete(runtime, sched, args, clock)
            raise


# -- gather-only forwards: see [Note: gather-only forwards] in ranks/forward_log.py ---------
def note_graph(sched: GraphSchedule, bound: Sequence[torch.Tensor], args: Sequence[Any]) -> None:
    """A scheduled graph is about to run (bound with ``bound``): noted, with its
    gather-only replay, when a forward is logged."""
    log = forward_log.current()
    if log is not None and sched.replay:
        kept = tuple(a if i in sched.arg_positions or i in sched.direct else None
                     for i, a in enumerate(args))
        log.step(functools.partial(gather_only, sched, tuple(bound), kept))


def gather_only(sched: GraphSchedule, bound: Sequence[torch.Tensor],
                args: Sequence[Any]) -> None:
    """Issue the collectives of a call of ``sched`` bound with ``bound``, computing nothing
    (nothing where its runtime gathers nothing, as in rank-local mode)."""
    with sched.call_lock:
        runtime = sched.bind(list(bound))
        if runtime.gathers:
            run_graph(runtime, sched, None, args)

"""Running one scheduled graph: one at a time per runtime, the ranks' collective clock, and
completing the schedule of a graph whose call failed.

[Note: one call at a time]
A runtime has one slot state machine (which block each slot holds, what is pending) and,
in allgather mode, one order of collectives shared with the other ranks. Every scheduled
graph therefore runs under the runtime's lock (`run_graph`): calls from several threads
into one model are serialised graph by graph. Each graph is self-contained -- a ``wait``
on a slot that does not hold its block copies it -- so another thread's graph running
between two graphs of a call never changes a result. With several ranks the threads must
run their graphs in the same order on every rank (one calling thread per rank, as the
engine does); a different interleaving is caught by the collective clock and raises.
A graph Dynamo shares between models of a class holds one call's binding (its runtime,
the host blocks bound, the step reached), and the runtimes it serves may hold different
locks (another slot count), so each call also holds the graph's own ``call_lock`` from
its bind to its end: two models of a class called on two threads read each other's
stores without it.

[Note: the collective clock]
In allgather mode every rank must issue the same gathers in the same order. Three things
could break that, and each has its guard:

- a call that raises (or is interrupted) part-way through a graph: the rank completes the
  rest of that graph's schedule without computing (`complete`: the remaining prefetch,
  allgather, wait and swap nodes, run in order with their real arguments; they are
  idempotent on the slot state, so an interrupted node simply runs again), then raises.
  Its slot state and its collective count end exactly as the other ranks' do.
- a call that raises between graphs, or a graph another rank never reaches: before the
  first schedule node of a graph, the ranks exchange a small clock word (`CLOCK_WORDS`
  int64: the graph's key, its block count, the host block its first block is bound to)
  through the same worker as the gathers. Different words raise `RuntimeError` on every
  rank before any gather of that graph, so a gather never pairs with a different block
  (a silent mix of weights) or a different size (an abort inside gloo). Both ranks leave
  their state as it was; the next call starts in step.
- reads of a stored weight outside a graph (`runtime/stored.py`: `Runtime.eager_block`)
  exchange clock words the same way, in the same worker task as their gather, and so do
  reads of the stored weights to the host (``state_dict()``, `release`:
  `Runtime.host_tensor`) and a compile before it
  compares plans and weight fingerprints (`compile_clock`). The last word says which kind
  of step each rank is at, and a mismatch names them.

A collective that fails (a rank died, the timeout passed) closes the runtime: the group is
unusable afterwards.

[Note: a compile on one rank only]
Dynamo recompiles a frame on one rank alone when only that rank's call fails a guard: a
new input shape (two ranks serving different resolutions, or a batch doubled by guidance
on one of them), grad mode, autocast. A compile that brings new parameters into the host
store compares plans and fingerprints with the other ranks, and they must compile the
same graph at the same time. A compile whose blocks are all stored already (the model's
second resolution, or any graph of a model from `dlo_fx.load`) issues no collective at
all: its gathers are those of host blocks the ranks agreed on when they stored them, and
the clock before each graph call still proves that every rank runs a graph of the same
blocks. Had such a compile exchanged its plan, the ranks that did not recompile (they run
their cached graph and exchange a clock word) would have raised `ClockMismatch` at every
call until they all happened to recompile together. The device budget's probes run once
per runtime at its first compile, every dtype's matmul rate with them, so a later compile
never needs them (`dlo_fx.dynamo.probes.probe_runtime`), and a recompile keeps the resident blocks
its parameters' first plan chose, so every rank streams the same blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from .collectives import _all_gather_single
from .interrupts import deferred

CLOCK_WORDS = 4


class ClockMismatch(RuntimeError):
    """The ranks of a shard group reached different graphs (raised on every rank)."""


def word(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _args_of(spec: tuple, args: Sequence[Any]) -> list:
    return [args[v] if kind == "arg" else None if kind == "none" else v for kind, v in spec]


def _first_host_block(runtime: Any, sched: Any, args: Sequence[Any]) -> int:
    for target, spec in sched.replay:
        for kind, v in spec:
            if kind == "arg" and isinstance(args[v], torch.nn.Parameter):
                entry = runtime.store.entry(args[v])
                return entry.block if entry is not None else -1
    return -1


def exchange(group: Any, device: torch.device, words: Sequence[int], what: str) -> list[list[int]]:
    """Every rank's clock words (run on the executor's worker, in the gathers' order)."""
    from .platform import exchange_device

    device = exchange_device(group.pg)  # the CPU for gloo, the accelerator otherwise
    mine = torch.tensor(list(words), dtype=torch.int64, device=device)
    every = torch.empty(group.dp * len(words), dtype=torch.int64, device=device)
    try:
        _all_gather_single(every, mine, group=group.pg)
    except Exception as exc:
        raise RuntimeError(f"dlo: exchanging the collective clock before {what} over the "
                           f"{group.describe()} failed on global rank "
                           f"{group.ranks[group.rank]}: {exc}") from exc
    return every.cpu().view(group.dp, -1).tolist()


# The last clock word: what a rank is about to do.
GRAPH, EAGER, COMPILE, HOST_READ = range(4)
_KINDS = {GRAPH: "calls a graph", EAGER: "fetches weights eagerly",
          COMPILE: "compiles a graph", HOST_READ: "reads weights outside a graph (state_dict, release)"}


def _kinds_hint(group: Any, rows: list[list[int]]) -> str:
    """What the ranks do, when they do different kinds of things (the last clock word)."""
    kinds = [row[-1] for row in rows]
    if len(set(kinds)) == 1:
        return ""
    doing = "; ".join(f"global rank {group.ranks[i]} {_KINDS.get(k, 'runs')}"
                      for i, k in enumerate(kinds))
    hint = f" ({doing})"
    if EAGER in kinds:
        hint += (". A rank fetches eagerly where Dynamo runs no compiled code for a module "
                 "that reads streamed weights; for instance, where a graph break made Dynamo "
                 "compile a module's forward as a frame of its own, a new input shape on "
                 "one rank alone makes that rank recompile it (call every rank with the "
                 "same shapes, or use mode='rank_local')")
    return hint


def check_rows(group: Any, rows: list[list[int]], what: str) -> None:
    """Raise `ClockMismatch` (on every rank: all see all rows) when the words differ."""
    mine = rows[group.rank]
    for i, row in enumerate(rows):
        if row != mine:
            raise ClockMismatch(
                f"dlo: the ranks of the {group.describe()} are out of step: global rank "
                f"{group.ranks[group.rank]} is about to run {what} (clock {mine}) but global "
                f"rank {group.ranks[i]} runs clock {row} (words: graph key, blocks, first host "
                f"block, kind){_kinds_hint(group, rows)}. A call failed or was interrupted on "
                "one rank only between two graphs, or the ranks run different code, or call "
                "the model from several threads in different orders, or the model branches "
                "on its data (a step cache such as diffusers' FirstBlockCache skipping blocks "
                "on one rank only: "
                "mode='rank_local' lets each rank run its own graphs). Every rank raises "
                "here before gathering anything; the next call starts in step")


class Clock:
    """One exchange of clock words over the shard group, issued through the executor."""

    def __init__(self, runtime: Any, words: Sequence[int], what: str) -> None:
        self.runtime, self.what, self.rows = runtime, what, None
        group, device = runtime.group, runtime.device

        def task() -> None:
            self.rows = exchange(group, device, words, what)

        with deferred():  # issued and recorded together
            self.handle = runtime.executor.gather(-1, task, None)

    def check(self) -> None:
        """Wait for the exchange; raise `ClockMismatch` when the ranks' words differ."""
        runtime = self.runtime
        try:
            runtime.executor.wait(self.handle)
        except BaseException as exc:
            if runtime.executor.failed(self.handle):
                runtime.broken = f"{type(exc).__name__}: {exc}"
            raise
        if self.rows is None:  # a device executor: the exchange ran on the comm stream
            raise RuntimeError("dlo: internal error: clock words missing after the exchange")
        check_rows(runtime.group, self.rows, self.what)


_COMPILE_WORD = word("dlo-compile")


def compile_clock(runtime: Any, blocks: int, what: str) -> None:
    """Exchange clock words before a compile's own collectives (plan digest, fingerprints):
    a rank still compiling while another already runs graphs raises instead of pairing a
    plan exchange with a clock or a gather."""
    if runtime.group.dp > 1:
        Clock(runtime, [_COMPILE_WORD, 0, 0, COMPILE], what).check()  # then: agreement.py


def gathers(runtime: Any) -> bool:
    """Whether ``runtime``'s graphs issue collectives (AllGather mode over several ranks)."""
    return runtime.mode == "allgather" and runtime.group.dp > 1


def complete(runtime: Any, sched: Any, args: Sequence[Any], clock: Optional[Clock]) -> None:
    """Run the rest of the graph's schedule without computing (after a failure)."""
    if runtime.broken is not None:
        return  # the group is unusable: the other ranks raise within the timeout
    if clock is not None:
        clock.check()  # raises `ClockMismatch`: nobody gathers anything for this graph
    while sched.step < len(sched.replay):
        target, spec = sched.replay[sched.step]
        target(sched, *_args_of(spec, args))


def run_graph(runtime: Any, sched: Any, compiled: Optional[Callable], args: Sequence[Any]) -> Any:
    """Call ``compiled(*args)`` under the runtime's lock, keeping the collective clock.
    With ``compiled=None`` the graph's schedule runs without computing (a gather-only
    forward, see [Note: gather-only forwards]). A failure after the clock completes the
    graph's gathers, so its peers stay in step."""
    with runtime.lock:
        runtime.check_open()  # also raises when another thread released the model
        sched.step = 0
        clock: Optional[Clock] = None
        try:
            if gathers(runtime) and sched.replay:
                what = f"a graph of {len(sched.fqns)} blocks (first {sched.fqns[0][0]!r})" \
                    if sched.fqns and sched.fqns[0] else "a graph"
                clock = Clock(runtime, [sched.key, len(sched.fqns),
                                        _first_host_block(runtime, sched, args), GRAPH], what)
                clock.check()
                clock = None
            if compiled is None:  # the gathers a call makes, in its order
                runtime.direct_reads(args, sched.direct)
                complete(runtime, sched, args, None)
                return None
            # Before the check, which may refuse on one rank only: the resident copies
            # gathered here are no schedule step that `complete` would run for the peers.
            args = runtime.direct_reads(args, sched.direct)
            return compiled(*args)
        except ClockMismatch:
            raise
        except BaseException:
            with deferred():
                complete(runtime, sched, args, clock)
            raise


# -- gather-only forwards ------------------------------------------------------------------
# [Note: gather-only forwards]
# The engine keeps the ranks of a wave in step by padding: a rank whose request is shorter
# (or failed, or that has none) runs more forwards until the longest request ends, so its
# peers' weight gathers always have a partner. A padding forward needs the collectives of
# a forward, not its compute. So while a forward runs under `recording()`, every step that
# issues collectives is noted in order: each scheduled graph (its schedule, the
# parameters it was bound with, the arguments its schedule nodes read) and each clocked
# eager read of a stored weight's block. `replay()` then runs the same steps without
# computing: per graph the same clock words, then its schedule nodes (copies into the
# slots, gathers, waits, swaps) in graph order; per eager fetch the same fetch, its bytes
# dropped. The ranks therefore issue the same collectives in the same order as a real
# forward of the recorded shapes would, at the cost of the copies alone. Weights do not
# depend on activation shapes: a replay pairs with a peer's real forward at other shapes
# exactly as a real padding forward did. Only a steady-state forward is replayed: one
# during which the backend compiled (`note_compile`) is not, since a first call differs
# from later ones (it compares plans; its parameters are not converted yet).
# Replayed schedule nodes act on the slot state as a real call's would, so a resident
# block gathered once stays gathered once. For the same reason a resident copy (made once
# per runtime, then cached) is not noted as an eager fetch: a replay would gather it again
# where a peer's real forward reads its cache.
_RECORDING = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Record, in this thread, the collective steps of the calls made inside the block."""
    steps: list = []
    outer = getattr(_RECORDING, "steps", None)
    _RECORDING.steps = steps
    try:
        yield steps
    finally:
        _RECORDING.steps = outer


def note_graph(sched: Any, bound: Sequence[Any], args: Sequence[Any]) -> None:
    """A scheduled graph is about to run (bound with ``bound``): noted when recording."""
    steps = getattr(_RECORDING, "steps", None)
    if steps is not None and sched.replay:
        kept = tuple(a if i in sched.arg_positions or i in sched.direct else None
                     for i, a in enumerate(args))
        steps.append(("graph", sched, tuple(bound), kept))


def note_compile() -> None:
    """The backend compiles a graph: the forward being recorded is not steady state (a
    first call fetches nothing eagerly, a compile exchanges plans), so not replayable."""
    steps = getattr(_RECORDING, "steps", None)
    if steps is not None:
        steps.append(("compile",))


def replayable(steps: Sequence[tuple]) -> bool:
    """Whether ``steps`` can stand for a forward: dlo scheduled it and nothing compiled."""
    return bool(steps) and all(step[0] != "compile" for step in steps)


def note_fetch(runtime: Any, block: int, what: str) -> None:
    """A clocked eager fetch of host block ``block``: noted when recording."""
    steps = getattr(_RECORDING, "steps", None)
    if steps is not None:
        steps.append(("fetch", runtime, block, what))


def replay(steps: Sequence[tuple]) -> None:
    """Issue the collectives of the recorded steps, computing nothing (steps that issue
    none, as in rank-local mode, are skipped)."""
    for step in steps:
        if step[0] == "graph":
            _, sched, bound, args = step
            with sched.call_lock:
                runtime = sched.bind(list(bound))
                if gathers(runtime):
                    run_graph(runtime, sched, None, args)
        else:
            _, runtime, block, what = step
            if runtime.store.dp > 1:
                runtime.fetch_block(block, what, clock=True)

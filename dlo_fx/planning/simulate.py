"""The schedule simulator: one call of a schedule on its compute, H2D and AllGather lanes.

Every prediction of how a schedule runs goes through `simulate_call`: the device budget
(`budget.py`: which blocks stay resident), the mode choice (`modes.py`: ``mode="auto"``,
and the weight bytes `memory_report` prints) and the dump's predicted timeline
(`dlo_fx.apps.dump.timeline`, drawn in timeline.svg). Callers differ only in the program
they hand it: the budget and the mode choice write one at block granularity
(`block_program`, the schedule `insert_schedule` writes, one compute per block), the dump
reads it off the scheduled graph's nodes.

[Note: the schedule simulator]
A program is the schedule in issue order, as the compute stream meets it:

- ``prefetch(b)`` queues block ``b``'s H2D copy on the copy lane, which runs one copy at
  a time in issue order and starts none before the compute clock reaches the node (the
  node follows the ``swap_slot`` that frees its slot, so that is when the slot is free);
- ``allgather(b)`` queues the gather on the AllGather lane once the copy is done; a block
  with no allgather is complete when its copy is;
- ``wait(b)`` holds compute until block ``b`` is complete: the gap is a *stall*;
- ``compute`` advances the compute clock.

A steady call of a denoising loop (the graph ends with the ring of wrap-around
prefetches) starts from the previous call's `CallState`: the blocks the wrap-around
prefetches brought (their ordinary prefetch is skipped: they are in their slots, or on
their way) and when each lane frees. ``start=None`` is a cold call, every copy issued
in it. The result gives the next call's `CallState`, so a caller predicts a steady call
as a call started from the state another left.

One worker thread does a CPU runtime's copies and gathers; a device runs them on two
streams. A caller that predicts the CPU executor's one lane passes each block's H2D and
AllGather time summed as its H2D time and writes no allgather (the device budget does:
see [Note: resident blocks spread through the stack] in budget.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

__all__ = ["Event", "Span", "CallState", "Call", "simulate_call", "block_program"]


@dataclass(frozen=True)
class Event:
    """One node of a program: ``kind`` is prefetch, allgather, wait or compute.

    ``block``: the block a schedule node moves or waits for; the block a compute is
    charged to (-1: none). ``seconds``: of a compute. ``wrap``: a wrap-around prefetch
    (or its allgather). ``tag``: the caller's label of a compute (the dump: the resident
    block it reads)."""

    kind: str
    block: int = -1
    seconds: float = 0.0
    wrap: bool = False
    tag: int = -1


@dataclass(frozen=True)
class Span:
    """One busy (or stalled) stretch of a lane. ``kind``: compute, stall, h2d or
    allgather; adjacent computes of one block and tag are one span."""

    kind: str
    block: int
    start: float
    end: float
    wrap: bool = False
    tag: int = -1


@dataclass(frozen=True)
class CallState:
    """The lanes when a call starts, in seconds from its start: when each block the
    previous call's wrap-around prefetches brought is complete, and when the copy and
    AllGather lanes free."""

    ready: Mapping[int, float] = field(default_factory=dict)
    h2d_free: float = 0.0
    gather_free: float = 0.0


@dataclass(frozen=True)
class Call:
    spans: tuple[Span, ...]
    compute_end: float
    """When the last compute ends: the call returns."""
    end: float
    """When the last lane ends (wrap-around copies may outlast the compute)."""
    stall_s: float
    next_state: CallState
    """The state the next call of the loop starts from."""

    def stalls(self) -> dict[int, float]:
        """Seconds compute waited for each block."""
        out: dict[int, float] = {}
        for s in self.spans:
            if s.kind == "stall":
                out[s.block] = out.get(s.block, 0.0) + s.end - s.start
        return out


def simulate_call(program: Sequence[Event], h2d_s: Sequence[float],
                  gather_s: Sequence[float], start: Optional[CallState] = None) -> Call:
    """One call of ``program`` (see [Note: the schedule simulator]); ``h2d_s`` and
    ``gather_s``: seconds per block on each lane; ``start``: the state the call starts
    from (None: cold)."""
    gathered = {e.block for e in program if e.kind == "allgather"}
    wrapped = {e.block for e in program if e.wrap} if start is not None else set()
    state = start if start is not None else CallState()
    h2d_free, gather_free = state.h2d_free, state.gather_free
    ready: dict[int, float] = dict(state.ready)
    copy_done: dict[int, float] = {}
    wrap_ready: dict[int, float] = {}
    spans: list[Span] = []
    t = stall = 0.0
    for e in program:
        g = e.block
        if e.kind == "prefetch":
            if g in wrapped and not e.wrap:
                continue  # the previous call's wrap-around prefetch brought it
            begin = max(t, h2d_free)
            end = h2d_free = begin + h2d_s[g]
            copy_done[g] = end
            spans.append(Span("h2d", g, begin, end, e.wrap))
            if g not in gathered:
                (wrap_ready if e.wrap else ready)[g] = end
        elif e.kind == "allgather":
            if g in wrapped and not e.wrap:
                continue
            begin = max(t, copy_done.get(g, t), gather_free)
            end = gather_free = begin + gather_s[g]
            spans.append(Span("allgather", g, begin, end, e.wrap))
            (wrap_ready if e.wrap else ready)[g] = end
        elif e.kind == "wait":
            r = ready.get(g, t)
            if r > t:
                spans.append(Span("stall", g, t, r))
                stall += r - t
                t = r
        elif e.kind == "compute":
            last = spans[-1] if spans else None
            if (last is not None and last.kind == "compute" and last.block == g
                    and last.tag == e.tag and last.end == t):
                spans[-1] = Span("compute", g, last.start, t + e.seconds, tag=e.tag)
            else:
                spans.append(Span("compute", g, t, t + e.seconds, tag=e.tag))
            t += e.seconds
        else:
            raise ValueError(f"dlo: internal error: unknown schedule event {e.kind!r}")
    next_state = CallState({g: max(0.0, end - t) for g, end in wrap_ready.items()},
                           max(0.0, h2d_free - t), max(0.0, gather_free - t))
    end = max([t] + [s.end for s in spans])
    return Call(tuple(spans), t, end, stall, next_state)


def block_program(compute_s: Sequence[float], streamed: Sequence[int], num_slots: int, *,
                  gather: bool = False) -> list[Event]:
    """The schedule `insert_schedule` writes, one compute per block: block ``i`` computes
    ``compute_s[i]``; the ``streamed`` ones (ascending) stream through ``num_slots``
    slots (streamed block ``j`` in slot ``j % num_slots``, prefetched once streamed block
    ``j - num_slots`` was read for the last time, and with more streamed blocks than
    slots the ring of wrap-around prefetches); the others are resident. ``gather``:
    each prefetch is followed by its allgather."""
    position = {g: j for j, g in enumerate(streamed)}
    m, k = len(streamed), num_slots
    program: list[Event] = []

    def prefetch(g: int, wrap: bool = False) -> None:
        program.append(Event("prefetch", g, wrap=wrap))
        if gather:
            program.append(Event("allgather", g, wrap=wrap))

    for g in streamed[:k]:
        prefetch(g)
    for i, w in enumerate(compute_s):
        j = position.get(i)
        if j is None:
            program.append(Event("compute", i, w))
            continue
        program.append(Event("wait", i))
        program.append(Event("compute", i, w))
        if j + k < m:
            prefetch(streamed[j + k])
        if m > k and j >= m - k:  # the last block in its slot: the ring
            prefetch(streamed[j % k], wrap=True)
    return program

"""Predicted timeline of one scheduled graph: compute, H2D and AllGather lanes.

`timing_for` gives every graph block a copy, gather and compute time: measured by a
traced run where there is one (`measure.BlockMeasure`), from the block's bytes and a
bandwidth otherwise (the measured one when other blocks were traced, else `Assumptions`).
`simulate` hands the schedule nodes, in graph order, to the schedule simulator
(`dlo_fx.planning.simulate`, the one the device budget and ``mode="auto"`` use; see
[Note: the schedule simulator]) on two lanes, as a device runs them:

- ``prefetch(b)`` queues the H2D copy of this rank's shard on the copy lane (in issue
  order); ``allgather(b)`` queues the gather on the AllGather lane once the copy is done;
- ``wait(b)`` holds compute until block ``b`` is complete: the gap is a *stall*;
- every other node is compute, charged to the innermost block that is waited for and not
  yet swapped out (its compute time split evenly over those nodes). Without a
  measurement a block computes its bytes, plus those of the resident parameters its
  nodes read, at `Assumptions.compute_gbps`; nodes outside every block compute the
  resident bytes they read (grey bars), other nodes outside blocks cost nothing.
  Nodes that read a block the device budget keeps resident (`Step.resident_block`) are
  such bars too, tagged with that block (``Bar.resident_block``): the picture shows where
  each resident block computes, and it has no copy or gather, since it never moves.

When the graph ends with the ring of wrap-around prefetches (the first ``num_slots``
blocks), the picture is a steady call of a denoising loop: those blocks were prefetched by
the previous call (their copies may still be running when the call starts), and the
wrap-around copies are drawn at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from .. import figures
from ...planning.simulate import CallState, Event, simulate_call
from .measure import BlockMeasure
from .record import GraphDump


@dataclass(frozen=True)
class Assumptions:
    """What a prediction uses where nothing was measured: the generic node of
    `dlo_fx.apps.figures`, the figures the planning study (``dlo-fx plan``) assumes."""

    h2d_gbps: float = figures.value("generic_h2d_gbps")
    """Host-to-device copy bandwidth, GB/s (PCIe 4.0 x16, pinned). Default: ``25.0``."""
    gather_gbps: float = figures.value("generic_gather_gbps")
    """Bytes an AllGather delivers to each rank per second, GB/s. Default: ``50.0``."""
    compute_gbps: float = figures.value("generic_compute_gbps")
    """Compute time of a block taken as its bytes over this rate, GB/s (a bf16 DiT block
    on ~4k tokens at ~400 TFLOP/s). Default: ``100.0``."""

    def __post_init__(self) -> None:
        for name in ("h2d_gbps", "gather_gbps", "compute_gbps"):
            figures.positive("Assumptions.", name, getattr(self, name), "a bandwidth in GB/s > 0")


@dataclass(frozen=True)
class Timing:
    """Seconds per graph block for each lane, and where the numbers come from."""

    h2d_s: tuple[float, ...]
    gather_s: tuple[float, ...]
    compute_s: tuple[float, ...]
    source: str
    compute_bps: float = Assumptions.compute_gbps * 1e9
    """Rate of compute outside blocks (nodes reading resident parameters only)."""


@dataclass(frozen=True)
class Bar:
    """One bar of the picture. ``kind``: compute, stall, h2d or allgather. ``block`` -1:
    compute outside every block (nodes reading resident parameters only)."""

    kind: str
    block: int
    start: float
    end: float
    wrap: bool = False
    resident_block: int = -1
    """Compute of a block the device budget keeps resident (its number in the budget
    plan; ``block`` is -1), -1 otherwise."""

    @property
    def lane(self) -> str:
        return "compute" if self.kind in ("compute", "stall") else self.kind


@dataclass(frozen=True)
class Prediction:
    bars: tuple[Bar, ...]
    total_s: float
    stall_s: float
    steady: bool


def _gb(bps: float) -> str:
    return f"{bps / 1e9:.3g} GB/s"


def _source(name: str, measured: int, n: int, fallback: str) -> str:
    if n and measured == n:
        return f"{name} measured"
    if measured:
        return f"{name} measured for {measured} of {n} blocks, else {fallback}"
    return f"{name} {fallback}"


def timing_for(dump: GraphDump, measures: Optional[Mapping[int, BlockMeasure]] = None, *,
               h2d_bps: Optional[float] = None, gather_bps: Optional[float] = None,
               assume: Assumptions = Assumptions()) -> Timing:
    """Per-block times: measured where ``measures`` has them, else bytes / bandwidth
    (``h2d_bps``/``gather_bps`` when measured on other blocks, else ``assume``)."""
    measures = measures or {}
    _, resident_bytes = _attribution(dump)
    h2d_rate = h2d_bps or assume.h2d_gbps * 1e9
    gather_rate = gather_bps or assume.gather_gbps * 1e9
    compute_rate = assume.compute_gbps * 1e9
    gathered = dump.mode == "allgather"
    h2d, gather, compute = [], [], []
    got = {"h2d": 0, "gather": 0, "compute": 0}
    for row in dump.blocks:
        m = measures.get(row.index, BlockMeasure())
        got["h2d"] += m.h2d_s is not None
        h2d.append(m.h2d_s if m.h2d_s is not None else row.shard_bytes / h2d_rate)
        if gathered:
            got["gather"] += m.gather_s is not None
            gather.append(m.gather_s if m.gather_s is not None
                          else (dump.dp - 1) * row.shard_bytes / gather_rate)
        else:
            gather.append(0.0)
        got["compute"] += m.compute_s is not None
        compute.append(m.compute_s if m.compute_s is not None
                       else (row.nbytes + resident_bytes[row.index]) / compute_rate)
    n = len(dump.blocks)
    kind = "measured" if h2d_bps else "assumed"
    parts = [_source("H2D", got["h2d"], n, f"from bytes at {_gb(h2d_rate)} ({kind})")]
    if gathered:
        kind = "measured" if gather_bps else "assumed"
        parts.append(_source("AllGather", got["gather"], n,
                             f"from bytes at {_gb(gather_rate)} ({kind})"))
    parts.append(_source("compute", got["compute"], n,
                         f"from bytes at {_gb(compute_rate)} (assumed)"))
    return Timing(tuple(h2d), tuple(gather), tuple(compute), "; ".join(parts), compute_rate)


def _attribution(dump: GraphDump) -> tuple[dict[int, int], dict[int, int]]:
    """Per graph block: the op nodes charged to it, and the resident bytes they read."""
    ops: dict[int, int] = {row.index: 0 for row in dump.blocks}
    resident: dict[int, int] = {row.index: 0 for row in dump.blocks}
    open_blocks: list[int] = []
    for step in dump.program:
        if step.kind == "wait":
            open_blocks.append(step.block)
        elif step.kind == "swap_slot" and step.block in open_blocks:
            open_blocks.remove(step.block)
        elif step.kind == "op" and open_blocks:
            ops[open_blocks[-1]] += 1
            resident[open_blocks[-1]] += step.resident_bytes
    return ops, resident


def program_of(dump: GraphDump, timing: Timing, ops: dict[int, int]) -> list[Event]:
    """The graph's schedule nodes and compute, as the simulator takes them: each op node
    charged to the innermost open block (its compute time split evenly over its nodes),
    or, outside every block, the resident bytes it reads at ``timing.compute_bps``."""
    program: list[Event] = []
    open_blocks: list[int] = []
    for step in dump.program:
        g = step.block
        if step.kind in ("prefetch", "allgather"):
            program.append(Event(step.kind, g, wrap=step.wrap))
        elif step.kind == "wait":
            program.append(Event("wait", g))
            open_blocks.append(g)
        elif step.kind == "swap_slot":
            if g in open_blocks:
                open_blocks.remove(g)
            if not ops.get(g):  # no node of its own: charge it here
                program.append(Event("compute", g, timing.compute_s[g]))
        elif step.kind == "op" and open_blocks:
            g = open_blocks[-1]
            program.append(Event("compute", g, timing.compute_s[g] / ops[g]))
        elif step.kind == "op" and step.resident_bytes:
            program.append(Event("compute", -1, step.resident_bytes / timing.compute_bps,
                                 tag=step.resident_block))
    return program


def simulate(dump: GraphDump, timing: Timing) -> Prediction:
    """Predict one call of the graph with the schedule simulator
    (`dlo_fx.planning.simulate`): a steady call when it has a wrap-around prefetch,
    started from the lanes a call left that started with every wrapped block in its slot
    and both lanes free."""
    steady = any(step.wrap for step in dump.program)
    ops, _ = _attribution(dump)
    program = program_of(dump, timing, ops)
    gather_s = timing.gather_s if dump.mode == "allgather" else (0.0,) * len(timing.h2d_s)
    call = simulate_call(program, timing.h2d_s, gather_s, CallState() if steady else None)
    if steady:  # the second call starts where the first left the wrap-around copy
        call = simulate_call(program, timing.h2d_s, gather_s, call.next_state)
    bars = tuple(Bar(b.kind, b.block, b.start, b.end, b.wrap, b.tag) for b in call.spans)
    return Prediction(bars, call.end, call.stall_s, steady)

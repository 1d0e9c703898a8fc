"""What a traced run measured: per-block copy, gather and compute times, stalls.

Spans come from `dlo_fx.runtime.device.trace.Tracer` and name *host* blocks; a dump shows
*graph* blocks. `graph_blocks_of` maps one to the other. Compute spans of blocks can
nest (with three slots, block 2 may be waited for and finished while block 1 is still
open), so `exclusive_compute` gives each instant of the compute lane to the innermost
open block, the way `timeline.simulate` spends it, and none of it while compute waits.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ...runtime import Span
from .record import GraphDump


def spans_of(tracer) -> list[Span]:
    """A copy of the tracer's spans (the worker thread may still be appending)."""
    return list(tracer.spans) if tracer is not None else []


def graph_blocks_of(dumps: Sequence[GraphDump], runtime) -> dict[int, tuple[GraphDump, int]]:
    """``{host block: (dump, graph block)}`` for the host blocks of ``dumps`` (one runtime).

    A host block committed when a graph was compiled belongs to that graph's block. A
    host block registered later, when Dynamo reused a graph for another layer of the same
    shape, belongs to the first graph block whose parameter names cover its own.
    """
    out: dict[int, tuple[GraphDump, int]] = {}
    for dump in dumps:
        for row in dump.blocks:
            if row.host_block >= 0:
                out.setdefault(row.host_block, (dump, row.index))
    if runtime is None:
        return out
    for host in runtime.store.blocks:
        if host.index in out:
            continue
        names = set(host.fqns)
        for dump in dumps:
            row = next((r for r in dump.blocks if names and names <= set(r.fqns)), None)
            if row is not None:
                out[host.index] = (dump, row.index)
                break
    return out


def spans_of_graph(dump: GraphDump, spans: Sequence[Span], runtime,
                   owner: dict[int, tuple[GraphDump, int]]) -> tuple[list[Span], dict[int, int]]:
    """The spans of ``dump``'s graph and ``{host block: graph block}`` for them.

    Spans tagged with the graph's id are its own, whatever host blocks they name: a
    recompile for a new shape runs other graphs over the same host blocks. Untagged spans
    go by ``owner`` (`graph_blocks_of`).
    """
    mine = {row.host_block: row.index for row in dump.blocks if row.host_block >= 0}
    mine.update({h: g for h, (d, g) in owner.items() if d is dump and h not in mine})
    if runtime is not None:  # host blocks bound later (Dynamo reusing the graph)
        for host in runtime.store.blocks:
            if host.index not in mine and host.fqns:
                names = set(host.fqns)
                row = next((r for r in dump.blocks if names <= set(r.fqns)), None)
                if row is not None:
                    mine[host.index] = row.index
    owned = {h for h, (d, _) in owner.items() if d is dump}
    picked = [s for s in spans if s.block in mine and (
        s.graph == dump.graph_id if s.graph >= 0 and dump.graph_id >= 0 else s.block in owned)]
    return picked, mine


def exclusive_compute(spans: Iterable[Span]) -> dict[int, list[int]]:
    """``{host block: [exclusive compute ns of each of its compute spans]}``.

    On each lane that ran compute, every instant goes to the open compute span that
    started last, except instants covered by another span of that lane (a ``wait`` stall,
    or a copy the thread ran itself).
    """
    by_lane: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.block is not None:
            by_lane[s.lane].append(s)
    out: dict[int, list[int]] = defaultdict(list)
    for lane_spans in by_lane.values():
        computes = sorted((s for s in lane_spans if s.kind == "compute"), key=lambda s: s.start_ns)
        if not computes:
            continue
        # spans of one thread other than compute never overlap, so they end in start order
        blocked = sorted((s for s in lane_spans if s.kind != "compute"), key=lambda s: s.start_ns)
        own = [0] * len(computes)
        cuts = sorted({t for s in computes + blocked for t in (s.start_ns, s.end_ns)})
        active: list[int] = []
        ci = bi = 0
        for t0, t1 in zip(cuts, cuts[1:]):
            while ci < len(computes) and computes[ci].start_ns <= t0:
                active.append(ci)
                ci += 1
            active = [i for i in active if computes[i].end_ns > t0]
            while bi < len(blocked) and blocked[bi].end_ns <= t0:
                bi += 1
            if active and not (bi < len(blocked) and blocked[bi].start_ns <= t0):
                own[active[-1]] += t1 - t0
        for span, ns in zip(computes, own):
            out[span.block].append(ns)
    return dict(out)


@dataclass(frozen=True)
class BlockMeasure:
    """Median measured times of one graph block, in seconds (None: not measured)."""

    h2d_s: Optional[float] = None
    gather_s: Optional[float] = None
    compute_s: Optional[float] = None


def _median(values: list[float]) -> Optional[float]:
    """Median: robust to the first call, which pays for warm-up."""
    return statistics.median(values) if values else None


def measure_blocks(dump: GraphDump, spans: Sequence[Span],
                   owner: dict[int, tuple[GraphDump, int]]) -> dict[int, BlockMeasure]:
    """Per graph block of ``dump``: median copy, gather and exclusive compute time."""
    mine = {h: g for h, (d, g) in owner.items() if d is dump}
    h2d: dict[int, list[float]] = defaultdict(list)
    gather: dict[int, list[float]] = defaultdict(list)
    for s in spans:
        g = mine.get(s.block)
        if g is None:
            continue
        if s.kind == "prefetch":
            h2d[g].append(s.duration_ns / 1e9)
        elif s.kind == "allgather":
            gather[g].append(s.duration_ns / 1e9)
    compute: dict[int, list[float]] = defaultdict(list)
    for host, times in exclusive_compute(spans).items():
        g = mine.get(host)
        if g is not None:
            compute[g].extend(ns / 1e9 for ns in times)
    return {row.index: BlockMeasure(_median(h2d[row.index]), _median(gather[row.index]),
                                    _median(compute[row.index]))
            for row in dump.blocks}


def measured_bandwidth(spans: Sequence[Span], kind: str,
                       bytes_of: dict[int, int]) -> Optional[float]:
    """Bytes per second moved by spans of ``kind`` (``bytes_of``: host block -> bytes)."""
    moved = sum(bytes_of.get(s.block, 0) for s in spans if s.kind == kind)
    took = sum(s.duration_ns for s in spans if s.kind == kind and s.block in bytes_of)
    return moved / (took / 1e9) if moved and took > 0 else None

"""Write dump folders, and refresh them with what traced runs measured.

[Note: dump folders]
With ``options={"dump_dir": D}`` (or ``DLO_FX_DUMP_DIR=D``) the backend calls
`write_dump` for every graph it schedules. Graph ``n`` (the n-th graph this process
dumped under ``D``, from 0) gets ``D/graph_<n>/``; with several ranks, ``D/rank_<r>/graph_<n>/``.
The folder holds ``schedule.py``, ``blocks.md`` and ``timeline.svg`` at once. Spans exist
only once the model ran with ``trace=True``, so `flush` (called for every dump at process
exit too) re-writes ``blocks.md`` (stall section) and ``timeline.svg`` (measured times)
and writes ``trace.json``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import fx

from ...planning.stages import GraphPlan
from ...runtime import Runtime, Span, runtimes_holding
from .blocks_md import blocks_markdown
from .chrome_trace import trace_events, write_trace_file
from .measure import (graph_blocks_of, measure_blocks, measured_bandwidth, spans_of,
                      spans_of_graph)
from .record import GraphDump, snapshot
from .schedule_code import annotated_code
from .stalls import StallSummary, summarize
from .svg import render_svg
from .timeline import Assumptions, simulate, timing_for

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_NEXT: dict[str, int] = {}  # resolved dump root -> next graph number
_DUMPS: list[GraphDump] = []
_AT_EXIT = False


def _root(dump_dir: Union[str, os.PathLike]) -> Path:
    root = Path(dump_dir)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        root = root / f"rank_{dist.get_rank()}"
    return root


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_dump(gm: fx.GraphModule, ctx: GraphPlan, runtime: Optional[Runtime],
               dump_dir: Union[str, os.PathLike]) -> Path:
    """Write the dump folder of a scheduled graph and return it. Called by the backend.

    See [Note: dump folders]. Raises ValueError naming the folder when it can't be written.
    """
    root = _root(dump_dir)
    base = _variant_of(ctx, runtime) if getattr(ctx, "variant", False) else None
    with _LOCK:
        key = str(root.resolve())
        index = base.index if base is not None else _NEXT.get(key, 0)
        if base is None:
            _NEXT[key] = index + 1
    folder = root / f"graph_{index}" if base is None else _variant_folder(base, ctx)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "trace.json").unlink(missing_ok=True)  # from an earlier process
        dump = snapshot(gm, ctx, runtime, index, folder)
        dump.variant_of = base
        _write(folder / "schedule.py", annotated_code(gm, dump))
    except OSError as exc:
        raise ValueError(
            f"dlo dump_dir={str(dump_dir)!r}: cannot write {folder}: {exc}; set "
            "options['dump_dir'] (or DLO_FX_DUMP_DIR) to a writable folder") from exc
    with _LOCK:
        _DUMPS.append(dump)
        peers = [d for d in _DUMPS if d.runtime is runtime]
    _render(dump, peers)
    if dump.tracer is not None:
        _flush_at_exit()
    log.info("dlo: wrote the dump of graph %d (%d blocks) to %s", index, len(dump.blocks),
             folder)
    return folder


def _variant_of(ctx: GraphPlan, runtime: Optional[Runtime]) -> Optional[GraphDump]:
    """The dump of the graph an auto-budget variant re-plans: the latest one of the same
    runtime with the same blocks that is no variant itself (None: write it as a graph)."""
    fqns = getattr(ctx.budget_plan, "fqns", None)
    with _LOCK:
        for d in reversed(_DUMPS):
            if (d.variant_of is None and d.runtime is runtime and d.budget_plan is not None
                    and d.budget_plan.fqns == fqns):
                return d
    return None


def _variant_folder(base: GraphDump, ctx: GraphPlan) -> Path:
    """``graph_<n>/budget_<k>_of_<m>_resident``: a variant of graph n, inside its folder
    (a ``graph_<n>`` folder of its own would read as a graph break)."""
    plan = ctx.budget_plan
    return base.folder / f"budget_{len(plan.resident)}_of_{len(plan.block_bytes)}_resident"


# -- rendering -----------------------------------------------------------------------------
def _shard_bytes(peers: Sequence[GraphDump], runtime: Optional[Runtime]) -> dict[int, int]:
    """host block -> bytes one H2D copy moves."""
    if runtime is not None:
        return {b.index: b.shard_nbytes for b in runtime.store.blocks}
    return {row.host_block: row.shard_bytes for d in peers for row in d.blocks}


def _render(dump: GraphDump, peers: Sequence[GraphDump],
            assume: Assumptions = Assumptions()) -> None:
    """(Re-)write blocks.md, timeline.svg and, when spans exist, trace.json."""
    runtime = dump.runtime
    spans = spans_of(dump.tracer)
    owner = graph_blocks_of(peers, runtime)
    my_spans, mine = spans_of_graph(dump, spans, runtime, owner)
    shard = _shard_bytes(peers, runtime)
    gathered = {h: (dump.dp - 1) * n for h, n in shard.items()}
    timing = timing_for(dump, measure_blocks(dump, my_spans,
                                             {h: (dump, g) for h, g in mine.items()}),
                        h2d_bps=measured_bandwidth(spans, "prefetch", shard),
                        gather_bps=measured_bandwidth(spans, "allgather", gathered),
                        assume=assume)
    rows = {row.index: row for row in dump.blocks}
    stalls = summarize(my_spans, lambda h: (mine[h], f"{rows[mine[h]].fqns[0]} .. "
                                                    f"{rows[mine[h]].fqns[-1]}"))
    _write(dump.folder / "blocks.md", blocks_markdown(dump, stalls))
    kept = len(dump.budget_plan.resident) if dump.budget_plan is not None else 0
    blocks = (f"{len(dump.blocks)} streamed blocks, {kept} resident" if kept
              else f"{len(dump.blocks)} blocks")
    variant = " (device_budget variant)" if dump.variant_of is not None else ""
    title = (f"dlo graph {dump.index}{variant}: {blocks}, {dump.num_slots} slots, "
             f"{dump.mode}" + (f" (rank {dump.rank} of {dump.dp})" if dump.dp > 1 else ""))
    _write(dump.folder / "timeline.svg", render_svg(dump, simulate(dump, timing), timing, title))
    if my_spans:
        def describe(s: Span) -> tuple[str, dict]:
            row = rows[mine[s.block]]
            return f"{s.kind} b{row.index}", {
                "block": row.index, "host_block": s.block, "slot": s.slot,
                "bytes": row.shard_bytes if s.kind == "prefetch" else row.slot_bytes,
                "first": row.fqns[0], "last": row.fqns[-1]}

        events = trace_events(my_spans, describe, pid=dump.rank,
                              process=f"dlo rank {dump.rank}, graph {dump.index}")
        write_trace_file(dump.folder / "trace.json", events, graph=dump.index, mode=dump.mode,
                         num_slots=dump.num_slots, dp=dump.dp)
    dump.flushed_spans = len(spans)


def _peers_of(dump: GraphDump) -> list[GraphDump]:
    """Dumps of graphs that share ``dump``'s runtime (its host blocks, its spans)."""
    runtime = dump.runtime
    with _LOCK:
        if runtime is not None:
            return [d for d in _DUMPS if d.runtime is runtime]
        return [d for d in _DUMPS
                if d is dump or (d.tracer is not None and d.tracer is dump.tracer)]


Target = Union[torch.nn.Module, Runtime]
"""What the whole-runtime views take: a model (or its compiled wrapper) or a runtime."""


def _runtimes_of(target: Target) -> list[Runtime]:
    if isinstance(target, Runtime):
        return [target]
    if isinstance(target, torch.nn.Module):
        return runtimes_holding(list(dict.fromkeys(target.parameters())))
    raise ValueError(f"expected a model compiled with backend='dlo' or a dlo Runtime, got "
                     f"{type(target).__name__}")


def flush(target: Optional[Target] = None, *, assume: Optional[Assumptions] = None) -> list[Path]:
    """Re-write the dumps of ``target`` (a model, its compiled wrapper or a runtime; None:
    every dump of this process) with what traced calls measured so far: ``trace.json``,
    the stall section of ``blocks.md`` and a measured ``timeline.svg``. ``assume`` sets
    what the timeline assumes where nothing was measured (default: `Assumptions()`).
    Returns the folders written; dumps whose folder was removed are skipped."""
    with _LOCK:
        found = list(_DUMPS)
    if target is not None:
        runtimes = _runtimes_of(target)
        found = [d for d in found if any(d.runtime is rt for rt in runtimes)]
    written = []
    for dump in found:
        if dump.folder.is_dir():
            _render(dump, _peers_of(dump), assume or Assumptions())
            written.append(dump.folder)
    return written


def _at_exit() -> None:
    with _LOCK:
        dumps = [d for d in _DUMPS if d.tracer is not None]
    for dump in dumps:
        if len(dump.tracer.spans) > dump.flushed_spans and dump.folder.is_dir():
            try:
                _render(dump, _peers_of(dump))
            except Exception:  # never fail interpreter shutdown over a dump
                log.warning("dlo: could not write the traced dump of %s", dump.folder,
                            exc_info=True)


def _flush_at_exit() -> None:
    global _AT_EXIT
    with _LOCK:
        if not _AT_EXIT:
            atexit.register(_at_exit)
            _AT_EXIT = True


# -- whole-runtime views ---------------------------------------------------------------------
def _traced(target: Target) -> list[Runtime]:
    runtimes = [rt for rt in _runtimes_of(target) if rt.tracer is not None]
    if not runtimes:
        raise ValueError("no traced dlo runtime holds this model's weights: compile it with "
                         "torch.compile(model, backend='dlo', options={'trace': True}) and run "
                         "it before asking for its trace or stalls")
    return runtimes


def _label(runtime: Runtime, host: int) -> str:
    fqns = runtime.store.blocks[host].fqns if 0 <= host < len(runtime.store.blocks) else []
    return f"{fqns[0]} .. {fqns[-1]}" if fqns else f"host block {host}"


def stall_summary(target: Target) -> StallSummary:
    """Stalls of every traced call of ``target`` (a model, its compiled wrapper or a
    runtime), per host block, largest first; ``print()`` it for a table."""
    runtimes = _traced(target)
    spans = [s for rt in runtimes for s in spans_of(rt.tracer)]
    return summarize(spans, lambda h: (h, _label(runtimes[0], h)))


def write_trace(target: Target, path: Union[str, os.PathLike]) -> Path:
    """Write every measured span of ``target``'s runtime(s) as a Chrome trace-event file
    (open it in Perfetto) and return its path. Blocks are host blocks."""
    runtimes = _traced(target)
    events: list[dict] = []
    origin = min((s.start_ns for rt in runtimes for s in spans_of(rt.tracer)), default=0)
    for i, rt in enumerate(runtimes):
        rank = rt.store.rank

        def describe(s: Span, rt=rt) -> tuple[str, dict]:
            host = rt.store.blocks[s.block] if 0 <= s.block < len(rt.store.blocks) else None
            args = {"host_block": s.block, "slot": s.slot}
            if host is not None:
                args.update(bytes=host.shard_nbytes if s.kind == "prefetch" else host.slot_bytes,
                            first=host.fqns[0], last=host.fqns[-1])
            return f"{s.kind} block {s.block}", args

        events += trace_events(spans_of(rt.tracer), describe, pid=rank * 100 + i, origin=origin,
                               process=f"dlo rank {rank} ({rt.mode}, {rt.slots.num_slots} slots)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace_file(path, events)
    return path


def dumps() -> list[GraphDump]:
    """Every dump this process wrote, in order."""
    with _LOCK:
        return list(_DUMPS)


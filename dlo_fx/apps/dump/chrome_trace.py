"""Measured spans as a Chrome trace-event file (open it in https://ui.perfetto.dev).

Each span becomes a complete event (``"ph": "X"``) on the lane it really ran on: the
copy worker thread for ``prefetch`` and ``allgather``, the compute thread for ``wait``
(a stall) and ``compute`` (from a block's wait returning to its ``swap_slot``). Compute
spans of consecutive blocks overlap (block b+1 is waited for before block b is swapped
out), and a trace viewer needs the slices of one track to nest, so compute spans get
their own tracks under their thread ("MainThread compute", "MainThread compute 2", ...).
The process is the rank. Times are microseconds from the first span.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable, Optional

from ...runtime import Span

def _tracks(spans: list[Span]) -> list[tuple[str, list[Span]]]:
    """Split spans into tracks whose spans never overlap, named after their lane."""
    groups: dict[tuple[str, bool], list[Span]] = {}
    for s in spans:
        groups.setdefault((s.lane, s.kind == "compute"), []).append(s)
    tracks: list[tuple[str, list[Span]]] = []
    main_first = lambda kv: (kv[0][0] != "MainThread", kv[0])  # noqa: E731
    for (lane, is_compute), group in sorted(groups.items(), key=main_first):
        packed: list[list[Span]] = []
        for s in sorted(group, key=lambda s: (s.start_ns, s.end_ns)):
            for track in packed:
                if track[-1].end_ns <= s.start_ns:
                    track.append(s)
                    break
            else:
                packed.append([s])
        base = f"{lane} compute" if is_compute else lane
        for i, track in enumerate(packed):
            tracks.append((base if i == 0 else f"{base} {i + 1}", track))
    return tracks


def trace_events(spans: Iterable[Span], describe: Callable[[Span], tuple[str, dict]],
                 *, pid: int = 0, process: str = "dlo",
                 origin: Optional[int] = None) -> list[dict]:
    """Trace events for ``spans``; ``describe(span) -> (event name, args)``. Times count
    from ``origin`` (ns; default: the first span)."""
    spans = list(spans)
    if origin is None:
        origin = min((s.start_ns for s in spans), default=0)
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                           "args": {"name": process}}]
    for tid, (name, track) in enumerate(_tracks(spans), start=1):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}})
        for s in track:
            label, args = describe(s)
            events.append({"name": label, "cat": s.kind, "ph": "X", "pid": pid, "tid": tid,
                           "ts": (s.start_ns - origin) / 1e3,
                           "dur": max(s.duration_ns, 0) / 1e3, "args": args})
    return events


def write_trace_file(path: os.PathLike | str, events: list[dict], **other: object) -> None:
    """Write ``events`` as a trace-event JSON object (``otherData`` holds ``other``)."""
    doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)

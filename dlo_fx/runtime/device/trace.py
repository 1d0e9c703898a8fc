"""`Tracer`: measured spans of the schedule, on the lanes they really ran on.

Kinds: ``prefetch`` (the copy of a host shard into a slot), ``allgather`` (the gather
that completes it), ``wait`` (time compute was blocked waiting for a block: a stall) and
``compute`` (from a block's wait returning to its swap_slot). Lanes are thread names on
CPU and stream names on a device. Times are ``time.perf_counter_ns()``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Span:
    kind: str
    block: int  # host block index
    slot: int
    lane: str
    start_ns: int
    end_ns: int
    graph: int = -1  # the `GraphSchedule.graph` whose node issued it (-1: none)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class Tracer:
    """Spans of the most recent ``max_spans`` schedule events (older ones are dropped, so
    a long traced run does not grow without bound)."""

    def __init__(self, max_spans: int = 500_000) -> None:
        self.spans: deque[Span] = deque(maxlen=max_spans)
        self._lock = threading.Lock()
        self.graph = -1
        """The graph whose schedule node runs now: spans are tagged with it, so the dump
        of each graph (a recompile for a new shape shares the host blocks) gets its own."""

    def add(self, kind: str, block: int, slot: int, start_ns: int, end_ns: int,
            lane: str | None = None, graph: int | None = None) -> None:
        span = Span(kind, block, slot, lane or threading.current_thread().name, start_ns, end_ns,
                    self.graph if graph is None else graph)
        with self._lock:
            self.spans.append(span)

    def timed(self, kind: str, block: int, slot: int, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` wrapped to record a span of ``kind`` on the thread that runs it, tagged
        with the graph current where it was wrapped."""
        graph = self.graph

        def run() -> None:
            start = time.perf_counter_ns()
            try:
                fn()
            finally:
                self.add(kind, block, slot, start, time.perf_counter_ns(), graph=graph)
        return run

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

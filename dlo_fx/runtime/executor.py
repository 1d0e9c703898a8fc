"""Executors run the copies (and, with ranks, the gathers) that fill slots.

`CpuExecutor` is the CPU contract: one background worker thread does every copy in the
order prefetches were issued, so every rank issues its collectives in one order; ``wait``
blocks the compute thread on the copy's completion. ``fault_delay_s`` delays every task by
a random time to prove that ``wait`` is what orders a slot.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional


class CpuExecutor:
    """One worker thread; tasks run in submission order."""

    def __init__(self, *, fault_delay_s: float = 0.0, seed: int = 0) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self.fault_delay_s = fault_delay_s
        self._rng = random.Random(seed)

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlo-copy")
        return self._pool

    def submit(self, fn: Callable[[], None]) -> Future:
        if self.fault_delay_s:
            delay = self._rng.uniform(0.0, self.fault_delay_s)

            def delayed() -> None:
                time.sleep(delay)
                fn()

            return self._worker().submit(delayed)
        return self._worker().submit(fn)

    @staticmethod
    def wait(handle: Optional[Future], timeout: Optional[float] = None) -> None:
        if handle is not None:
            handle.result(timeout)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

"""Executors run the copies and gathers that fill slots.

Both keep one contract, driven by `Runtime` (see [Note: slot reuse and stream ordering]):

- ``copy(slot, task, nbytes, after, delay_s)``: run ``task`` (the H2D of a host shard into
  ``slot``) once every earlier read of the slot is done and ``after`` (the slot's last copy
  or gather, which nobody may have waited on: a wrap-around prefetch another graph
  replaced) has finished; returns a handle (``delay_s``: see `FaultDelay`);
- ``gather(slot, task, after)``: run ``task`` (the in-place AllGather) after ``after``;
- ``wait(handle)``: compute may read what ``handle`` produced (interruptible: the handle
  stays valid and may be waited on again);
- ``settle(handle)``: as ``wait``, but a task that failed does not raise here (ordering
  after another model's failed copy; see [Note: a failure stays with its model]);
- ``failed(handle)``: the task behind ``handle`` itself raised (not the wait);
- ``release(slot)``: compute has issued its last read of ``slot``;
- ``sync()``: everything issued has finished (compile time only).

`CpuExecutor`: one background worker thread runs every task in issue order, so every rank
issues its collectives in one order; ``wait`` blocks on the task. A copy given a
``delay_s`` (`FaultDelay`, the `fault_delay` test hook) runs on the worker after that
delay, which proves that ``wait`` is what orders a slot.

`DeviceExecutor`: a copy stream for H2D and a comm stream for the AllGather; compute
waits on an event per block, and ``release`` records the event the next copy into that
slot waits on. Nothing blocks the host. Slots and pinned shards live for the runtime's
lifetime (slots are only reallocated after ``sync()``), so no buffer is reused early.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional, Union

import torch

from . import platform
from ...config import check_seconds


class CpuExecutor:
    """One worker thread; tasks run in submission order.

    A copy smaller than ``inline_bytes`` runs on the calling thread instead: waking the
    worker costs tens of microseconds, more than copying a few hundred KiB. Gathers always
    go to the worker, so collectives keep one issue order. An inline copy first waits for
    the slot's last task (``after``): a gather still in flight into the same slot (a
    wrap-around prefetch that the next graph replaces) would otherwise land on top of it.
    """

    inline_bytes = 256 * 1024

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlo-copy")
        return self._pool

    def copy(self, slot: int, task: Callable[[], Any], nbytes: int = 0,
             after: Any = None, delay_s: Optional[float] = None) -> Optional[Future]:
        if nbytes < self.inline_bytes and delay_s is None:
            self.settle(after)  # FIFO: every earlier task touching the slot is done too
            task()
            return None
        if delay_s is not None:
            inner = task

            def task() -> None:
                time.sleep(delay_s)
                inner()

        return self._worker().submit(task)  # FIFO: after ``after``

    def gather(self, slot: int, task: Callable[[], Any], after: Any) -> Future:
        def gather_after_copy() -> None:
            if isinstance(after, Future):
                after.result()  # a failed copy fails the gather: never gather a stale slot
            task()

        return self._worker().submit(gather_after_copy)  # FIFO: after the copy it follows

    @staticmethod
    def wait(handle: Optional[Future]) -> None:
        if handle is not None:
            handle.result()

    @staticmethod
    def settle(handle: Optional[Future]) -> None:
        """Wait until ``handle``'s task has ended, whether or not it failed: an order, not
        a result. Its failure is its owner's (the model whose copy it was raises it from
        its own ``wait``); a copy into the slot after it must not fail for it."""
        if handle is not None:
            try:
                handle.result()
            except Exception:
                pass

    @staticmethod
    def failed(handle: Optional[Future]) -> bool:
        return handle is not None and handle.done() and (
            handle.cancelled() or handle.exception() is not None)

    def release(self, slot: int) -> None:
        """Compute on CPU is synchronous: the slot's reads are already done."""

    def sync(self) -> None:
        if self._pool is not None:
            self._pool.submit(lambda: None).result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class DeviceExecutor:
    """Copy and comm streams ordered against the compute stream by events."""

    def __init__(self, device: torch.device, num_slots: int) -> None:
        self.device = device
        self.copy_stream = platform.new_stream(device)
        self.comm_stream = platform.new_stream(device)
        self._released: list[Optional[torch.Event]] = [None] * num_slots

    def copy(self, slot: int, task: Callable[[], Any], nbytes: int = 0,
             after: Optional[torch.Event] = None, delay_s: Optional[float] = None) -> torch.Event:
        if delay_s is not None:
            raise NotImplementedError("dlo: internal error: a delayed copy on a device")
        with platform.on_stream(self.copy_stream):
            released = self._released[slot]
            if released is not None:
                self.copy_stream.wait_event(released)
            if after is not None:  # the slot's last gather, maybe never waited on
                self.copy_stream.wait_event(after)
            task()
            done = platform.new_event(self.device)
            done.record(self.copy_stream)
        return done

    def gather(self, slot: int, task: Callable[[], Any], after: Optional[torch.Event]) -> torch.Event:
        with platform.on_stream(self.comm_stream):
            if after is not None:
                self.comm_stream.wait_event(after)
            task()
            done = platform.new_event(self.device)
            done.record(self.comm_stream)
        return done

    def wait(self, handle: Optional[torch.Event]) -> None:
        if handle is not None:
            platform.current_stream(self.device).wait_event(handle)

    settle = wait  # an event carries no failure: a task that failed raised when issued

    @staticmethod
    def failed(handle: Optional[torch.Event]) -> bool:
        return True  # nothing blocks in `wait`: whatever raised there is a real failure

    def release(self, slot: int) -> None:
        event = platform.new_event(self.device)
        event.record(platform.current_stream(self.device))
        self._released[slot] = event

    def sync(self) -> None:
        platform.synchronize(self.device)

    def shutdown(self) -> None:
        self.sync()


#: The copy executor of a device's slots: one worker thread on CPU, streams on a device.
Executor = Union[CpuExecutor, DeviceExecutor]


def make_executor(device: torch.device, num_slots: int) -> Executor:
    if not platform.has_streams(device):  # the host, or the meta device
        return CpuExecutor()
    return DeviceExecutor(device, num_slots)


MAX_FAULT_DELAY_S = 60.0
"""Longest injected delay: a test delay, not a sleep that outlives the process."""

_fault_delay_s = 0.0  # set by `fault_delay` only: read when a runtime is made


@contextlib.contextmanager
def fault_delay(max_s: float) -> Iterator[None]:
    """Test hook, not an option: every runtime made inside delays each copy it issues by up
    to ``max_s`` seconds (`FaultDelay`), to prove that ``wait`` orders the slot. Several
    ranks must set the same figure (the ranks compare it when a runtime is made)."""
    global _fault_delay_s
    check_seconds("dlo fault_delay max_s", max_s, MAX_FAULT_DELAY_S)
    before, _fault_delay_s = _fault_delay_s, float(max_s)
    try:
        yield
    finally:
        _fault_delay_s = before


def fault_delay_s() -> float:
    """The delay `fault_delay` set (0.0: none), as a runtime made now takes it."""
    return _fault_delay_s


class FaultDelay:
    """Fault injection (the `fault_delay` test hook), one per runtime: a random delay in
    ``[0, max_s]`` for each copy the runtime issues, from a generator seeded alike in every
    runtime (the same delays in every run). It belongs to the runtime, not to the slots and
    executor it shares with the other models on its device: a test option does not decide
    what is shared. Only the `CpuExecutor` of the runtime's slots (``executor``) runs a
    delayed copy: on a device the streams order the slots."""

    def __init__(self, max_s: float, executor: Executor, seed: int = 0) -> None:
        if max_s and not isinstance(executor, CpuExecutor):
            raise NotImplementedError("fault_delay is a CPU-runtime test hook; on a device the "
                                      "streams order the slots")
        self.max_s = max_s
        self._rng = random.Random(seed)

    def next(self) -> Optional[float]:
        """The next copy's delay (None: no fault injection, the copy may run inline)."""
        return self._rng.uniform(0.0, self.max_s) if self.max_s else None

"""Deferring ``KeyboardInterrupt`` across the runtime's critical sections.

[Note: interrupts and slot state]
The slot state always matches the work issued, even under Ctrl-C. A ``KeyboardInterrupt``
is raised in the main thread between any two bytecodes, and the slot state machine
(`SlotMachine`) records what it issued in a few assignments next to the call that issues it;
an interrupt between the two would leave a slot marked as filled with no copy behind it,
or a gather issued that the state does not know about (and so issued again later on this
rank only). So every step that issues work and records it runs inside `deferred()`: the
``SIGINT`` handler installed by `install()` only notes the interrupt while a section is
open, and the section raises it on exit, once the state is whole.

Blocking waits stay outside these sections: Ctrl-C while a call waits on a copy or a
gather interrupts the wait at once, and the runtime keeps the pending handle, so the next
wait on that slot (or the completion of the graph, see `graph_call.run_graph`) waits again.
The handler chains to the one it replaced (Python's default raises ``KeyboardInterrupt``);
a program that installs its own ``SIGINT`` handler later simply gets no deferral.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

_depth = 0  # open sections on the main thread
_pending: list = []  # (signum, frame) noted while a section was open
_previous: Any = None
_installed = False


def _handler(signum: int, frame: Any) -> None:
    if _depth > 0:
        _pending.append((signum, frame))
        return
    _chain(signum, frame)


def _chain(signum: int, frame: Any) -> None:
    previous = _previous
    if callable(previous):
        previous(signum, frame)
    else:  # SIG_DFL / SIG_IGN were replaced only if they were the default handler
        raise KeyboardInterrupt


def install() -> None:
    """Install the deferring ``SIGINT`` handler (main thread only; once)."""
    global _previous, _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        current = signal.getsignal(signal.SIGINT)
        if current is not signal.default_int_handler:
            _installed = True  # someone else's handler: leave it alone
            return
        signal.signal(signal.SIGINT, _handler)
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        return
    _previous, _installed = current, True


class _Deferred:
    """``with deferred():`` -- no ``KeyboardInterrupt`` inside; raised on exit instead."""

    __slots__ = ("main",)

    def __enter__(self) -> None:
        global _depth
        self.main = threading.current_thread() is threading.main_thread()
        if self.main:
            _depth += 1

    def __exit__(self, *exc: Any) -> None:
        global _depth
        if not self.main:
            return
        _depth -= 1
        if _depth == 0 and _pending:
            signum, frame = _pending.pop()
            _pending.clear()
            _chain(signum, frame)


def deferred() -> _Deferred:
    return _Deferred()

"""`Lifecycle`: whether a runtime may run -- the process that made it, the lock its calls
take, and the two ways it stops: failed (``broken``) and released (``closed``). Each part
of a runtime (runtime.py) holds the same one and asks it before it runs, and a part that
sees a copy or a collective fail says so through `Lifecycle.fail`; nothing else sets
those flags.

[Note: a forked process]
A runtime runs only in the process that made it. ``os.fork`` (multiprocessing's default
start method on Linux) copies a runtime into the child without what runs it: the
executor's worker thread, a copy the parent had in flight, the device streams and the
process group stay with the parent, and a thread of the parent may have held the slots'
lock, so a call in the child would wait forever on a copy no thread runs. `Lifecycle.lock`,
which every graph call, eager fetch, compile and release takes, compares the pid (a syscall
per graph call) and raises in any other process. `shared_slots` gives a forked child its
own slots, so a model loaded or compiled in the child runs there.
"""

from __future__ import annotations

import os
import threading
from typing import Optional


class Lifecycle:
    """One runtime's process, lock and state: open, failed (``broken``: why) or released
    (``closed``). A runtime is made open; it never opens again."""

    def __init__(self, lock: threading.RLock) -> None:
        self.pid = os.getpid()  # see [Note: a forked process]
        self._lock = lock  # the device's, shared with the runtimes on its slots
        self.broken: Optional[str] = None  # set when a copy or gather failed (`fail`)
        self.closed = False  # set by `close`

    @property
    def lock(self) -> threading.RLock:
        """Held around every graph call on these slots (the slot state machine and the
        collective order; see [Note: one call at a time] in graph/graph_call.py), eager fetch,
        compile commit and release. Raises in a forked process (`check_process`)."""
        self.check_process()
        return self._lock

    def in_process(self) -> bool:
        """Whether this is the process that made the runtime."""
        return self.pid == os.getpid()

    def check_process(self) -> None:
        """Raise unless this is the process that made the runtime ([Note: a forked process])."""
        if self.pid != os.getpid():
            raise RuntimeError(
                f"dlo: this model's weights are stored by process {self.pid}, and this process "
                f"({os.getpid()}) was forked from it (os.fork, or multiprocessing's 'fork' "
                "start method): the copy thread, device streams and process group that run "
                "them stay in that process. Load or compile the model in the process that "
                "calls it; multiprocessing's 'spawn' or 'forkserver' start method starts a "
                "fresh one")

    def check_open(self) -> None:
        """Raise when the runtime cannot run a graph. Called under `lock`, which has
        checked the process."""
        if self.broken is not None:
            raise RuntimeError(f"dlo: this runtime failed earlier and is closed ({self.broken}); "
                               "start a fresh process group and recompile")
        if self.closed:  # a graph bound it before another thread's dlo_fx.release took the lock
            raise RuntimeError("dlo: this model's weights were released (dlo_fx.release) on "
                               "another thread while this call started; call it again")

    def fail(self, exc: BaseException) -> None:
        """A copy or a collective failed with ``exc``: fail closed. After a failed
        collective the group is unusable and a slot may hold half a block, so nothing of
        this runtime runs again (`check_open` raises)."""
        self.broken = f"{type(exc).__name__}: {exc}"

    def close(self) -> bool:
        """Mark the runtime released; False when it was already."""
        if self.closed:
            return False
        self.closed = True
        return True

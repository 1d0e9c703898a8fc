"""How an app learns which collective steps a forward issued, to issue them again later
without computing: the runtime notes each step, with the function that replays it, to the
`ForwardLog` of the calling thread (the engine's `ForwardClock` keeps one per forward).

[Note: gather-only forwards]
A replayed forward issues exactly the collectives, in the same order, that a real forward
of the recorded shapes would, and computes nothing. The engine pads ranks with extra
forwards until its peers' longest request ends (see [Note: the forward clock of a wave] in
apps/engine/clock.py), and a padding forward needs the collectives, not the compute. So
while a forward runs under `logging_to(log)`, every step that issues collectives is noted
to ``log`` in order, with a function that issues them again: each scheduled graph
(`graph_call.note_graph`: its schedule, the parameters it was bound with, the arguments its
schedule nodes read; replayed by `graph_call.gather_only`: the same clock words, then its
schedule nodes -- copies into the slots, gathers, waits, swaps -- in graph order) and each
clocked eager read of a stored weight's block (`WeightReads.fetch_block`; replayed as the same
fetch, its bytes dropped). Steps that issue no collective (rank-local mode) replay as
nothing. Weights do not depend on activation shapes, so a replay pairs with a peer's real
forward at other shapes. Conditions:

- Only a steady-state forward may be replayed: one during which the backend compiled
  (`note_compile`) may not, since a first call differs from later ones (it compares plans;
  its parameters are not converted yet).
- Replayed schedule nodes act on the slot state as a real call's would, so a resident
  block gathered once stays gathered once. For the same reason a resident copy (made once
  per runtime, then cached) is not noted as an eager fetch: a replay would gather it again
  where a peer's real forward reads its cache.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional, Protocol, TypeVar

__all__ = ["ForwardLog", "current", "logging_to", "note_compile", "note_step"]


class ForwardLog(Protocol):
    """What the runtime tells about one forward (see [Note: gather-only forwards])."""

    def step(self, replay: Callable[[], None]) -> None:
        """A step issued collectives; ``replay()`` issues the same ones, computing nothing."""

    def compiled(self) -> None:
        """The backend compiled during the forward: it is not steady state."""


_Log = TypeVar("_Log", bound=ForwardLog)
_CURRENT = threading.local()


def current() -> Optional[ForwardLog]:
    """The log of the forward running on this thread, if any."""
    return getattr(_CURRENT, "log", None)


@contextlib.contextmanager
def logging_to(log: _Log) -> Iterator[_Log]:
    """Note to ``log`` the collective steps of the calls this thread makes in the block."""
    outer = current()
    _CURRENT.log = log
    try:
        yield log
    finally:
        _CURRENT.log = outer


def note_step(replay: Callable[[], None]) -> None:
    """A step that issued collectives: noted when a forward is logged."""
    log = current()
    if log is not None:
        log.step(replay)


def note_compile() -> None:
    """The backend compiles a graph: the forward being logged is not steady state (a
    first call fetches nothing eagerly, a compile exchanges plans), so not replayable."""
    log = current()
    if log is not None:
        log.compiled()

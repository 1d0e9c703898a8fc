"""Which runtime owns which parameters: the registry a runtime is found by.

[Note: the model owns its runtime]
A runtime lives exactly as long as the parameters it stores, and is found only from them.
`_OWNERS` maps each parameter (by identity, weakly) to its runtime, and that entry is the
only lasting strong reference to the runtime (graphs hold theirs weakly between calls, the
store keeps parameter ids only). So the runtime, its host store and, with the last runtime
on the device, the slots and the executor's thread go when the model's parameters are
collected, and `torch._dynamo.reset()` has nothing to free. The runtime's options are
given where it is made, and every compile of the model uses them (see [Note: options
belong to a verb] in config.py).

This module sits below the runtime (`runtime.py` registers itself here, and a stored
weight's reads find their runtime here: `stored.py`), so it knows a runtime only as an
`Owner`; every owner is a `runtime.Runtime`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable, Optional, Protocol, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Owner", "claim", "live_runtimes", "owned_by", "owner_of", "register", "reset_runtimes",
           "runtimes_holding", "unclaim", "was_released"]


class Owner(Protocol):
    """A model's runtime (`dlo_fx.runtime.runtime.Runtime`) as the registry sees it."""

    closed: bool
    store: Any  # its `HostStore`
    device: torch.device  # the compute device

    def close(self) -> None: ...

    def eager_block(self, block: int, fqn: str) -> torch.Tensor: ...


_OWNERS = WeakIdKeyDictionary()  # parameter -> its runtime
_RELEASED = WeakIdKeyDictionary()  # parameter -> True: its runtime was closed (released)
_LIVE: "weakref.WeakSet[Owner]" = weakref.WeakSet()
_LOCK = threading.Lock()


def register(runtime: Owner) -> None:
    """A new runtime (counted by `live_runtimes` until it is closed or collected)."""
    _LIVE.add(runtime)


def owner_of(params: Iterable[torch.Tensor]) -> Optional[Owner]:
    """The runtime that stores (or has claimed) the first of ``params`` any runtime holds."""
    for p in params:
        runtime = _OWNERS.get(p)
        if runtime is not None:
            return runtime
    return None


def claim(params: Iterable[torch.Tensor], runtime: Owner) -> None:
    """Make ``runtime`` the owner of ``params`` (those it stores, or will: a model's
    parameters are claimed as a whole when it is offloaded or loaded)."""
    with _LOCK:
        for p in params:
            if _OWNERS.get(p) is None:
                _OWNERS[p] = runtime


def unclaim(runtime: Owner) -> None:
    """Forget ``runtime``'s parameters (it is closing): each is remembered as released
    (`was_released`) until a runtime claims it again."""
    with _LOCK:
        for p in [p for p, rt in _OWNERS.items() if rt is runtime]:
            del _OWNERS[p]
            _RELEASED[p] = True


def was_released(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` belonged to a runtime now closed (`dlo_fx.release`) and
    no runtime holds it since."""
    return any(_OWNERS.get(p) is None and _RELEASED.get(p, False) for p in params)


def owned_by(runtimes: Sequence[Owner]) -> list[torch.Tensor]:
    """Every parameter ``runtimes`` own: one model's, or several models' sharing
    parameters (they share a runtime)."""
    with _LOCK:
        return [p for p, rt in _OWNERS.items() if any(rt is r for r in runtimes)]


def runtimes_holding(params: Sequence[torch.Tensor]) -> list[Owner]:
    """The runtimes that own any of ``params`` (one per model, usually)."""
    found: list[Owner] = []
    for p in params:
        runtime = _OWNERS.get(p)
        if runtime is not None and all(runtime is not r for r in found):
            found.append(runtime)
    return found


def live_runtimes() -> list[Owner]:
    """Every runtime neither closed nor collected (tests and memory checks)."""
    with _LOCK:
        return [rt for rt in _LIVE if not rt.closed]


def reset_runtimes() -> None:
    """Close every live runtime (tests: no host store outlives its test). The models they
    stored keep no weights and are unusable."""
    for rt in live_runtimes():
        rt.close()

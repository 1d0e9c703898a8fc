"""Nothing a test made outlives it: its runtimes and device slots go with the test.

[Note: the frozen heap]
tests/conftest.py freezes (``gc.freeze``) what the imports built, and after each test what
the test left alive: a collection then scans only what the next test creates (torch,
diffusers and transformers are some 400,000 objects; one full collection of them takes
about a second). A frozen object is never collected, even once it is garbage: a cycle that
something still held when its test ended (pytest's ``sys.last_value`` after a failure, a
module's fixture) stays for the session. So

* a lifetime test (a model, its runtime or the device slots must go) calls `collect_all`
  before it asserts: a full collection, the frozen objects included, so no cycle frozen by
  an earlier test keeps what it checks alive, and only a real reference does;
* after every test, once Dynamo is reset and before the runtimes are closed (closing one
  lets go of the parameters it stores, which were all that kept it), `Survivors.after`
  lists the runtimes and device slots the test made that are still alive once its garbage
  is collected (a full collection only then), naming what holds each (for a runtime, what
  holds a parameter it stores), and conftest fails the test with it.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from typing import Any

from dlo_fx.runtime.device import shared_slots
from dlo_fx.runtime.weights import owners
from dlo_fx.runtime.runtime import Runtime


def collect_all() -> None:
    """Collect every object, the frozen ones too (conftest freezes again after the test)."""
    gc.unfreeze()
    gc.collect()


def _slots() -> list:
    return list(shared_slots._SHARED.values())


class Survivors:
    """The runtimes (closed or not) and device slots alive when it is made; `after` lists
    the ones made since that are still alive. Weakly held: it keeps nothing alive."""

    def __init__(self) -> None:
        self._runtimes = weakref.WeakSet(list(owners._LIVE))
        self._slots = weakref.WeakSet(_slots())
        self._failure = getattr(sys, "last_value", None)

    def failed(self) -> bool:
        """Whether the test raised: pytest keeps its traceback (``sys.last_value``), and the
        frames in it hold what the test made."""
        return getattr(sys, "last_value", None) is not self._failure

    def new(self) -> list:
        return ([rt for rt in list(owners._LIVE) if rt not in self._runtimes]
                + [s for s in _slots() if s not in self._slots])

    def after(self) -> str:
        """What the test made that outlives its garbage, with what holds it; "" for
        nothing. Collects the test's garbage first, and everything only if needed."""
        gc.collect()  # what the test made: nothing of it is frozen yet
        if not self.new():
            return ""
        collect_all()  # a cycle through an object frozen before may hold it
        left = self.new()
        if not left:
            return ""
        lines = [_why(obj, {id(left)}) for obj in left]
        del left
        return "what this test made outlives it:\n  " + "\n  ".join(lines)


def _why(obj: Any, ignore: set[int]) -> str:
    """``obj`` and a chain of what holds it. A runtime lives as long as a parameter it
    stores (`owners._OWNERS` maps them to it): the chain is then that parameter's."""
    what = f"{type(obj).__name__} at {id(obj):#x}"
    params = owners.owned_by([obj]) if isinstance(obj, Runtime) else []
    if params:
        param = params[0]
        del params
        return (f"{what}, kept by a parameter it stores, of shape {tuple(param.shape)}, "
                f"held by: {_held_by(param, ignore)}")
    return f"{what}, held by: {_held_by(obj, ignore)}"


def _held_by(obj: Any, ignore: set[int], depth: int = 12) -> str:
    """A chain of referrers from ``obj`` up to a module, a class or a frame (or ``depth``
    steps): ``Runtime <- Graph.runtime <- dict['g'] <- module foo``."""
    chain: list[str] = []
    skip = set(ignore) | {id(obj), id(chain)}
    frame = sys._getframe()
    while frame is not None:  # this check's frames and its callers' hold nothing
        skip.add(id(frame))
        frame = frame.f_back
    target = obj
    for _ in range(depth):
        referrers = [r for r in gc.get_referrers(target) if id(r) not in skip]
        skip.add(id(referrers))
        if not referrers:
            chain.append("nothing the collector sees (a C extension's reference?)")
            break
        holder, what = _owner(referrers[0], target, skip)
        more = f" (and {len(referrers) - 1} more)" if len(referrers) > 1 else ""
        chain.append(what + more)
        if isinstance(holder, (types.ModuleType, type, types.FrameType)):
            break
        target = holder
    return " <- ".join(chain)


def _owner(holder: Any, target: Any, skip: set[int]) -> tuple[Any, str]:
    """``holder``, or the object whose ``__dict__`` it is, and how it holds ``target``."""
    skip.add(id(holder))
    if isinstance(holder, dict):
        keys = [k for k, v in holder.items() if v is target]
        key = keys[0] if keys else None
        objects = [r for r in gc.get_referrers(holder) if getattr(r, "__dict__", None) is holder]
        if objects and isinstance(key, str):
            obj = objects[0]
            skip.add(id(obj))
            if isinstance(obj, types.ModuleType):
                return obj, f"module {obj.__name__}.{key}"
            return obj, f"{type(obj).__qualname__}.{key}"
        return holder, f"dict[{key!r}]" if keys else "dict (a key)"
    if isinstance(holder, types.FrameType):
        code = holder.f_code
        return holder, f"frame {code.co_name} ({code.co_filename}:{holder.f_lineno})"
    if isinstance(holder, types.CellType):
        return holder, "closure cell"
    if isinstance(holder, types.FunctionType):
        return holder, f"function {holder.__qualname__}"
    if isinstance(holder, (list, tuple, set, frozenset)):
        return holder, f"{type(holder).__name__} of {len(holder)}"
    return holder, type(holder).__qualname__

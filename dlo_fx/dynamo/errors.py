"""`CompileOptionsError`: options a compile call gave that the backend refuses;
`DeviceMemoryError`: a call under the auto device budget ran out of device memory;
`surfaced`: dlo's own errors raised while Dynamo compiles, as Dynamo re-raises them.

[Note: dlo's errors past Dynamo]
Dynamo wraps what a backend raises in ``BackendCompilerFailed``, whose message starts
``backend='dlo_backend' raised:`` after a screen of Dynamo frames and ends asking for a bug
report to PyTorch; ``except ValueError`` misses it. What dlo refuses while a graph compiles
(a ``device_budget`` below the graph's minimum, a ``storage_dtype`` met too late, a
checkpoint's problem, a graph that needs grad) is the user's input, not a compiler failure.
Dynamo re-raises one kind of exception as it is: its ``ShortenTraceback``
(`torch_private.unwrapped_error_base`; torch offers no public way). So the backend raises
each error of dlo's own (`is_dlo_error`: a ``ValueError``, ``TypeError`` or
``NotImplementedError`` raised by dlo's code, or any error of a class dlo defines) as
`surfaced` makes it: an instance of a subclass of its own class and of
``ShortenTraceback``, with its message, notes and traceback, named and printed as its own
class and pickled as one, so ``except ValueError`` (or ``except CheckpointError``) catches it
and its message comes first. Errors raised by torch, or by the user's passes, stay wrapped:
they are a compiler's failures. `CompileOptionsError` is such a class from the start.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from ..torch_private import unwrapped_error_base

_Unwrapped = unwrapped_error_base()

USER_ERRORS = (ValueError, TypeError, NotImplementedError)
"""The classes dlo raises for the user's input and known gaps (the style's rule)."""


class _PastDynamo:
    """What an error Dynamo re-raises needs: its traceback kept as raised, and its
    arguments kept as they are (Dynamo appends "from user code" and its bug-report footer
    to ``args[0]`` of every error passing through it: the message is dlo's alone)."""

    first_useful_frame = None  # ShortenTraceback: keep the traceback as raised

    @property
    def args(self) -> tuple:
        return BaseException.args.__get__(self)  # type: ignore[attr-defined]

    @args.setter
    def args(self, value: tuple) -> None:
        if "_dlo_sealed" not in vars(self):
            BaseException.args.__set__(self, value)  # type: ignore[attr-defined]


class CompileOptionsError(_PastDynamo, ValueError, _Unwrapped):  # type: ignore[misc, valid-type]
    """A ``torch.compile(..., backend="dlo")`` option refused at the first call: an
    unknown key or bad value, options that differ from the model's runtime's, an
    unsupported ``mode=``."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self._dlo_sealed = True


class DeviceMemoryError(torch.OutOfMemoryError):
    """A call of a model that keeps blocks resident on the device ran out of device memory.

    Raised from the ``torch.OutOfMemoryError`` the call raised (its ``__cause__``). Under
    ``device_budget="auto"`` planned per call, after dlo moved the graph's resident blocks
    back to streaming (several ranks gathering: at the next call, on every rank):
    ``moved_blocks`` (their positions among the graph's blocks, with their first..last
    FQNs in the message) and ``moved_bytes``; calling again runs the smaller plan and
    returns the exact output. Under a plan made once at the compile (an explicit
    ``device_budget``) nothing moves (``moved_blocks`` is empty) and the message says how
    to compile with less resident.
    Either way the slots, the host store and the model are intact, and nothing is retried.
    See [Note: the auto device budget] in dlo_fx/planning/device_memory.py."""

    def __init__(self, message: str, moved_blocks: Sequence[int] = (),
                 moved_bytes: int = 0) -> None:
        super().__init__(message)
        self.moved_blocks = list(moved_blocks)
        self.moved_bytes = int(moved_bytes)


def is_dlo_error(exc: BaseException) -> bool:
    """Whether ``exc`` is one of dlo's own errors: of a class dlo defines, or one of
    `USER_ERRORS` raised in dlo's code (the innermost frame of its traceback)."""
    if type(exc).__module__.startswith("dlo_fx."):
        return True
    if not isinstance(exc, USER_ERRORS):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return module == "dlo_fx" or module.startswith("dlo_fx.")


def surfaced(exc: BaseException) -> Optional[BaseException]:
    """``exc`` as the backend raises it past Dynamo (see [Note: dlo's errors past
    Dynamo]): a dlo error as an instance of `_unwrapped_class` of its class, with its
    arguments, attributes (its notes among them) and traceback; None for any other error
    and for one Dynamo passes through already."""
    if isinstance(exc, _Unwrapped) or _Unwrapped is Exception or not is_dlo_error(exc):
        return None
    cls = _unwrapped_class(type(exc))
    own = cls.__new__(cls, *exc.args)
    own.args = exc.args
    vars(own).update(vars(exc))
    own._dlo_state = dict(vars(exc))  # what pickles: not what Dynamo adds on the way
    own._dlo_sealed = True
    return own.with_traceback(exc.__traceback__)


@functools.lru_cache(maxsize=None)
def _unwrapped_class(cls: type) -> type:
    """A subclass of ``cls`` and of Dynamo's ``ShortenTraceback`` that prints, names and
    pickles as ``cls`` (a traceback shows ``ValueError: ...``)."""
    def reduce(self: BaseException) -> tuple:
        return _rebuilt, (cls, self.args, vars(self).get("_dlo_state", {}))

    return type(cls.__name__, (_PastDynamo, cls, _Unwrapped), {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__reduce__": reduce})


def _rebuilt(cls: type, args: tuple, state: dict) -> BaseException:
    """An error of ``cls`` from its arguments and attributes (unpickling a `surfaced` one)."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    vars(exc).update(state)
    return exc

"""The error a compile or a call raised, out of Dynamo's wrapper.

Dynamo wraps what a backend raises while it compiles in ``BackendCompilerFailed`` (the
error is its ``inner_exception``; Dynamo raises it ``from None``); dlo's own errors (see
[Note: dlo's errors past Dynamo] in dlo_fx/dynamo/errors.py) and what a compiled graph
raises as it runs come through as they are. Tests and spawned
cases read the original error, with its notes (a failing pass adds one naming itself).
"""

from __future__ import annotations

from torch._dynamo.exc import BackendCompilerFailed

__all__ = ["BackendCompilerFailed", "described", "error_text", "original"]


def original(exc: BaseException) -> BaseException:
    """``exc``, or the error inside it where it is Dynamo's ``BackendCompilerFailed``."""
    while isinstance(exc, BackendCompilerFailed):
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None or inner is exc:
            break
        exc = inner
    return exc


def described(exc: BaseException) -> tuple[str, str]:
    """(type name, message) of the original error; its notes follow the message, a line
    each, as a traceback prints them."""
    err = original(exc)
    return type(err).__name__, "\n".join([str(err), *getattr(err, "__notes__", ())])


def error_text(exc: BaseException) -> str:
    """``"TypeName: message"`` of the original error (`described`)."""
    name, message = described(exc)
    return f"{name}: {message}"

"""`CompileOptionsError`: options a compile call gave that the backend refuses;
`DeviceMemoryError`: a call under the auto device budget ran out of device memory.

Dynamo wraps what a backend raises in ``BackendCompilerFailed``, whose message starts
``backend='dlo_backend' raised:`` after a screen of Dynamo frames. A refused option is the
user's input, not a compiler failure: `CompileOptionsError` is a ``ValueError`` that is
also Dynamo's ``ShortenTraceback`` (`torch_private.unwrapped_error_base`), which Dynamo
re-raises unwrapped, so ``except ValueError`` catches it and its message comes first.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..torch_private import unwrapped_error_base

_Unwrapped = unwrapped_error_base()


class CompileOptionsError(ValueError, _Unwrapped):  # type: ignore[misc, valid-type]
    """A ``torch.compile(..., backend="dlo")`` option refused at the first call: an
    unknown key or bad value, options that differ from the model's runtime's, an
    unsupported ``mode=``."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.first_useful_frame = None  # ShortenTraceback: keep the traceback as raised


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

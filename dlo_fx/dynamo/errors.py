"""`CompileOptionsError`: options a compile call gave that the backend refuses.

Dynamo wraps what a backend raises in ``BackendCompilerFailed``, whose message starts
``backend='dlo_backend' raised:`` after a screen of Dynamo frames. A refused option is the
user's input, not a compiler failure: `CompileOptionsError` is a ``ValueError`` that is
also Dynamo's ``ShortenTraceback`` (`torch_private.unwrapped_error_base`), which Dynamo
re-raises unwrapped, so ``except ValueError`` catches it and its message comes first.
"""

from __future__ import annotations

from ..torch_private import unwrapped_error_base

_Unwrapped = unwrapped_error_base()


class CompileOptionsError(ValueError, _Unwrapped):  # type: ignore[misc, valid-type]
    """A ``torch.compile(..., backend="dlo")`` option refused at the first call: an
    unknown key or bad value, options that differ from the model's runtime's, an
    unsupported ``mode=``."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.first_useful_frame = None  # ShortenTraceback: keep the traceback as raised

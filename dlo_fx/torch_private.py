"""The private torch APIs dlo uses outside its Inductor pieces, in one place.

Each is checked against the torch versions the project supports (2.11 to 2.13); a torch
that lacks one fails here with a message naming it, or answers "nothing found" where a
fallback is safe, not somewhere inside a call. Two groups: what the stored-weight
representation needs (`fake_mode_of`, `swap_in_place`), and what the backend reads of the
frame Dynamo is compiling (`compiling_frame_locals`, `traced_modules`, `is_dynamo_code`,
`compiled_module_of`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def fake_mode_of(t: torch.Tensor) -> Optional[Any]:
    """The fake mode ``t`` belongs to (Dynamo is tracing), or None for a real tensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.fake_mode if isinstance(t, FakeTensor) else None


def swap_in_place(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """``torch.utils.swap_tensors(t1, t2)`` without its refusal of weak references.

    Dynamo holds a weak reference to every parameter it traced, for as long as its code
    lives, so the public function refuses every parameter of a compiled model. Here a weak
    reference is wanted to follow the object: the parameter stays the same Python object
    and only its contents change, which is the point. The other checks stay: no C++
    holder of either tensor besides its autograd accumulator."""
    if not callable(getattr(torch._C, "_swap_tensor_impl", None)):
        raise RuntimeError("dlo: this torch has no torch._C._swap_tensor_impl; dlo cannot "
                           "store a parameter in place")
    for t, name in ((t1, "t1"), (t2, "t2")):
        count = t._use_count()
        if count > 2 or (count == 2 and not t.is_leaf):
            raise RuntimeError(
                f"dlo: cannot store a parameter of shape {tuple(t.shape)} in place: other "
                f"tensors hold it ({count} references to its tensor; {name}); drop them (an "
                "autograd graph through it, a tensor built with it as its base) and call again")
    t1.__class__, t2.__class__ = t2.__class__, t1.__class__
    d1, d2 = dict(vars(t1)), dict(vars(t2))
    vars(t1).clear()
    vars(t1).update(d2)
    vars(t2).clear()
    vars(t2).update(d1)
    torch._C._swap_tensor_impl(t1, t2)


# -- the frame Dynamo is compiling (backend.py) ------------------------------------------
def _current_tx() -> Any:
    """Dynamo's instruction translator of the frame being compiled; None outside Dynamo."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    if not callable(getattr(InstructionTranslator, "current_tx", None)):
        raise RuntimeError("dlo: this torch's Dynamo has no InstructionTranslator.current_tx; "
                           "dlo cannot find the module it compiles (to claim and guard it)")
    try:
        return InstructionTranslator.current_tx()
    except AttributeError:  # its thread-local is unset: no frame is being compiled
        return None


def compiling_frame_locals() -> Optional[dict]:
    """The locals of the frame Dynamo is compiling, or None outside a compile."""
    tx = _current_tx()
    return None if tx is None else dict(tx.f_locals)


def compiling_frame_name() -> Optional[str]:
    """The code name of the frame Dynamo is compiling (``forward``, or a resume function
    Dynamo made after a graph break), or None outside a compile."""
    tx = _current_tx()
    return None if tx is None else getattr(getattr(tx, "f_code", None), "co_name", None)


def traced_modules() -> list[tuple[torch.nn.Module, str]]:
    """``(module, source name)`` of every module the frame being compiled traced, from
    Dynamo's tracker cache (``G['model']``, ``L['pipe'].transformer``); empty on a torch
    without it."""
    try:
        from torch._dynamo.variables.nn_module import (NNModuleVariable,
                                                       UnspecializedNNModuleVariable)

        trackers = list(_current_tx().output.variable_tracker_cache.items())
    except (ImportError, AttributeError, RuntimeError):  # another torch: nothing found
        return []
    found = []
    for source, vt in trackers:
        module = getattr(vt, "value", None) if isinstance(
            vt, (NNModuleVariable, UnspecializedNNModuleVariable)) else None
        name = getattr(source, "name", None)
        if isinstance(module, torch.nn.Module) and isinstance(name, str):
            found.append((module, name))
    return found


def is_dynamo_code(code: Any) -> bool:
    """Whether ``code`` is a code object Dynamo made for a frame it compiled."""
    from torch._dynamo.utils import orig_code_map

    return code in orig_code_map


def compiled_module_of(value: Any) -> Optional[torch.nn.Module]:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) wraps, else None."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(value, OptimizedModule) and isinstance(value._orig_mod, torch.nn.Module):
        return value._orig_mod
    return None


# -- errors raised past Dynamo (compile_errors.py) ---------------------------------------
def unwrapped_error_base() -> type:
    """Dynamo's ``ShortenTraceback``: what a backend raises of that class reaches the
    caller as raised, where any other exception becomes ``BackendCompilerFailed`` (first
    line ``backend='dlo_backend' raised:``). ``Exception`` on a torch without it (the error
    is then wrapped, but still raised)."""
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:
        return Exception
    return ShortenTraceback


# -- compile time (engine/progress.py) -----------------------------------------------------
def on_compile(start: Any, end: Any) -> bool:
    """Call ``start()`` when Dynamo begins compiling (no compile under way) and ``end()``
    when it is done (Dynamo's ``callback_handler``); False on a torch without it."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return False
    callback_handler.register_start_callback(lambda _args: start())
    callback_handler.register_end_callback(lambda _args: end())
    return True


# -- profiler spans (ops.py) ------------------------------------------------------------
def profiler_enabled() -> bool:
    """Whether a torch profiler records now (``torch.autograd.profiler``'s own flag, set
    by ``torch.profiler.profile`` on entry): a schedule op opens a ``record_function`` span
    only then, so a call pays one attribute read per op otherwise."""
    return torch.autograd.profiler._is_profiler_enabled

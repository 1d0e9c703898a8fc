"""The private torch APIs the stored-weight representation needs, in one place.

Each is checked against the torch versions the project supports (2.11 to 2.13); a torch
that lacks one fails here with a message naming it, not somewhere inside a call.
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

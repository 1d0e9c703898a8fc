"""A correction to Dynamo's ``x in sequence`` when an element is a symbolic int.

[Note: `x in list` with a symbolic element]
Dynamo (torch 2.13) evaluates ``const in [a, b, ...]`` at trace time by comparing the
constant with the elements that are Python constants only, and installs no guard. An
element Dynamo made dynamic (automatic dynamic: an int argument that changed between
calls becomes a SymInt) is skipped, so ``0 in [s0, 2]`` is False whatever ``s0`` is, and
the compiled code takes the wrong branch with no error. diffusers'
``SD3Transformer2DModel(..., skip_layers=[...])`` (skip-layer guidance) is one such model:
after ``skip_layers=[1]`` and then ``[0, 2]``, block 0 ran when it should have been
skipped; with ``backend="eager"`` as with ``backend="dlo"``, the output differed from the
resident model's. (Upstream: "Fix Dynamo ordered contains semantics", pytorch#184765.)

`install` wraps Dynamo's ``iter_contains`` where it is bound (``torch._dynamo.utils``,
and ``torch._dynamo.variables.lists``, which imported it by name): when the searched value
is a constant and an element is symbolic, every element is compared through Dynamo's own
``==`` and ``or``, as for a symbolic searched value, so the branch taken is guarded on
(``Eq(s0, 0)``) and a later call with other values recompiles. Every other case goes to
Dynamo's function unchanged. It is installed when ``dlo_fx.dynamo.backend`` is imported (which
``torch.compile(backend="dlo")`` does before it traces), so it applies to the process's
other compiles too: it only makes their answer the one Python gives. Where Dynamo's
function is not there in that form, nothing is installed.
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Callable

__all__ = ["install"]

_PARAMETERS = ["items", "search", "tx", "check_tensor_identity"]


def _fixed(original: Callable) -> Callable:
    from torch._dynamo.variables.builder import SourcelessBuilder
    from torch._dynamo.variables.tensor import SymNodeVariable

    @functools.wraps(original)
    def iter_contains(items: Any, search: Any, tx: Any, check_tensor_identity: bool = False) -> Any:
        items = list(items)
        if not (search.is_python_constant() and any(
                not x.is_python_constant() and isinstance(x.realize(), SymNodeVariable)
                for x in items)):
            return original(items, search, tx, check_tensor_identity)
        eq = SourcelessBuilder.create(tx, operator.eq)
        or_ = SourcelessBuilder.create(tx, operator.or_)
        found = None
        for x in items:
            check = eq.call_function(tx, [x, search], {})
            found = check if found is None else or_.call_function(tx, [check, found], {})
        return found

    iter_contains.__dlo_fixed__ = True
    return iter_contains


def install() -> bool:
    """Wrap Dynamo's ``iter_contains`` (once); False where it is not there as expected."""
    import torch._dynamo.utils as utils
    import torch._dynamo.variables.lists as lists

    original = getattr(utils, "iter_contains", None)
    if original is None or getattr(original, "__dlo_fixed__", False):
        return original is not None
    if list(inspect.signature(original).parameters) != _PARAMETERS or \
            getattr(lists, "iter_contains", None) is not original:
        return False
    try:
        fixed = _fixed(original)
    except (ImportError, AttributeError):  # another torch: its classes moved
        return False
    utils.iter_contains = fixed
    lists.iter_contains = fixed
    return True

"""`ModuleState`: what dlo knows about one module, in one object reachable from it.

One object per module (FSDP2 keeps its per-module state the same way), not one weak map
per fact: the guards `guard_module` installed on it and its inputs' device check (guard.py)
and the CFG split `cfg_parallel` installed (cfg_parallel.py). Held in one weak map, so a module
dlo touched is collected as any other, and forgotten with its state.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from torch import nn

__all__ = ["ModuleState", "guarded_modules", "peek", "state_of"]


@dataclass(eq=False)
class ModuleState:
    """dlo's facts about one module."""

    guards: Optional[list] = None
    """The hook handles `guard_module` installed on it; None while it is not guarded."""
    state_hooked: bool = False
    """Its ``state_dict`` post-hook (`guard._real_weights`) is among ``guards``."""
    input_check: Any = None
    """The handle of its inputs' device check (`input_device.check_input_devices`), on the
    root module a model was attached as; None elsewhere."""
    cfg_parallel: Any = None
    """The `CFGParallel` `cfg_parallel` installed on it (its hooks), or None."""


_STATES: "weakref.WeakKeyDictionary[nn.Module, ModuleState]" = weakref.WeakKeyDictionary()


def state_of(module: nn.Module) -> ModuleState:
    """``module``'s state, made empty the first time it is asked for."""
    state = _STATES.get(module)
    if state is None:
        state = _STATES[module] = ModuleState()
    return state


def peek(module: nn.Module) -> Optional[ModuleState]:
    """``module``'s state when dlo has any (never makes one)."""
    return _STATES.get(module)


def guarded_modules() -> Iterator[nn.Module]:
    """Every live module `guard_module` guards now."""
    return (m for m, s in list(_STATES.items()) if s.guards is not None)

"""`ModuleState`: what dlo knows about one module, in one object reachable from it; and
`state`, the one public call that says what dlo holds of a module (`dlo_fx.state`).

One object per module (FSDP2 keeps its per-module state the same way), not one weak map
per fact: the guards `guard_module` installed on it and its inputs' device check (guard.py)
and the CFG split `cfg_parallel` installed (cfg_parallel.py). Held in one weak map, so a module
dlo touched is collected as any other, and forgotten with its state.

[Note: one state, one call]
Whether a module is dlo's, and with what, is asked in one way: ``dlo_fx.state(module)``, a
frozen `DLOState` (None for a module dlo holds nothing of and never held). Its facts are
read where the one attach sequence wrote them ([Note: one attach sequence] in
loading/attach.py): the runtime that owns the module's parameters (owners.py: its options,
compute device, mode, host blocks), the module's `ModuleState` (its guards), each
parameter's `StorageChoice` (host/layout.py: the dtype it is stored in), and whether its
parameters were given back (`release`). A copy, never a handle: changing it changes
nothing, and it holds no runtime alive.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from ..config import DLOConfig
from ..runtime import runtimes_holding, storage_dtype_of, stored_tensor, was_released

__all__ = ["ABSENT", "DLOState", "ModuleState", "guarded_modules", "peek", "state", "state_of"]


@dataclass(eq=False)
class ModuleState:
    """dlo's facts about one module."""

    guards: Optional[list] = None
    """The hook handles `guard_module` installed on it; None while it is not guarded."""
    shadowed: Optional[dict] = None
    """The instance attributes `guard_module` set over its class's methods: name -> what
    the instance held under that name before (`ABSENT`: nothing), put back when it is
    unguarded."""
    state_hooked: bool = False
    """Its ``state_dict`` post-hook (`guard._real_weights`) is among ``guards``."""
    input_check: Any = None
    """The handle of its inputs' device check (`input_device.check_input_devices`), on the
    root module a model was attached as; None elsewhere."""
    cfg_parallel: Any = None
    """The `CFGParallel` `cfg_parallel` installed on it (its hooks), or None."""


ABSENT = object()
"""`ModuleState.shadowed`'s word for "the instance held nothing under that name"."""

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


@dataclass(frozen=True)
class DLOState:
    """What dlo holds of one module (`dlo_fx.state`): see [Note: one state, one call]."""

    released: bool
    """dlo gave its weights back (`dlo_fx.release`): the fields below are then empty."""
    config: Optional[DLOConfig] = None
    """The options of the runtime that owns its parameters."""
    device: Optional[torch.device] = None
    """Its compute device."""
    mode: Optional[str] = None
    """``"rank_local"`` or ``"allgather"`` (``"auto"`` until the first store settles it)."""
    blocks: int = 0
    """The host blocks its runtime stores (of every module sharing that runtime)."""
    stored: int = 0
    """How many of its own parameters have their weights in the host store."""
    guarded: bool = False
    """It (or a submodule) refuses what would change its stored weights (guard.py)."""
    storage_dtypes: Mapping[str, torch.dtype] = field(default_factory=lambda: MappingProxyType({}))
    """Its parameters stored in another dtype than their own (``storage_dtype``, or
    diffusers' layerwise casting taken over), by name: that dtype."""

    def __repr__(self) -> str:  # the storage dtypes counted, not listed (a model has hundreds)
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.name != "storage_dtypes"]
        counts: dict[str, int] = {}
        for dtype in self.storage_dtypes.values():
            name = str(dtype).removeprefix("torch.")
            counts[name] = counts.get(name, 0) + 1
        shown.append("storage_dtypes=<" + (", ".join(f"{n} parameters as {d}"
                                                     for d, n in counts.items()) or "none") + ">")
        return f"DLOState({', '.join(shown)})"


def state(module: nn.Module) -> Optional[DLOState]:
    """What dlo holds of ``module`` (offloaded, loaded, or a component `compile_pipeline`
    streams; also any of its submodules), or None where dlo holds nothing of it and never
    did. See [Note: one state, one call]."""
    if not isinstance(module, nn.Module):
        components = getattr(module, "components", None)
        hint = (f"; for a pipeline, ask of each component, e.g. dlo_fx.state(pipe."
                f"{next(iter(components))})" if isinstance(components, dict) and components
                else "")
        raise TypeError(f"dlo_fx.state takes a torch module (nn.Module), not a "
                        f"{type(module).__name__}{hint}")
    params = list(dict.fromkeys(stored_tensor(p) for p in module.parameters()))
    live = [rt for rt in runtimes_holding(params) if not rt.closed]
    if not live:
        return DLOState(released=True) if was_released(params) else None
    runtime = live[0]
    other = {name: dtype for name, p in module.named_parameters()
             if (dtype := storage_dtype_of(p)) is not None}
    return DLOState(storage_dtypes=MappingProxyType(other), released=False, config=runtime.config, device=runtime.device,
                    mode=runtime.mode, blocks=len(runtime.store.blocks),
                    stored=sum(p in runtime.store for p in params),
                    guarded=any(s is not None and s.guards is not None
                                for s in map(peek, module.modules())))

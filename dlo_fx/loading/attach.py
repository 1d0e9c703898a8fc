"""The one sequence that makes a module dlo's: `dlo_fx.offload` and `dlo_fx.load` both end
in `attach_model`.

[Note: one attach sequence]
A module becomes dlo's in one order, whichever verb plans it: the runtime is made; the
verb plans (`Planned`: a model in memory split into blocks, or a checkpoint's load plan);
every rank of the shard group agrees on the plan, or all raise its error together
(`agree_on_plan`), before anything is stored; the mode is settled from the planned blocks
(`settle_mode`); the model is put in eval mode without grads; the verb's ``store`` stores
the blocks through `Runtime.store_blocks` and puts the converted parameters in place;
the runtime records, once, one frozen `Attachment` (why each host block ends, where the
model's parameters were and how to move its other members back: `offload` only, `release`
undoes it) and the parameters kept resident by name (`Runtime.attached`); last, `attach` claims every parameter and guards the modules. Nothing
else writes these facts: a new verb plans and stores, and hands the rest to this
sequence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..config import DLOConfig
from ..model.guard import attach
from ..runtime import Attachment, Runtime
from .plan import agree_on_plan, settle_mode

log = logging.getLogger(__name__)

__all__ = ["Planned", "attach_model"]


@dataclass
class Planned:
    """What a verb planned, before anything is stored (see [Note: one attach sequence])."""

    model: nn.Module
    rows: list
    """One row per block, which every rank must plan alike (`agree_on_plan`)."""
    blocks: Sequence[Sequence[Any]]
    """The planned blocks' targets, which size the mode choice (`settle_mode`)."""
    ends: Sequence[str]
    """Why each block ends where it does, in block order."""
    store: Callable[[], tuple[Sequence[int], Sequence[torch.Tensor]]]
    """Stores the blocks and puts the converted parameters in place; returns the host
    blocks' indices and the parameters kept resident by name."""
    resident: int
    """How many parameters stay on the device (the verb's log line)."""
    source: str = ""
    """Where the weights come from, for the log line (a checkpoint's ``" from ..."``)."""
    home: Optional[torch.device] = None
    """Where the model's parameters were (`release` puts them back there); None: where
    each is."""
    moves: Optional[Callable[[], Callable[[], None]]] = None
    """Puts the moved members in place and returns their undo (`offload.Moves.apply`)."""


def attach_model(config: DLOConfig, device: torch.device, verb: str,
                 plan: Callable[[Runtime], Planned]) -> tuple[Runtime, Planned]:
    """Make a runtime of ``config`` on ``device``, plan with ``plan`` (which may raise:
    every rank raises with it) and make the planned model dlo's: see [Note: one attach
    sequence]. Returns the runtime and what was planned."""
    start = time.perf_counter()
    runtime = Runtime(config, device)
    planned: Optional[Planned] = None
    error: Optional[BaseException] = None
    try:
        planned = plan(runtime)
    except BaseException as exc:  # every rank raises with it, none waits for it
        error = exc
    agree_on_plan(runtime, planned.rows if planned is not None else None, error, verb)
    if planned is None:  # agree_on_plan re-raises every planning error
        raise RuntimeError(f"{verb}: internal error: no plan and no error")
    settle_mode(runtime, planned.blocks)  # into runtime.store, which the mode decides
    planned.model.eval().requires_grad_(False)
    indices, named = planned.store()
    runtime.attached(Attachment(home=planned.home,
                                block_ends=MappingProxyType(dict(zip(indices, planned.ends))),
                                undo_moves=planned.moves() if planned.moves is not None else None),
                     named)
    attach(runtime, [planned.model])  # the resident parameters too: compiling finds it
    log.info("%s: %s%s: %d blocks (%d bytes of host shards on this rank), %d resident "
             "parameters, on %s, in %.2f s", verb, type(planned.model).__name__,
             planned.source, len(indices), sum(runtime.store.blocks[i].shard.numel()
                                               for i in indices),
             planned.resident, device, time.perf_counter() - start)
    return runtime, planned

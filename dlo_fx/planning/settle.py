"""The mode and the device budget a runtime plans with: the one place that settles both, for
the loader, `offload` and the compiler alike.

Decisions only, on a `StoreView` (what the runtime holds, frozen) and figures measured by
the caller: `settle_mode` (``mode="auto"``, still open: both modes simulated on the
blocks, `dlo_fx.planning.modes.choose_mode`) and `settle_budget` (the ``device_budget``
option as the compile plans it). The caller measures (`dlo_fx.runtime.probes`) and applies
the choice (`Runtime.set_mode`): `dlo_fx.loading.plan.settle_mode` before a load or an
offload stores anything (a compile only reads the mode), `dlo_fx.dynamo.probes` the budget
around a compile's planning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from ..config import DLOConfig
from .view import StoreView
from .budget import BudgetPlan
from .modes import choose_mode

log = logging.getLogger(__name__)

__all__ = ["Budget", "settle_budget", "settle_mode"]


def settle_mode(view: StoreView, block_bytes: Sequence[int],
                measure: Callable[[], Mapping[str, float]]) -> Optional[tuple[str, str]]:
    """``(mode, reason)`` for a runtime whose mode is open (``mode="auto"``): both modes
    simulated on ``block_bytes`` with the figures ``measure()`` returns (a collective probe
    on the shard group, run on every rank); None where the mode is settled already."""
    if view.mode is not None:
        return None
    return choose_mode(list(block_bytes), view.dp, view.num_slots, measure)


@dataclass(frozen=True)
class Budget:
    """How a compile plans the device budget."""

    device_budget: Optional[int] = None
    """Bytes planned once, at the compile (an explicit ``device_budget``)."""
    auto_capacity: Optional[int] = None
    """The device's capacity for the auto budget planned from measured memory at each call
    (`dlo_fx.dynamo.auto_budget`); the compile then plans every block streamed."""
    forced: Optional[BudgetPlan] = None
    """The auto budget's re-plan of a graph planned before: these blocks resident
    (`dlo_fx.dynamo.auto_budget`, a variant per resident set)."""


def settle_budget(config: DLOConfig, view: Optional[StoreView]) -> Budget:
    """The device budget ``config`` asks for, on the runtime ``view`` shows (None: no
    runtime). Both fields None: every block streams (no budget; ``"auto"`` without a
    runtime, or on the CPU or the meta device without ``device_memory``). ``"auto"``
    without ``device_memory`` reads ``view.free_bytes`` (the view measured it)."""
    if config.device_budget != "auto":
        return Budget(device_budget=config.device_budget)
    if view is None:
        return Budget()
    capacity = config.device_memory
    if capacity is None:
        if view.free_bytes is None:
            log.info("dlo: device_budget='auto' on %s without device_memory: every block "
                     "streams", view.device.type)
            return Budget()
        # The slots and the blocks the auto budget keeps resident (of every model on the
        # device) are the weights' own: part of the budget, which leaves the others out.
        capacity = view.free_bytes + view.slot_bytes + view.auto_resident_bytes
    return Budget(auto_capacity=capacity)


def gathers(config: DLOConfig, view: StoreView) -> bool:
    """Whether several ranks gather the blocks (allgather mode, or a mode still open that
    would be allgather by default)."""
    return view.dp > 1 and (view.mode or config.mode or "allgather") != "rank_local"

"""`StoreView`: what planning may know of a runtime, frozen at the moment it plans.

Planning (`dlo_fx.planning`, its graph stages included) never holds a `Runtime`: the
backend and the loader build a `StoreView` of the parameters they plan
(`dlo_fx.runtime.store_view`) and hand it over. This module holds the type, the reasons a
runtime keeps a parameter resident and the attribute a fake stored weight's stand-in
lives in: what planning reads of the runtime, declared where planning is. Planning imports
nothing of `dlo_fx.runtime`; the runtime imports this module to build the view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from .budget import BudgetPlan

#: Why a runtime keeps a parameter resident in every later graph (`ParamFacts.kept`; the
#: first is the reason `dlo_fx.planning.residency` reports).
READ_DIRECTLY = "read directly by an earlier graph"
NAMED_RESIDENT = "named in resident="
KEPT_RESIDENT = (READ_DIRECTLY, NAMED_RESIDENT)


@dataclass(frozen=True)
class ParamFacts:
    """One parameter as the runtime holds it."""

    nbytes: int
    """Bytes of its storage span as stored (in ``stored_as`` where that is set)."""
    stored_as: Optional[torch.dtype] = None
    """The dtype its bytes are stored in where it differs from its own, else None."""
    fqn: Optional[str] = None
    """The FQN it is stored under; None: not in the host store."""
    block: Optional[int] = None
    """The host block holding it; None: not in the host store."""
    kept: Optional[str] = None
    """Why every graph keeps it resident (one of `KEPT_RESIDENT`), or None."""
    unstreamable: Optional[str] = None
    """Why dlo cannot lay out its bytes, to follow ``parameter '<fqn>'``; None: it can."""


@dataclass(frozen=True)
class StoreView:
    """The runtime's facts a plan needs: where the graph's parameters are stored and why some
    are kept resident, the mode and the shard group's size, the slots, the probed rates,
    and the budget plans made before. A copy: nothing here changes with the runtime."""

    device: torch.device
    mode: Optional[str]  # None: ``mode="auto"``, not settled yet
    dp: int  # ranks in the shard group
    num_slots: int
    params: Mapping[int, ParamFacts]  # by ``id`` of each planned parameter
    slot_bytes: int = 0  # the device's slots
    auto_resident_bytes: int = 0  # blocks the auto budget keeps resident on the device
    bandwidths: Optional[tuple[float, float]] = None  # probed (H2D, AllGather) GB/s
    flops: Mapping[torch.dtype, float] = field(default_factory=dict)  # probed matmul FLOP/s
    budget_plans: Mapping[tuple[str, ...], BudgetPlan] = field(default_factory=dict)  # earlier graphs'
    free_bytes: Optional[int] = None  # free device memory (measured where asked), or None
    block_ends: Mapping[int, str] = field(default_factory=dict)  # why each host block ends

    def facts(self, param: torch.Tensor) -> Optional[ParamFacts]:
        return self.params.get(id(param))

    def in_store(self, param: torch.Tensor) -> bool:
        facts = self.facts(param)
        return facts is not None and facts.block is not None


FAKE_STAND_IN = "_dlo_fake_stand_in"
"""The attribute of a fake `StoredWeight` (Dynamo's, while it traces) holding the one fake
tensor every fake op reads in its place (runtime/weights/stored.py): the storage the views
made while tracing share, which planning follows (planning/stages/use_intervals.py)."""


__all__ = ["FAKE_STAND_IN", "KEPT_RESIDENT", "NAMED_RESIDENT", "READ_DIRECTLY", "ParamFacts",
           "StoreView"]

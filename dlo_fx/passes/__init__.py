"""The FX passes of the `dlo` backend, run in one ordered list.

Every pass is ``(gm: GraphModule, ctx: PassContext) -> GraphModule`` and is followed by
``gm.graph.lint()``. Set ``debug_passes`` (or ``DLO_FX_DEBUG_PASSES=1``) to log the graph
before and after each pass on the ``dlo_fx.passes`` logger.

| file | pass |
| --- | --- |
| identify_params.py | placeholder -> parameter and FQN |
| use_intervals.py | first/last use of each parameter, through its aliases |
| resident_set.py | which parameters stay on the device (`dlo_fx.planning.residency`, `device_budget` through `dlo_fx.planning.budget`); the budget |
| partition_blocks.py | blocks in first-use order by footprint (`dlo_fx.planning.blocks`) |
| choose_mode.py | settles mode="auto" from measured bandwidths and the plan |
| insert_schedule.py | prefetch / wait / slot_view / swap_slot nodes, wrap-around prefetch |
"""

from __future__ import annotations

import logging
from typing import Callable

from torch import fx

from .context import GraphBlock, ParamInfo, PassContext
from .choose_mode import choose_mode
from .identify_params import identify_params
from .insert_schedule import insert_schedule
from .partition_blocks import partition_blocks
from .resident_set import resident_set
from .use_intervals import use_intervals

log = logging.getLogger(__name__)

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

PIPELINE: tuple[Pass, ...] = (
    identify_params,
    use_intervals,
    resident_set,
    partition_blocks,
    choose_mode,
    insert_schedule,
)


def run_passes(gm: fx.GraphModule, ctx: PassContext, extra: tuple[Pass, ...] = ()) -> fx.GraphModule:
    """Run the pipeline, then ``extra`` passes (user passes see ``node.meta["dlo"]``)."""
    debug = ctx.config.debug_passes
    for p in (*PIPELINE, *extra):
        name = getattr(p, "__name__", repr(p))
        if debug:
            log.debug("graph before pass %s:\n%s", name, gm.graph)
        try:
            gm = p(gm, ctx)
            gm.graph.lint()
        except Exception as exc:
            if hasattr(exc, "add_note"):
                ran = ", ".join(ctx.ran) or "none"
                exc.add_note(f"in dlo pass {name!r} (passes that ran before it: {ran})")
            raise
        ctx.ran.append(name)
        if debug:
            log.debug("graph after pass %s:\n%s", name, gm.graph)
    gm.recompile()
    return gm


__all__ = ["PIPELINE", "Pass", "PassContext", "ParamInfo", "GraphBlock", "run_passes"]

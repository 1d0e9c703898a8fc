"""Planning a graph, then the one graph transform that writes the plan into it.

`plan_graph` runs the planning stages in order, each ``(gm, ctx: PassContext) -> gm``
followed by ``gm.graph.lint()``, and freezes what they filled into a `GraphPlan`. They
compute only: no collective, no probe (the backend runs those, `dlo_fx.dynamo.probes`),
no graph change. `run_passes` then runs `insert_schedule`, the graph
transform, and the user's passes after it, each ``(gm, plan: GraphPlan) -> gm``. Set
``debug_passes`` (or ``DLO_FX_DEBUG_PASSES=1``) to log the graph before and after every
stage and pass on the ``dlo_fx.passes`` logger.

| file | stage / pass |
| --- | --- |
| identify_params.py | placeholder -> parameter and FQN |
| use_intervals.py | first/last use of each parameter, through its aliases |
| resident_set.py | which parameters stay on the device (`dlo_fx.planning.residency`, `device_budget` through `dlo_fx.planning.budget`); the budget |
| partition_blocks.py | blocks in first-use order by footprint (`dlo_fx.planning.blocks`) |
| insert_schedule.py | the transform: prefetch / wait / slot_view / swap_slot nodes, wrap-around prefetch; records the schedule the runtime replays |
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from torch import fx

from .context import GraphBlock, GraphPlan, ParamInfo, PassContext
from .identify_params import identify_params
from .insert_schedule import insert_schedule, schedule_of
from .partition_blocks import partition_blocks
from .resident_set import resident_set
from .use_intervals import use_intervals

log = logging.getLogger(__name__)

Stage = Callable[[fx.GraphModule, PassContext], fx.GraphModule]
Pass = Callable[[fx.GraphModule, GraphPlan], fx.GraphModule]

PLANNING: tuple[Stage, ...] = (identify_params, use_intervals, resident_set, partition_blocks)
PIPELINE: tuple[Pass, ...] = (insert_schedule,)


def _run(steps: Sequence[Callable], gm: fx.GraphModule, arg, debug: bool,
         ran: list[str]) -> fx.GraphModule:
    for p in steps:
        name = getattr(p, "__name__", repr(p))
        if debug:
            log.debug("graph before pass %s:\n%s", name, gm.graph)
        try:
            gm = p(gm, arg)
            gm.graph.lint()
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"in dlo pass {name!r} (passes that ran before it: "
                             f"{', '.join(ran) or 'none'})")
            raise
        ran.append(name)
        if debug:
            log.debug("graph after pass %s:\n%s", name, gm.graph)
    return gm


def plan_graph(gm: fx.GraphModule, ctx: PassContext) -> GraphPlan:
    """Run the planning stages on ``ctx`` (a fresh `PassContext`) and freeze the plan."""
    _run(PLANNING, gm, ctx, ctx.config.debug_passes, ctx.ran)
    return GraphPlan.freeze(ctx)


def run_passes(gm: fx.GraphModule, plan: GraphPlan, extra: tuple[Pass, ...] = ()) -> fx.GraphModule:
    """Write ``plan`` into ``gm`` (`insert_schedule`), then run ``extra`` passes (user passes
    see ``node.meta["dlo"]`` and the plan)."""
    gm = _run((*PIPELINE, *extra), gm, plan, plan.config.debug_passes, list(plan.ran))
    gm.recompile()
    return gm


__all__ = ["PLANNING", "PIPELINE", "Pass", "Stage", "PassContext", "GraphPlan", "ParamInfo",
           "GraphBlock", "plan_graph", "run_passes", "schedule_of"]

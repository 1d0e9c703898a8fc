"""The graph transforms: the plan written into the graph, then the user's passes.

`run_passes` runs `insert_schedule`, the transform that writes a frozen `GraphPlan`
(`dlo_fx.planning.stages.plan_graph`, the decisions) into the graph, and the user's
passes after it, each ``(gm, plan: GraphPlan) -> gm`` followed by ``gm.graph.lint()``. Set
``debug_passes`` (or ``DLO_FX_DEBUG_PASSES=1``) to log the graph before and after every
pass on the ``dlo_fx.passes`` logger.

| file | pass |
| --- | --- |
| insert_schedule.py | prefetch / wait / slot_view / swap_slot nodes, wrap-around prefetch; records the schedule the runtime replays |
"""

from __future__ import annotations

import logging
from typing import Callable

from torch import fx

from ..planning.stages import GraphPlan, step
from .insert_schedule import insert_schedule, schedule_of

log = logging.getLogger("dlo_fx.passes")  # one logger for the stages and the passes

Pass = Callable[[fx.GraphModule, GraphPlan], fx.GraphModule]

PIPELINE: tuple[Pass, ...] = (insert_schedule,)


def run_passes(gm: fx.GraphModule, plan: GraphPlan, extra: tuple[Pass, ...] = (),
               debug: bool = False) -> fx.GraphModule:
    """Write ``plan`` into ``gm`` (`insert_schedule`), then run ``extra`` passes (user passes
    see ``node.meta["dlo"]`` and the plan); ``debug`` logs the graph around each."""
    ran = list(plan.ran)  # the planning stages, then each pass
    for p in (*PIPELINE, *extra):
        name = getattr(p, "__name__", repr(p))
        if debug:
            log.debug("graph before pass %s:\n%s", name, gm.graph)
        with step(name, ran, "pass", "passes"):
            gm = p(gm, plan)
            gm.graph.lint()
        if debug:
            log.debug("graph after pass %s:\n%s", name, gm.graph)
    gm.recompile()
    return gm


__all__ = ["PIPELINE", "Pass", "GraphPlan", "insert_schedule", "run_passes", "schedule_of"]

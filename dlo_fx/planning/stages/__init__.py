"""Planning a graph: the stages that decide, in order, and the frozen plan they give.

`plan_graph` runs the stages, each ``(gm, ctx: PassContext) -> gm`` followed by
``gm.graph.lint()``, and freezes what they filled into a `GraphPlan`. They compute only:
no collective, no probe, no graph change, and no runtime: what the runtime holds reaches
them as its frozen `StoreView` (``ctx.view``, dlo_fx/runtime/view.py). The graph
transform that writes the plan into the graph is `dlo_fx.passes.insert_schedule`. Set
``debug_passes`` (or ``DLO_FX_DEBUG_PASSES=1``) to log the graph before and after every
stage and pass on the ``dlo_fx.passes`` logger.

| file | stage |
| --- | --- |
| context.py | `PassContext` (what the stages fill), `GraphPlan` (the frozen plan) |
| identify_params.py | placeholder -> parameter and FQN |
| use_intervals.py | first/last use of each parameter, through its aliases |
| resident_set.py | which parameters stay on the device (`dlo_fx.planning.residency`, `device_budget` through `dlo_fx.planning.budget`) |
| partition_blocks.py | blocks in first-use order by footprint (`dlo_fx.planning.blocks`) |
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from torch import fx

from .context import GraphBlock, GraphPlan, ParamInfo, PassContext
from .identify_params import identify_params, param_placeholders
from .partition_blocks import partition_blocks
from .resident_set import resident_set
from .use_intervals import use_intervals

log = logging.getLogger("dlo_fx.passes")  # one logger for the stages and the passes

Stage = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

PLANNING: tuple[Stage, ...] = (identify_params, use_intervals, resident_set, partition_blocks)


def run_steps(steps: Sequence[Callable], gm: fx.GraphModule, arg, debug: bool,
              ran: list[str]) -> fx.GraphModule:
    """Run ``steps`` (stages or passes) on ``gm``, each ``step(gm, arg)`` then a lint; a
    failing one gets a note naming it and those that ran before it (``ran``, extended)."""
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


def plan_graph(gm: fx.GraphModule, ctx: PassContext, debug: bool = False) -> GraphPlan:
    """Run the planning stages on ``ctx`` (a fresh `PassContext`) and freeze the plan;
    ``debug`` (the compile's ``debug_passes``) logs the graph around each."""
    run_steps(PLANNING, gm, ctx, debug, ctx.ran)
    return GraphPlan.freeze(ctx)


__all__ = ["PLANNING", "Stage", "PassContext", "GraphPlan", "ParamInfo", "GraphBlock",
           "param_placeholders", "plan_graph", "run_steps"]

"""Planning a graph: the stages that decide, in order, and the frozen plan they give.

Each stage is a function of its inputs returning a frozen value; `plan_graph` composes
them into one `GraphPlan`. They compute only: no collective, no probe, no graph change
(so no lint: the graph transforms in `dlo_fx.passes` lint what they change), and no
runtime: what the runtime holds reaches them as its frozen `StoreView`
(dlo_fx/planning/view.py). The transform that writes the plan into the graph is
`dlo_fx.passes.insert_schedule`. Set ``debug_passes`` (or ``DLO_FX_DEBUG_PASSES=1``) to log
the graph planned and what each stage decided on the ``dlo_fx.passes`` logger.

| file | stage |
| --- | --- |
| plan.py | the values: `ParamInfo`, `GraphBlock`, `GraphPlan` (the frozen plan) |
| identify_params.py | placeholder -> parameter and FQN |
| use_intervals.py | first/last use of each parameter, through its aliases |
| resident_set.py | which parameters stay on the device (`dlo_fx.planning.residency`, `device_budget` through `dlo_fx.planning.budget`) |
| partition_blocks.py | blocks in first-use order by footprint (`dlo_fx.planning.blocks`) |
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional, Sequence

from torch import fx

from ...config import DLOConfig
from ..settle import Budget
from ..view import StoreView
from .identify_params import identify_params, param_placeholders
from .partition_blocks import partition_blocks
from .plan import GraphBlock, GraphPlan, ParamInfo
from .resident_set import Residency, resident_set
from .use_intervals import Uses, use_intervals

log = logging.getLogger("dlo_fx.passes")  # one logger for the stages and the passes

#: The planning stages, in the order `plan_graph` runs them.
PLANNING: tuple[str, ...] = ("identify_params", "use_intervals", "resident_set",
                             "partition_blocks")


@contextlib.contextmanager
def step(name: str, ran: list[str], kind: str = "planning stage",
         kinds: str = "stages") -> Iterator[None]:
    """Run one stage (or pass: ``kind``, ``kinds``) named ``name``: a failure gets a note
    naming it and those that ran before it (``ran``, which it joins on success)."""
    try:
        yield
    except Exception as exc:
        if hasattr(exc, "add_note"):
            exc.add_note(f"in dlo {kind} {name!r} ({kinds} that ran before it: "
                         f"{', '.join(ran) or 'none'})")
        raise
    ran.append(name)


def plan_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], config: DLOConfig,
               view: Optional[StoreView], budget: Budget = Budget(),
               debug: bool = False) -> GraphPlan:
    """The plan of ``gm`` on the runtime ``view`` shows (None: no runtime) with ``config``
    (the runtime's options) and the device ``budget`` the compile settled; ``debug`` (the
    compile's ``debug_passes``) logs the graph and what each stage decided."""
    ran: list[str] = []
    if debug:
        log.debug("graph planned:\n%s", gm.graph)
    with step("identify_params", ran):
        params = identify_params(gm, example_inputs, view)
    with step("use_intervals", ran):
        uses = use_intervals(gm, params)
    with step("resident_set", ran):
        residency = resident_set(gm, uses, config, view, budget)
    with step("partition_blocks", ran):
        blocks = partition_blocks(view, residency)
    if debug:
        log.debug("planned %d parameters: %d resident, %d streamed in %d blocks (block "
                  "budget %d B)", len(params), len(residency.resident),
                  len(residency.streamed), len(blocks), residency.budget)
    return GraphPlan(config=config, example_inputs=example_inputs, view=view,
                     params=residency.params, resident=residency.resident,
                     streamed=residency.streamed, blocks=blocks, budget=residency.budget,
                     layers=residency.layers, budget_plan=residency.budget_plan,
                     escaping=uses.escaping, mode=view.mode if view is not None else None,
                     ran=tuple(ran), variant=budget.forced is not None)


__all__ = ["PLANNING", "Budget", "GraphBlock", "GraphPlan", "ParamInfo", "Residency", "Uses",
           "param_placeholders", "plan_graph", "step"]

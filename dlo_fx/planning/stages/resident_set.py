"""Planning stage 3: decide which parameters stay on the device (resident) and which stream.

The decision itself lives in one function, `dlo_fx.planning.residency.decide_residency`, shared
with `dlo_fx.load`: empty, unused, smaller than ``resident_bytes``, returned by the graph,
used far apart (a modulation table every layer reads, a tied embedding), or still read
when ``num_slots`` later blocks are live. The last check needs the blocks, so this stage
forms them (`form_blocks`, plan.py) as often as it takes; `partition_blocks` then
forms them once more from the final streamed set. Also fixes the block budget
(``block_bytes`` or the largest layer) and how FQNs map to layers.

With ``device_budget`` (in bytes, ``budget.device_budget``: settled by
`dlo_fx.planning.settle.settle_budget`; the backend measures the bandwidths and matmul
rates before planning, `dlo_fx.dynamo.probes`, and the plan reads them in its `StoreView`),
the settled blocks are handed to the budget planner
(`dlo_fx.planning.budget`): each block's copy time from the measured H2D and AllGather bandwidths,
its compute time from the FLOPs of the nodes it spans (`dlo_fx.planning.flops`) over the measured
matmul rate (see `block_compute_seconds`). The blocks it keeps resident get the reason
``device_budget: ...``; a budget below the minimum (slots for the largest block plus the
parameters resident anyway) raises ``ValueError`` here, before anything is stored, and so
does a declared ``device_memory`` below it (a device that cannot hold the slots).

``resident_set(gm, uses, config, view, budget) -> Residency``: the parameters with each
resident one's ``reason``, the streamed ones in first-use order, the block budget, the
layers and the device budget's plan. It reads ``gm`` (the FLOPs of its nodes) and
changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch
from torch import fx

from ...config import DLOConfig
from ..blocks import Layering
from ..budget import BudgetPlan, copy_seconds, minimum_bytes, plan_resident_blocks
from ..flops import graph_flops
from ..residency import Candidate, ChooseBlocks, decide_residency
from ..settle import Budget, gathers
from ..view import NAMED_RESIDENT, READ_DIRECTLY, StoreView
from .plan import ParamInfo, form_blocks
from .use_intervals import Uses


@dataclass(frozen=True)
class Residency:
    """What `resident_set` decided."""

    params: tuple[ParamInfo, ...]  # every parameter, a resident one with its ``reason``
    resident: tuple[ParamInfo, ...]
    streamed: tuple[ParamInfo, ...]  # in first-use order
    budget: int  # block budget in bytes
    layers: Layering  # how FQNs map to layers
    budget_plan: Optional[BudgetPlan]  # with a device budget


def resident_set(gm: fx.GraphModule, uses: Uses, config: DLOConfig,
                 view: Optional[StoreView], budget: Budget) -> Residency:
    params = uses.params
    facts = [view.facts(p.param) if view is not None else None for p in params]
    why = [f.kept if f is not None else None for f in facts]
    cands = [Candidate(p.fqn, p.nbytes, first=p.first, last=p.last,
                       escapes=p.node in uses.escaping, named=w == NAMED_RESIDENT,
                       pinned=w if w == READ_DIRECTLY else None)
             for p, w in zip(params, why)]

    def blocks_of(streamed: list[int], block_budget: int, layers: Layering) -> list[list[int]]:
        index = {id(params[i]): i for i in streamed}
        return [[index[id(p)] for p in b.params]
                for b in form_blocks(view, [params[i] for i in streamed], block_budget, layers)]

    chosen: list[BudgetPlan] = []  # the budget chooser's plan, where it ran
    decision = decide_residency(cands, resident_bytes=config.resident_bytes,
                                block_bytes=config.block_bytes,
                                num_slots=config.num_slots, blocks_of=blocks_of,
                                choose_blocks=_budget_chooser(gm, params, config, view,
                                                              budget, cands, chosen.append))
    decided = tuple(replace(p, reason=r) for p, r in zip(params, decision.reasons))
    return Residency(params=decided,
                     resident=tuple(p for p in decided if p.reason is not None),
                     streamed=tuple(decided[i] for i in decision.streamed_in_use_order(cands)),
                     budget=decision.budget, layers=decision.layers,
                     budget_plan=chosen[-1] if chosen else None)



def block_spans(starts: Sequence[int], num_nodes: int) -> list[range]:
    """The nodes each block's compute spans: from its first use (``starts``, ascending) to
    the next block's; the first block also takes the nodes before it, the last those
    after it (up to the output)."""
    bounds = [0, *starts[1:], num_nodes]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])] if starts else []


def block_compute_seconds(costs: Sequence[tuple[int, Optional[torch.dtype]]],
                          spans: Sequence[range],
                          rate: Callable[[torch.dtype], float]) -> tuple[list[int], list[float]]:
    """(FLOPs, seconds) of each block: the FLOPs of the nodes it spans (``costs`` per node,
    `dlo_fx.planning.flops.graph_flops`) over ``rate(dtype)`` (FLOP/s) of each node's dtype."""
    flops, seconds = [], []
    for span in spans:
        by_dtype: dict[torch.dtype, int] = {}
        for i in span:
            n, dtype = costs[i]
            if n:
                by_dtype[dtype] = by_dtype.get(dtype, 0) + n
        flops.append(sum(by_dtype.values()))
        seconds.append(sum(by_dtype[d] / rate(d) for d in sorted(by_dtype, key=str)))
    return flops, seconds


RATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def probed_flops(view: StoreView, dtype: Optional[torch.dtype]) -> float:
    """The runtime's measured matmul rate for ``dtype`` (FLOP/s; the backend measured it
    before planning, `dlo_fx.dynamo.probes.probe_runtime`)."""
    if dtype not in RATE_DTYPES:
        dtype = torch.float32  # integer or float8 products: no torch.mm to time, take fp32's
    return view.flops[dtype]


def _budget_chooser(gm: fx.GraphModule, params: Sequence[ParamInfo], config: DLOConfig,
                    view: Optional[StoreView], settled: Budget, cands: list[Candidate],
                    chose: Callable[[BudgetPlan], None]) -> Optional[ChooseBlocks]:
    """The device budget's block chooser for `decide_residency` (None: no device budget);
    each plan it makes is handed to ``chose``."""
    budget, auto, forced = settled.device_budget, settled.auto_capacity, settled.forced
    if budget is None and auto is None and forced is None:
        return None
    num_slots = config.num_slots

    def choose(blocks: list[list[int]], reasons: list[Optional[str]]) -> dict[int, str]:
        sizes = [sum(cands[i].nbytes for i in b) for b in blocks]
        names = [[cands[i].name for i in b] for b in blocks]
        if forced is not None:  # the auto budget's re-plan (dlo_fx.dynamo.auto_budget)
            if forced.fqns != names:
                raise RuntimeError(
                    "dlo: internal error: the auto device budget re-planned a graph whose "
                    f"blocks differ from its first plan's ({len(names)} blocks, first "
                    f"{names[0][0] if names else None!r}, against {len(forced.fqns)})")
            chose(forced)
            return {g: forced.reasons[g] for g in forced.resident}
        always = sum(c.nbytes for c, r in zip(cands, reasons)
                     if r is not None and (c.first is None or c.first >= 0))
        minimum = minimum_bytes(sizes, num_slots, always)
        if auto is not None and config.device_memory is not None and auto < minimum:
            raise ValueError(
                f"dlo option device_memory={config.device_memory!r} ({auto:,} B) is below "
                f"the {minimum:,} B this graph's weights need on the device at least: "
                f"num_slots={num_slots} slots of its largest block "
                f"({max(sizes, default=0):,} B, {num_slots * max(sizes, default=0):,} B of "
                f"slots) plus {always:,} B of parameters resident anyway, before any "
                "activation; declare the device's real capacity (device_memory >= "
                f"{minimum}, or None to read it from the driver), or lower num_slots / "
                "block_bytes")
        if auto is not None:  # every block streams at the first call: it measures
            budget_now, capacity = auto, 0
        elif budget < minimum:
            raise ValueError(
                f"dlo option device_budget={config.device_budget!r} ({budget:,} B) is below "
                f"the minimum of {minimum:,} B for this graph: num_slots={num_slots} slots of its "
                f"largest block ({max(sizes, default=0):,} B) plus {always:,} B of parameters "
                f"resident anyway; set device_budget >= {minimum} (or None to stream every "
                "block), or lower num_slots / block_bytes")
        else:
            budget_now, capacity = budget, budget - minimum
        # A recompile of the same parameters (a new resolution, autocast; perhaps on one
        # rank only) keeps the blocks the first compile chose: re-planned from other FLOPs,
        # one rank would stream other blocks than the rest (ClockMismatch at every call),
        # and both plans' resident copies would stay on the device, past the budget. A
        # model compiled from the device has the earlier resident blocks pinned already
        # (read directly, not stored): its blocks are the earlier streamed ones, none added.
        earlier = (view.budget_plans.get(tuple(p.fqn for p in params))
                   if view is not None and auto is None else None)
        if earlier is not None:
            if earlier.fqns == names:
                chose(earlier)
                return {g: earlier.reasons[g] for g in earlier.resident}
            if [f for g, f in enumerate(earlier.fqns) if g not in earlier.resident] == names:
                capacity = 0
        dp = view.dp if view is not None else 1
        allgather = view is not None and gathers(config, view)
        nodes = list(gm.graph.nodes)
        costs = graph_flops(nodes)
        spans = block_spans([max(min(cands[i].first for i in b), 0) for b in blocks], len(nodes))
        dtypes = sorted({d for n, d in costs if n}, key=str)  # the same order on every rank
        h2d = gather = 1.0
        rates = {d: float("inf") for d in dtypes}  # no runtime to measure on: transfer-bound
        if view is not None and blocks and view.bandwidths is not None:
            # measured by the backend before planning (dlo_fx.dynamo.probes)
            rates = {d: probed_flops(view, d) for d in dtypes}
            h2d, gather = view.bandwidths
        flops, compute_s = block_compute_seconds(costs, spans, rates.__getitem__)
        copy_s = [copy_seconds(n, dp=dp, allgather=allgather, h2d_gbps=h2d,
                               gather_gbps=min(gather, 1e6)) for n in sizes]
        on_meta = view is not None and view.device.type == "meta"
        plan = BudgetPlan(device_budget=budget_now, minimum=minimum, capacity=capacity,
                          h2d_gbps=h2d, gather_gbps=gather,
                          # the meta device copies and computes nothing: its probes'
                          # figures are no machine's (dlo_fx.plan plans for one)
                          figures=("meta device's (no machine's: plan for a device with "
                                   "dlo_fx.plan)") if on_meta else "measured",
                          labels=[f"{cands[b[0]].name} .. {cands[b[-1]].name}" for b in blocks],
                          fqns=names,
                          copy_s=copy_s, compute_s=compute_s, flops=flops,
                          flops_per_s={str(d).removeprefix("torch."): r
                                       for d, r in rates.items() if r != float("inf")})
        if auto is not None:
            plan.budget_lines = [
                f"device capacity {auto:,} B; nothing measured yet: the first call streams "
                "every block and measures its activation peak, later calls are planned"]
        chose(plan_resident_blocks(sizes, copy_s, compute_s, num_slots=num_slots,
                                   capacity=capacity, plan=plan))
        return {g: plan.reasons[g] for g in plan.resident}

    return choose

"""`PassContext`: what the planning stages fill; `GraphPlan`: the frozen plan they give.

Every stage has the signature ``(gm: GraphModule, ctx: PassContext) -> GraphModule`` and
reads the fields earlier stages filled; `plan_graph` (planning/stages/__init__.py) runs
them and freezes the result into a `GraphPlan`, which `insert_schedule` and user passes
take. Both hold the runtime's frozen `StoreView` (``view``), never the runtime.
`PassContext.form_blocks` turns a streamed set into graph blocks; the `resident_set`
stage (its slot check) and the `partition_blocks` stage (the final blocks) both call it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import fx

from ...config import DLOConfig
from ...runtime.view import StoreView
from ..blocks import Layering, Unit, partition


@dataclass(eq=False)
class ParamInfo:
    """A placeholder that carries an ``nn.Parameter``."""

    node: fx.Node
    param: torch.nn.Parameter
    fqn: str
    nbytes: int  # bytes of its storage span as stored
    stored_as: Optional[torch.dtype] = None  # stored in this dtype, not its own
    first: int = -1  # index of the first node that reads it (or an alias of it)
    last: int = -1  # index of the last such node
    reason: Optional[str] = None  # why it is resident, if it is


@dataclass(eq=False)
class GraphBlock:
    """A graph block: parameters streamed together, in first-use order."""

    index: int
    params: list[ParamInfo]
    host_block: Optional[int] = None  # host block already holding them, if any
    reason: str = ""  # why the block ends where it does (see [Note: blocks by footprint])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def first(self) -> int:
        return min(p.first for p in self.params)

    @property
    def last(self) -> int:
        return max(p.last for p in self.params)


@dataclass
class PassContext:
    config: DLOConfig  # the runtime's options
    example_inputs: Sequence[Any]
    view: Optional[StoreView] = None  # the runtime's, when compiling for a model
    params: list[ParamInfo] = field(default_factory=list)
    order: dict[fx.Node, int] = field(default_factory=dict)
    resident: list[ParamInfo] = field(default_factory=list)
    streamed: list[ParamInfo] = field(default_factory=list)
    budget: int = 0
    layers: Layering = field(default_factory=Layering)  # how FQNs map to layers
    blocks: list[GraphBlock] = field(default_factory=list)
    budget_plan: Any = None  # dlo_fx.planning.budget.BudgetPlan, with device_budget
    escaping: set = field(default_factory=set)  # param nodes whose views reach the output
    ran: list[str] = field(default_factory=list)
    device_budget: Optional[int] = None  # bytes planned at this compile (`planning.settle`)
    auto_capacity: Optional[int] = None  # device_budget="auto", re-planned per call: capacity
    forced_plan: Any = None  # a BudgetPlan the auto budget re-plans this graph with

    def in_store(self, param: torch.Tensor) -> bool:
        return self.view is not None and self.view.in_store(param)

    def form_blocks(self, streamed: list[ParamInfo], budget: int,
                    layers: Layering) -> list[GraphBlock]:
        """Graph blocks of ``streamed`` (in first-use order) within ``budget`` bytes.

        Parameters not in the host store are partitioned (`dlo_fx.planning.blocks`); stored
        ones keep their host block: a graph block is then this graph's parameters in it.
        Blocks are numbered in order of first use.
        """
        fresh = [p for p in streamed if not self.in_store(p.param)]
        stored: dict[int, list[ParamInfo]] = {}
        for p in streamed:
            if self.in_store(p.param):
                stored.setdefault(self.view.facts(p.param).block, []).append(p)
        cuts = partition([Unit(p.fqn, p.nbytes) for p in fresh], budget, layers)
        groups = [(None, fresh[c.start:c.stop], c.reason) for c in cuts]
        groups += [(hb, ps, self.view.block_ends.get(hb) or f"host block {hb}: stored "
                            "together (whole layers up to block_bytes)")
                   for hb, ps in stored.items()]
        groups.sort(key=lambda item: min(p.first for p in item[1]))
        return [GraphBlock(index=i, params=ps, host_block=hb, reason=why)
                for i, (hb, ps, why) in enumerate(groups)]


@dataclass(frozen=True, eq=False)
class GraphPlan:
    """What planning decided for one graph: its parameters (with their use intervals and,
    for resident ones, the reason), which stay resident, the blocks the rest stream in,
    the device budget's plan and the mode. `insert_schedule` writes it into the graph;
    user passes and the dump read it."""

    config: DLOConfig  # the runtime's options (see [Note: options belong to a verb])
    example_inputs: Sequence[Any]
    view: Optional[StoreView]  # the runtime's when the graph was planned (None: no runtime)
    params: tuple[ParamInfo, ...]
    resident: tuple[ParamInfo, ...]
    streamed: tuple[ParamInfo, ...]
    blocks: tuple[GraphBlock, ...]
    budget: int  # block budget in bytes
    layers: Layering
    budget_plan: Any  # dlo_fx.planning.budget.BudgetPlan, with device_budget
    escaping: frozenset
    mode: Optional[str]  # the runtime's mode (settled when it stored its blocks), None: no runtime
    ran: tuple[str, ...]  # the planning stages, in order
    schedule: Any = None  # the runtime's GraphSchedule insert_schedule attaches (the backend's)
    variant: bool = False  # the auto budget's re-plan of a graph planned before (forced_plan)

    @classmethod
    def freeze(cls, ctx: PassContext) -> "GraphPlan":
        view = ctx.view
        return cls(config=ctx.config, example_inputs=ctx.example_inputs, view=view,
                   params=tuple(ctx.params), resident=tuple(ctx.resident),
                   streamed=tuple(ctx.streamed), blocks=tuple(ctx.blocks), budget=ctx.budget,
                   layers=ctx.layers, budget_plan=ctx.budget_plan,
                   escaping=frozenset(ctx.escaping),
                   mode=view.mode if view is not None else None, ran=tuple(ctx.ran),
                   variant=ctx.forced_plan is not None)

    def with_schedule(self, schedule: Any) -> "GraphPlan":
        """The plan with the `GraphSchedule` (dlo_fx/runtime/graph/ops.py) `insert_schedule`
        attaches to the graph: made by the backend, which holds the runtime."""
        return dataclasses.replace(self, schedule=schedule)

    def in_store(self, param: torch.Tensor) -> bool:
        return self.view is not None and self.view.in_store(param)

"""The values planning gives: `ParamInfo` (a parameter of the graph), `GraphBlock` (the
parameters streamed together) and `GraphPlan` (what planning decided for one graph).

All frozen. Each planning stage is a function of its inputs returning such a value, and
`plan_graph` (planning/stages/__init__.py) composes them into one `GraphPlan`, which
`insert_schedule` and the user's passes take. A plan holds the runtime's frozen
`StoreView` (``view``), never the runtime. `form_blocks` turns a streamed set into graph
blocks; the `resident_set` stage (its slot check) and the `partition_blocks` stage (the
final blocks) both call it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import fx

from ...config import DLOConfig
from ..blocks import Layering, Unit, partition
from ..budget import BudgetPlan
from ..view import StoreView


@dataclass(frozen=True, eq=False)
class ParamInfo:
    """A placeholder that carries an ``nn.Parameter``, and what the stages found of it."""

    node: fx.Node
    param: torch.nn.Parameter
    fqn: str
    nbytes: int  # bytes of its storage span as stored
    stored_as: Optional[torch.dtype] = None  # stored in this dtype, not its own
    first: int = -1  # index of the first node that reads it (or an alias of it)
    last: int = -1  # index of the last such node
    reason: Optional[str] = None  # why it is resident, if it is


@dataclass(frozen=True, eq=False)
class GraphBlock:
    """A graph block: parameters streamed together, in first-use order."""

    index: int
    params: tuple[ParamInfo, ...]
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


def in_store(view: Optional[StoreView], param: torch.Tensor) -> bool:
    return view is not None and view.in_store(param)


def form_blocks(view: Optional[StoreView], streamed: Sequence[ParamInfo], budget: int,
                layers: Layering) -> tuple[GraphBlock, ...]:
    """Graph blocks of ``streamed`` (in first-use order) within ``budget`` bytes.

    Parameters not in the host store are partitioned (`dlo_fx.planning.blocks`); stored
    ones keep their host block: a graph block is then this graph's parameters in it.
    Blocks are numbered in order of first use.
    """
    fresh = [p for p in streamed if not in_store(view, p.param)]
    stored: dict[int, list[ParamInfo]] = {}
    for p in streamed:
        if in_store(view, p.param):
            stored.setdefault(view.facts(p.param).block, []).append(p)
    cuts = partition([Unit(p.fqn, p.nbytes) for p in fresh], budget, layers)
    groups = [(None, fresh[c.start:c.stop], c.reason) for c in cuts]
    groups += [(hb, ps, view.block_ends.get(hb) or f"host block {hb}: stored "
                        "together (whole layers up to block_bytes)")
               for hb, ps in stored.items()]
    groups.sort(key=lambda item: min(p.first for p in item[1]))
    return tuple(GraphBlock(index=i, params=tuple(ps), host_block=hb, reason=why)
                 for i, (hb, ps, why) in enumerate(groups))


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
    budget_plan: Optional[BudgetPlan]  # with a device budget
    escaping: frozenset  # param nodes whose views reach the output
    mode: Optional[str]  # the runtime's mode (settled when it stored its blocks), None: no runtime
    ran: tuple[str, ...]  # the planning stages, in order
    schedule: Any = None  # the runtime's GraphSchedule insert_schedule attaches (the backend's)
    variant: bool = False  # the auto budget's re-plan of a graph planned before (forced)

    def with_schedule(self, schedule: Any) -> "GraphPlan":
        """The plan with the `GraphSchedule` (dlo_fx/runtime/graph/ops.py) `insert_schedule`
        attaches to the graph: made by the backend, which holds the runtime."""
        return dataclasses.replace(self, schedule=schedule)

    def in_store(self, param: torch.Tensor) -> bool:
        return in_store(self.view, param)

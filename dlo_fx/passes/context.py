"""`PassContext`: what the passes share. Each pass reads the fields earlier passes filled.

Every pass has the signature ``(gm: GraphModule, ctx: PassContext) -> GraphModule``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import fx

from ..config import DLOConfig


@dataclass(eq=False)
class ParamInfo:
    """A placeholder that carries an ``nn.Parameter``."""

    node: fx.Node
    param: torch.nn.Parameter
    fqn: str
    nbytes: int
    first: int = -1  # index of the first node that reads it (or an alias of it)
    last: int = -1  # index of the last such node
    reason: Optional[str] = None  # why it is resident, if it is


@dataclass(eq=False)
class GraphBlock:
    """A graph block: parameters streamed together, in first-use order."""

    index: int
    params: list[ParamInfo]
    host_block: Optional[int] = None  # host block already holding them, if any

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
    config: DLOConfig
    example_inputs: Sequence[Any]
    runtime: Any = None  # dlo_fx.runtime.runtime.Runtime, when compiling for real
    params: list[ParamInfo] = field(default_factory=list)
    order: dict[fx.Node, int] = field(default_factory=dict)
    resident: list[ParamInfo] = field(default_factory=list)
    streamed: list[ParamInfo] = field(default_factory=list)
    budget: int = 0
    blocks: list[GraphBlock] = field(default_factory=list)
    schedule: Any = None  # dlo_fx.runtime.ops.GraphSchedule
    escaping: set = field(default_factory=set)  # param nodes whose views reach the output
    ran: list[str] = field(default_factory=list)

    def in_store(self, param: torch.Tensor) -> bool:
        return self.runtime is not None and param in self.runtime.store

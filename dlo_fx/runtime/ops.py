"""The schedule nodes' targets: plain functions the scheduled graph calls.

Each takes the graph's `GraphSchedule` (a ``get_attr`` node named ``_dlo``) and the graph
block index. Blocks are bound to host blocks at run time from the parameters the graph is
called with, never from those seen while compiling: Dynamo may reuse one graph for every
layer of the same shape. They are registered as side-effecting so dead-code elimination
keeps them. See [Note: slot reuse and stream ordering] in runtime.py.

Each op counts itself in ``sched.step`` once done, so a graph whose call fails can run the
rest of its schedule (see [Note: the collective clock] in graph_call.py); every op is
idempotent on the slot state, so one interrupted half-way simply runs again.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from .runtime import Runtime


class GraphSchedule(torch.nn.Module):
    """Per-graph state: slot of each graph block and its binding for the current call.

    A (parameter-free) submodule of the scheduled GraphModule, reached by a ``get_attr``
    node, so the graph prints and lints like any other.
    """

    def __init__(self, runtime: Runtime, slot_of: list[int], fqns: list[list[str]]) -> None:
        super().__init__()
        self.runtime = runtime
        self.slot_of = slot_of
        self.fqns = fqns
        self.bound = [-1] * len(slot_of)
        self.step = 0  # schedule ops done in the current call
        self.replay: list = []  # (target, argument sources) of every schedule op, in order
        self.key = 0  # clock word naming this graph (see graph_call.bind)

    def extra_repr(self) -> str:
        return f"blocks={len(self.slot_of)}, slots={self.runtime.slots.num_slots}"


def prefetch(sched: GraphSchedule, block: int, *params: torch.nn.Parameter) -> None:
    """Start copying graph block ``block``'s host shard into its slot."""
    host_block = sched.runtime.resolve(params, sched.fqns[block])
    sched.bound[block] = host_block
    sched.runtime.prefetch(host_block, sched.slot_of[block])
    sched.step += 1


def allgather(sched: GraphSchedule, block: int) -> None:
    """Complete graph block ``block`` in its slot from every rank's shard (in place)."""
    sched.runtime.allgather(sched.bound[block], sched.slot_of[block])
    sched.step += 1


def wait(sched: GraphSchedule, block: int) -> None:
    """Block until graph block ``block`` is complete in its slot."""
    sched.runtime.wait(sched.bound[block], sched.slot_of[block])
    sched.step += 1


def slot_view(sched: GraphSchedule, block: int, token: None, param: torch.nn.Parameter) -> torch.Tensor:
    """``param`` as a view of its slot; ``token`` is the block's ``wait`` (ordering only)."""
    view = sched.runtime.view(sched.slot_of[block], sched.bound[block], param)
    sched.step += 1
    return view


def swap_slot(sched: GraphSchedule, block: int) -> None:
    """Graph block ``block`` has been read for the last time: its slot may be refilled."""
    sched.runtime.swap(sched.slot_of[block])
    sched.step += 1


def resident(sched: GraphSchedule, param: torch.nn.Parameter) -> torch.Tensor:
    """A stored parameter this graph keeps on the device (a shared table, say)."""
    tensor = sched.runtime.resident_tensor(param)
    sched.step += 1
    return tensor


for _fn in (prefetch, allgather, wait, swap_slot):
    has_side_effect(_fn)

SCHEDULE_OPS = {prefetch: "prefetch", allgather: "allgather", wait: "wait", swap_slot: "swap_slot",
                slot_view: "slot_view", resident: "resident"}

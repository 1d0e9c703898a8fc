"""`GraphDump`: what a dump needs of one scheduled graph, kept after compilation.

The backend hands `write_dump` the scheduled GraphModule, the pass context and the
runtime. A dump folder is written at once, but ``trace.json``, the measured timeline and
the stall section of ``blocks.md`` can only be written after the model ran, so each dump
keeps a small snapshot of its graph: the block table, the resident set, the order of the
schedule nodes and the tracer of its runtime. The runtime itself (host store, slots) is
held through a weak reference, so a dump never keeps weight memory alive.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from torch import fx

from ...planning.stages import GraphBlock, GraphPlan
from ...planning.budget import BudgetPlan
from ...runtime import Runtime, Tracer

#: Kinds of schedule node that move or order a block (``node.meta["dlo"]["kind"]``).
BLOCK_KINDS = ("prefetch", "allgather", "wait", "swap_slot")


@dataclass(frozen=True)
class BlockRow:
    """One graph block as the dump shows it."""

    index: int
    """Graph block index (``b{index}`` in node names)."""
    slot: int
    fqns: tuple[str, ...]
    nbytes: int
    """Bytes of its parameters (what ``node.meta["dlo"]["bytes"]`` says)."""
    slot_bytes: int
    """Bytes it takes in a slot once complete (aligned, padded to ``dp`` shards)."""
    shard_bytes: int
    """Bytes this rank holds in host memory and copies host-to-device."""
    host_block: int
    """Host-store block it was committed to at compile time."""
    reason: str = ""
    """Why the block ends where it does (see [Note: blocks by footprint])."""


@dataclass(frozen=True)
class ResidentRow:
    """A parameter of the graph kept on the device, and why."""

    fqn: str
    nbytes: int
    reason: str


@dataclass(frozen=True)
class Step:
    """One node of the scheduled program, in graph order.

    ``kind`` is a schedule kind (`BLOCK_KINDS`) or ``"op"`` for a compute node; ``block``
    is the graph block of a schedule node, -1 for an op. ``resident_bytes``: bytes of
    resident parameters an op reads directly (its compute is not in any block's bytes).
    ``resident_block``: the block the device budget keeps resident whose parameters the
    op reads (numbered as in the budget plan, before resident blocks are taken out), -1
    for none.
    """

    kind: str
    block: int = -1
    wrap: bool = False
    resident_bytes: int = 0
    resident_block: int = -1


@dataclass(eq=False)
class GraphDump:
    """Snapshot of one scheduled graph and where its dump lives."""

    index: int
    folder: Path
    mode: str
    dp: int
    rank: int
    num_slots: int
    budget: int
    blocks: tuple[BlockRow, ...]
    resident: tuple[ResidentRow, ...]
    program: tuple[Step, ...]
    tracer: Optional[Tracer] = None  # when the trace option is on
    mode_reason: str = ""  # why the runtime runs this mode (mode="auto": the policy's reason)
    layers: str = ""  # modules split into their submodules to form layers, and why
    runtime_ref: Optional[weakref.ReferenceType] = field(default=None, repr=False)
    flushed_spans: int = 0  # spans seen by the last flush
    graph_id: int = -1  # GraphSchedule.graph: the tag of this graph's spans
    budget_plan: Optional[BudgetPlan] = None  # with the device_budget option
    predicted: str = ""  # the hardware a plan predicts for (`dlo_fx.plan`): no graph ran
    variant_of: Optional["GraphDump"] = None  # the graph an auto-budget variant re-plans

    @property
    def runtime(self) -> Optional[Runtime]:
        return self.runtime_ref() if self.runtime_ref is not None else None


def _host_block_of(runtime: Optional[Runtime], block: GraphBlock) -> int:
    if block.host_block is not None:
        return block.host_block
    entry = runtime.store.entry(block.params[0].param) if runtime is not None else None
    return entry.block if entry is not None else -1


def snapshot(gm: fx.GraphModule, ctx: GraphPlan, runtime: Optional[Runtime], index: int,
             folder: Path) -> GraphDump:
    """Record what the dump of ``gm`` needs, after the backend committed its blocks."""
    store = runtime.store if runtime is not None else None
    rows = []
    for block in ctx.blocks:
        host = _host_block_of(runtime, block)
        spec = store.blocks[host].spec if store is not None and host >= 0 else None
        rows.append(BlockRow(
            index=block.index, slot=block.index % ctx.config.num_slots,
            fqns=tuple(p.fqn for p in block.params), nbytes=block.nbytes,
            slot_bytes=spec.padded_bytes if spec is not None else block.nbytes,
            shard_bytes=spec.shard_bytes if spec is not None else block.nbytes,
            host_block=host, reason=block.reason))
    resident = tuple(ResidentRow(p.fqn, p.nbytes, p.reason or "") for p in ctx.resident)
    resident_nodes = {p.node: p.nbytes for p in ctx.resident}
    plan = getattr(ctx, "budget_plan", None)
    budget_block = ({fqn: g for g in plan.resident if g < len(plan.fqns) for fqn in plan.fqns[g]}
                    if plan is not None else {})
    block_of_node = {p.node: budget_block[p.fqn] for p in ctx.resident if p.fqn in budget_block}
    program = []
    for node in gm.graph.nodes:
        meta = node.meta.get("dlo")
        if meta is not None:
            if meta["kind"] in BLOCK_KINDS:
                program.append(Step(meta["kind"], meta["block"], bool(meta.get("wrap"))))
            elif meta["kind"] == "resident":
                resident_nodes[node] = meta["bytes"]
                if meta.get("fqn") in budget_block:
                    block_of_node[node] = budget_block[meta["fqn"]]
        elif node.op in ("call_function", "call_method", "call_module"):
            inputs = node.all_input_nodes
            program.append(Step("op", resident_bytes=sum(resident_nodes.get(a, 0) for a in inputs),
                                resident_block=next((block_of_node[a] for a in inputs
                                                     if a in block_of_node), -1)))
    mode = runtime.mode if runtime is not None else "rank_local"
    dp = store.dp if store is not None else 1
    return GraphDump(
        index=index, folder=folder, mode=mode, dp=dp,
        rank=store.rank if store is not None else 0,
        num_slots=ctx.config.num_slots, budget=ctx.budget, blocks=tuple(rows),
        resident=resident, program=tuple(program),
        tracer=getattr(runtime, "tracer", None),
        mode_reason=getattr(runtime, "mode_reason", ""),
        layers=ctx.layers.describe(),
        runtime_ref=weakref.ref(runtime) if runtime is not None else None,
        graph_id=getattr(getattr(gm, "_dlo", None), "graph", -1),
        budget_plan=getattr(ctx, "budget_plan", None))

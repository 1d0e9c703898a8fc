"""The graph transform: insert the schedule nodes and read streamed parameters from their slots.

For graph block ``g`` in slot ``s = g % num_slots``::

    prefetch_b{g}(_dlo, g, *params)     # after swap_slot_b{g-num_slots}, or at the start
    allgather_b{g}(_dlo, g)             # right after it, in allgather mode only
    wait_b{g}(_dlo, g)                  # before the first read of any of its parameters
    <fqn> = slot_view(_dlo, g, wait_b{g}, param)   # every use of param now reads this
    <fqn>_stored = slot_view(_dlo, g, wait_b{g}, param, dtype)   # stored in another dtype:
    <fqn> = <fqn>_stored.to(dtype)                              # cast right after the view
    swap_slot_b{g}(_dlo, g)             # after the last read of any view of its params

plus the ring: ``prefetch_b{s}_wrap`` for each of the first ``num_slots`` blocks once slot
``s`` is free for the last time, so the next call (the next denoising step) starts with
every slot warm. Stored parameters this graph keeps resident read
``resident(_dlo, param)``. Every inserted node carries ``node.meta["dlo"]``.

The one graph transform of the backend: it takes the frozen `GraphPlan` (`plan_graph`)
with the `GraphSchedule` the backend made for it (``plan.schedule``: the runtime's object,
whose ``OPS`` are the targets written here) and, once the nodes are written, records on
it what the runtime needs (`_record`: each schedule node's target and where its arguments
come from, in graph order; `GraphSchedule.record` derives the graph's clock key), so
nothing reads the graph back later. A streamed
GGUF weight's ``as_tensor()`` call becomes the tensor read in its place. User passes run
after it: they may add nodes (a probe after each wait), not move or drop schedule nodes.

Before/after: the graph reads every streamed parameter through its slot::

    linear = linear(x, l_blocks_0_qkv_weight)            # before
    wait_b3 = wait(_dlo, 3)                              # after
    blocks_0_qkv_weight = slot_view(_dlo, 3, wait_b3, l_blocks_0_qkv_weight)
    linear = linear(x, blocks_0_qkv_weight)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx

from ..planning.stages import GraphBlock, GraphPlan

SCHEDULE_ATTR = "_dlo"


def _meta(kind: str, block: GraphBlock, slot: int, **extra) -> dict:
    return {"kind": kind, "block": block.index, "slot": slot, "bytes": block.nbytes,
            "fqns": [p.fqn for p in block.params], **extra}


def _name(fqn: str) -> str:
    return fqn.replace(".", "_")


def schedule_of(gm: fx.GraphModule) -> Optional[Any]:
    """The `GraphSchedule` `insert_schedule` attached to ``gm``, or None (nothing to
    schedule)."""
    sched = getattr(gm, SCHEDULE_ATTR, None)
    return sched if isinstance(sched, torch.nn.Module) and hasattr(sched, "OPS") else None


def _record(graph: fx.Graph, sched: Any, written: set[fx.Node]) -> None:
    """What the runtime needs of the nodes just written: every schedule node's target and
    where each argument comes from (a placeholder's position, a constant, or a node the
    runtime does without), in graph order, so that `graph_call.complete` can run the rest
    of a failed call's schedule (`GraphSchedule.record` takes it)."""
    placeholders = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    targets = set(sched.OPS.values())
    replay = []
    for node in graph.nodes:
        if node not in written or node.target not in targets:
            continue
        spec = []
        for a in node.args[1:]:  # args[0] is the schedule itself
            if isinstance(a, fx.Node):
                spec.append(("arg", placeholders[a]) if a in placeholders else ("none", None))
            else:
                spec.append(("const", a))
        replay.append((node.target, tuple(spec)))
    sched.record(replay)


def insert_schedule(gm: fx.GraphModule, plan: GraphPlan) -> fx.GraphModule:
    graph = gm.graph
    nodes = list(graph.nodes)
    k = plan.config.num_slots
    blocks = plan.blocks
    sched = plan.schedule
    if sched is None:  # no parameters, no model: nothing to schedule
        if blocks:
            raise RuntimeError("dlo: internal error: a plan with blocks and no GraphSchedule "
                               "(the backend makes one for every plan of a runtime)")
        return gm
    ops = sched.OPS
    gm.add_submodule(SCHEDULE_ATTR, sched)
    dlo_nodes: set[fx.Node] = set()
    stored_resident = [p for p in plan.resident if plan.in_store(p.param) and p.first >= 0]
    if not blocks and not stored_resident:
        _record(graph, sched, dlo_nodes)
        return gm

    def make(target, args, name, meta):
        node = graph.create_node("call_function", target, args, name=name)
        node.meta["dlo"] = meta
        dlo_nodes.add(node)
        return node

    def redirect(info, new):
        info.node.replace_all_uses_with(new, delete_user_cb=lambda u: u not in dlo_nodes)

    last_placeholder = [n for n in nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_placeholder):
        sched_node = graph.get_attr(SCHEDULE_ATTR)
    cursor = sched_node

    gather = plan.mode == "allgather"

    def prefetch(block: GraphBlock, after: fx.Node, name: str) -> fx.Node:
        """prefetch (and, when sharded, allgather) of ``block``; returns the last node."""
        slot = block.index % k
        with graph.inserting_after(after):
            node = make(ops["prefetch"], (sched_node, block.index, *[p.node for p in block.params]),
                        name, _meta("prefetch", block, slot))
        if gather:
            with graph.inserting_after(node):
                node = make(ops["allgather"], (sched_node, block.index),
                            name.replace("prefetch", "allgather"), _meta("allgather", block, slot))
        return node

    for block in blocks[:k]:
        cursor = prefetch(block, cursor, f"prefetch_b{block.index}")

    for info in stored_resident:
        with graph.inserting_before(nodes[info.first]):
            node = make(ops["resident"], (sched_node, info.node), _name(info.fqn),
                        {"kind": "resident", "fqn": info.fqn, "bytes": info.nbytes})
        redirect(info, node)

    last_in_slot = {b.index % k: b.index for b in blocks}  # last block using each slot
    for block in blocks:
        slot = block.index % k
        with graph.inserting_before(nodes[block.first]):
            token = make(ops["wait"], (sched_node, block.index), f"wait_b{block.index}",
                         _meta("wait", block, slot))
            for info in block.params:
                args = (sched_node, block.index, token, info.node)
                meta = {"kind": "slot_view", "block": block.index, "slot": slot,
                        "fqn": info.fqn, "bytes": info.nbytes}
                if info.stored_as is None:
                    view = make(ops["slot_view"], args, _name(info.fqn), meta)
                else:  # stored in another dtype: cast on the device, right after the view
                    dtype = info.param.dtype
                    stored = make(ops["slot_view"], (*args, dtype), _name(info.fqn) + "_stored",
                                  {**meta, "stored_as": str(info.stored_as)})
                    view = graph.create_node("call_method", "to", (stored, dtype),
                                             name=_name(info.fqn))
                    view.meta["dlo"] = {"kind": "cast", "block": block.index, "fqn": info.fqn,
                                        "from": str(info.stored_as), "to": str(dtype)}
                    dlo_nodes.add(view)
                redirect(info, view)
        with graph.inserting_after(nodes[block.last]):
            swap = make(ops["swap_slot"], (sched_node, block.index), f"swap_slot_b{block.index}",
                        _meta("swap_slot", block, slot))
        after = swap
        if block.index + k < len(blocks):
            after = prefetch(blocks[block.index + k], after, f"prefetch_b{block.index + k}")
        if len(blocks) > k and last_in_slot[slot] == block.index:
            first = blocks[slot]  # the block that opens the next call in this slot
            wrap = prefetch(first, after, f"prefetch_b{first.index}_wrap")
            wrap.meta["dlo"]["wrap"] = True
            if gather:
                wrap.prev.meta["dlo"]["wrap"] = True
    _inline_as_tensor(graph, dlo_nodes)
    _record(graph, sched, dlo_nodes)
    return gm


def _inline_as_tensor(graph: fx.Graph, written: set[fx.Node]) -> None:
    """``p.as_tensor()`` of a streamed parameter (diffusers' GGUF dequantisation calls it on
    its ``GGUFParameter``s) is the tensor read in its place: Dynamo recorded it as a method
    call on the parameter, and the slot view (or resident copy) that now stands for it is a
    plain tensor, without that method."""
    for node in list(graph.nodes):
        if (node.op == "call_method" and node.target == "as_tensor" and len(node.args) == 1
                and not node.kwargs and node.args[0] in written):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)

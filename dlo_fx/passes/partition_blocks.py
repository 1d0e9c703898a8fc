"""Pass 4: partition the streamed parameters into blocks sized by their footprint.

Parameters are taken in first-use order and grouped into *natural layers* (consecutive
parameters under the same ``...blocks.<i>`` prefix, or the same top-level module).
Layers are packed whole into a block while it stays within the budget; a layer larger
than the budget is split at leaf-module boundaries, and a parameter larger than the budget
gets a block of its own (the slots grow to it). The default budget is the largest natural
layer, so a uniform DiT gets one block per layer.

Parameters already in the host store (loaded, or seen by an earlier graph) keep their host
block: a graph block is then the set of this graph's parameters in that host block.

Before/after: no graph change; fills ``ctx.blocks``.
"""

from __future__ import annotations

from itertools import groupby
from typing import Callable, Iterable

from torch import fx

from .context import GraphBlock, ParamInfo, PassContext


def layer_key(fqn: str) -> str:
    """``blocks.3.ffn.net.0.weight`` -> ``blocks.3``; ``patch_embed.weight`` -> ``patch_embed``.

    The outermost numeric component marks a layer of a ModuleList (inner ones are
    Sequential indices inside the layer).
    """
    parts = fqn.split(".")
    for i in range(1, len(parts) - 1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def leaf_key(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else fqn


def _runs(params: Iterable[ParamInfo], key: Callable[[str], str]) -> list[list[ParamInfo]]:
    return [list(g) for _, g in groupby(params, key=lambda p: key(p.fqn))]


def natural_layer_bytes(params: list[ParamInfo]) -> int:
    """Bytes of the largest natural layer (the default block budget)."""
    return max((sum(p.nbytes for p in run) for run in _runs(params, layer_key)), default=0)


def _pack(units: list[list[ParamInfo]], budget: int, out: list[list[ParamInfo]]) -> None:
    """Greedy packing of whole units, splitting a unit only when it exceeds the budget."""
    cur: list[ParamInfo] = []
    size = 0
    for unit in units:
        unit_bytes = sum(p.nbytes for p in unit)
        if unit_bytes > budget:
            if cur:
                out.append(cur)
                cur, size = [], 0
            if len(unit) == 1:
                out.append(unit)
            else:
                leaves = _runs(unit, leaf_key)  # split at leaf modules, else per parameter
                _pack(leaves if len(leaves) > 1 else [[p] for p in unit], budget, out)
            continue
        if cur and size + unit_bytes > budget:
            out.append(cur)
            cur, size = [], 0
        cur.extend(unit)
        size += unit_bytes
    if cur:
        out.append(cur)


def partition(params: list[ParamInfo], budget: int) -> list[list[ParamInfo]]:
    """Blocks of ``params`` (already in first-use order) within ``budget`` bytes."""
    blocks: list[list[ParamInfo]] = []
    _pack(_runs(params, layer_key), budget, blocks)
    return blocks


def _form_blocks(ctx: PassContext) -> list[GraphBlock]:
    fresh = [p for p in ctx.streamed if not ctx.in_store(p.param)]
    stored: dict[int, list[ParamInfo]] = {}
    for p in ctx.streamed:
        if ctx.in_store(p.param):
            stored.setdefault(ctx.runtime.store.entry(p.param).block, []).append(p)
    groups = [(None, g) for g in partition(fresh, ctx.budget)]
    groups += [(hb, ps) for hb, ps in stored.items()]
    groups.sort(key=lambda item: min(p.first for p in item[1]))
    return [GraphBlock(index=i, params=ps, host_block=hb) for i, (hb, ps) in enumerate(groups)]


def partition_blocks(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    k = ctx.config.num_slots
    while True:
        blocks = _form_blocks(ctx)
        # Block g + k reuses block g's slot: it may only be first read after g's last read.
        late = [p for g in range(len(blocks) - k) for p in blocks[g].params
                if p.last >= blocks[g + k].first]
        if not late:
            break
        for p in late:
            p.reason = f"read while {k} later blocks are live (num_slots={k})"
        ctx.streamed = [p for p in ctx.streamed if p.reason is None]
        ctx.resident = [p for p in ctx.params if p.reason is not None]
    ctx.blocks = blocks
    return gm

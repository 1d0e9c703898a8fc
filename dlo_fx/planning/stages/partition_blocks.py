"""Planning stage 4: partition the streamed parameters into blocks sized by their footprint.

Parameters are taken in first-use order and grouped into layers, then packed whole into
blocks within the budget (`dlo_fx.planning.blocks`, see [Note: blocks by footprint]): natural
layers (``blocks.<i>``) where they exist; a module that holds most of the streamed bytes
without being an indexed layer (a ``ModuleDict`` with word keys, attribute layers, one
wrapping container) is split into its submodules. A layer larger than the budget is split
at leaf-module boundaries; a parameter larger than the budget gets a block of its own.

Parameters already in the host store (loaded, or seen by an earlier graph) keep their host
block: a graph block is then the set of this graph's parameters in that host block. Every
block records why it ends where it does (``blocks.md`` shows it).

Before/after: no graph change; fills ``ctx.blocks`` from ``ctx.streamed``, ``ctx.budget``
and ``ctx.layers`` (set by `resident_set`).
"""

from __future__ import annotations

from torch import fx

from .context import PassContext


def partition_blocks(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    ctx.blocks = ctx.form_blocks(ctx.streamed, ctx.budget, ctx.layers)
    return gm

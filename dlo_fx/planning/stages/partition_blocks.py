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

``partition_blocks(view, residency) -> tuple[GraphBlock, ...]``: the blocks of
``residency.streamed`` within its block budget and layers (set by `resident_set`).
"""

from __future__ import annotations

from typing import Optional

from ..view import StoreView
from .plan import GraphBlock, form_blocks
from .resident_set import Residency


def partition_blocks(view: Optional[StoreView], residency: Residency) -> tuple[GraphBlock, ...]:
    return form_blocks(view, residency.streamed, residency.budget, residency.layers)

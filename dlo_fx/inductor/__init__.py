"""``compiler="inductor"``: Inductor compiles the compute between the schedule nodes.

The backend calls `compile_pieces` on the scheduled graph (after the passes, the commit to
the host store and the dump). It splits the graph into *pieces*, the runs of compute
between schedule nodes (see [Note: pieces] in partition.py), compiles each piece with
Inductor with its weights as plain inputs (see [Note: what a compiled piece may assume]
in pieces.py), and returns the forward of an *outer graph*: the scheduled graph's
placeholders and schedule nodes, unchanged and in the same order, calling the compiled
pieces in between. Dumps, traces and the runtime see the same schedule as with
``compiler="eager"``.

Identical pieces share one compiled callable (every layer of a DiT runs the same
pieces), and a piece that only moves data (views, copies, dtype conversions) runs
uncompiled.

| file | what it holds |
| --- | --- |
| partition.py | which nodes form a piece, its inputs and outputs, the outer graph |
| pieces.py | fake example inputs, the reuse key and cache, Inductor compilation, `CompiledPiece` |
| (torch_private.py) | Python floats Dynamo passes as tensors (``dynamic=True``), specialized before compiling: [Note: tensorified floats] |
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from torch import fx

from .. import torch_private
from .partition import Piece, find_pieces, outer_graph, piece_graph
from .pieces import STATS, CompiledPiece, clear_cache, compile_piece, example_inputs

log = logging.getLogger(__name__)


def compile_pieces(gm: fx.GraphModule, example_inputs_: Sequence[Any], ctx: Any) -> Callable:
    """Compile the compute of the scheduled graph ``gm`` with Inductor, piece by piece.

    ``example_inputs_`` are the graph's inputs as Dynamo passed them to the backend (only
    used to find Dynamo's fake mode); ``ctx`` is the graph's `GraphPlan`. Returns the
    outer graph's ``forward`` (the module is its ``__self__``): call it with the graph's
    inputs, like the callable any torch.compile backend returns.
    """
    fake_mode = torch_private.graph_fake_mode(gm, example_inputs_)
    pieces = find_pieces(gm.graph)
    modules: dict[str, CompiledPiece] = {}
    local: dict = {}  # pieces with symbolic sizes: reused within this graph only
    for piece in pieces:
        sub = piece_graph(piece, gm)
        modules[piece.name] = compile_piece(piece, sub, example_inputs(piece, fake_mode), local)
    outer = outer_graph(gm, pieces, modules)
    reused = sum(m.reused for m in modules.values())
    views = sum(not m.compiled for m in modules.values())
    log.info("dlo: %d pieces between the schedule nodes of a graph of %d blocks: %d compiled "
             "by Inductor, %d reused an identical piece, %d only move data",
             len(pieces), len(getattr(ctx, "blocks", ())), len(pieces) - reused - views,
             reused, views)
    return outer.forward


__all__ = ["CompiledPiece", "Piece", "STATS", "clear_cache", "compile_pieces", "find_pieces"]

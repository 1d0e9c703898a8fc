"""Split a scheduled graph into compute pieces and an outer graph that keeps the schedule.

[Note: pieces]
A piece never moves a compute node across a schedule node. A *piece* is a maximal run of
compute nodes between two nodes that must stay in the outer graph: the schedule nodes
(``node.meta["dlo"]``: prefetch, allgather, wait, slot_view, swap_slot, resident),
grad-mode switches, and nodes a user pass inserted that Dynamo never traced (a plain Python
function with no ``example_value``: it must run on every call, not once while Inductor
traces). Placeholders and ``get_attr`` are inputs of the outer graph and cut nothing.
Cutting only there keeps every compute node on the same side of every schedule node as in
the scheduled graph, so the program order the schedule relies on (``wait`` before the
first read of a slot, ``swap_slot`` after the last) is unchanged::

    prefetch_b1 = prefetch(_dlo, 1, ...)          prefetch_b1 = prefetch(_dlo, 1, ...)
    wait_b1 = wait(_dlo, 1)                        wait_b1 = wait(_dlo, 1)
    w = slot_view(_dlo, 1, wait_b1, p)      ->     w = slot_view(_dlo, 1, wait_b1, p)
    y = linear(x, w)                               piece_3 = self.piece_3(x, w)
    z = gelu(y)                                    z = piece_3[0]
    swap_slot_b1 = swap_slot(_dlo, 1)              swap_slot_b1 = swap_slot(_dlo, 1)

Where the cuts fall depends only on where the ``wait`` and ``swap_slot`` nodes are (a
``prefetch``/``allgather`` always follows a ``swap_slot`` or opens the graph), so
``num_slots``, the mode and dp do not move them: the pieces, and so Inductor's fusion and
rounding, are the same across slot counts, modes and dp sizes. The block budget does move
them.

Weights enter a piece as ordinary inputs (the ``slot_view`` outputs): a piece never holds
a weight, its data or its address. A ``getitem`` of a node whose value is a tuple
(``unbind``, ``chunk``, ``size()``) joins its producer's piece, so only tensors and
numbers cross piece boundaries. A piece receives every size symbol its values mention
(the ``SymInt`` placeholders Dynamo lifts), as ``split_module`` does, and recomputes a
number another piece computed (``eps.item()``, ``x.size(1) * 2``, an element of a
symbolic ``x.size()``) from that piece's inputs instead of receiving it: Inductor cannot
take an unbacked number or a ``torch.Size`` as an input.
An autocast region that a cut splits is re-entered in every piece it covers: such a piece
opens a copy of each region still open where it starts and closes what is still open
where it ends (``split_module`` does the same), so Inductor traces its ops under autocast.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

from .. import torch_private
from ..runtime import SCHEDULE_OPS

#: Grad-mode switches stay in the outer graph (they set the mode the pieces run in).
_GRAD_MODE = torch_private.GRAD_MODE_TARGETS


@dataclass(eq=False)
class Piece:
    """One run of compute nodes, compiled as a unit."""

    index: int
    nodes: list[fx.Node] = field(default_factory=list)
    inputs: list[fx.Node] = field(default_factory=list)  # what it reads from elsewhere
    outputs: list[fx.Node] = field(default_factory=list)  # what is read elsewhere
    recomputed: list[fx.Node] = field(default_factory=list)  # numbers of other pieces
    autocast: list[fx.Node] = field(default_factory=list)  # regions open at its start

    @property
    def name(self) -> str:
        return f"piece_{self.index}"


# -- predicates ------------------------------------------------------------------------
def is_schedule_node(node: fx.Node) -> bool:
    """A node the `dlo` schedule inserted (it carries ``meta["dlo"]``)."""
    return "dlo" in node.meta or (node.op == "call_function" and node.target in SCHEDULE_OPS)


def is_traced_compute(node: fx.Node) -> bool:
    """A tensor computation Inductor can compile (Dynamo traced it, or it is an operator)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if is_schedule_node(node) or node.target in _GRAD_MODE:
        return False
    if "example_value" in node.meta or node.op == "call_method":
        return True
    # Dynamo leaves no example_value on some in-place operators (``setitem``); a plain
    # Python function a user pass inserted has none either and must run eagerly.
    module = getattr(node.target, "__module__", None) or ""
    return module.split(".")[0] in ("torch", "_operator", "operator")


_MOVES_METHODS = frozenset({
    "view", "reshape", "permute", "transpose", "t", "flatten", "unflatten", "unsqueeze",
    "squeeze", "expand", "contiguous", "split", "split_with_sizes", "chunk", "unbind",
    "narrow", "size", "dim", "to", "float", "half", "bfloat16", "double", "type_as",
})
_MOVES_FUNCTIONS = frozenset({
    operator.getitem, torch.reshape, torch.permute, torch.transpose, torch.flatten,
    torch.unflatten, torch.unsqueeze, torch.squeeze, torch.split, torch.chunk, torch.unbind,
    torch.narrow,
})


def moves_data_only(node: fx.Node) -> bool:
    """A view, a copy or a dtype conversion: the same bits whoever computes it."""
    if node.op == "call_method":
        return node.target in _MOVES_METHODS
    return node.op == "call_function" and node.target in _MOVES_FUNCTIONS


def is_autocast_enter(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.amp._enter_autocast


def is_autocast_exit(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.amp._exit_autocast


def is_multi_value(node: fx.Node) -> bool:
    """The node's value is a tuple/list (``unbind``, ``size()``): it cannot cross a cut."""
    value = node.meta.get("example_value")
    return isinstance(value, (tuple, list))


# -- partitioning ----------------------------------------------------------------------
def find_pieces(graph: fx.Graph) -> list[Piece]:
    """Assign every compute node of ``graph`` to a piece and find each piece's inputs
    and outputs. See [Note: pieces]."""
    piece_of: dict[fx.Node, Piece] = {}
    pieces: list[Piece] = []
    current: Optional[Piece] = None
    autocast: list[fx.Node] = []  # open autocast regions
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue  # inputs of the outer graph: they do not cut a piece
        if not is_traced_compute(node):
            current = None
            continue
        open_before = list(autocast)
        if is_autocast_enter(node):
            autocast.append(node)
        elif is_autocast_exit(node) and autocast:
            autocast.pop()
        source = node.args[0] if node.args else None
        if (node.target is operator.getitem and isinstance(source, fx.Node)
                and source in piece_of and is_multi_value(source)):
            piece = piece_of[source]  # a getitem stays with the tuple it reads
        else:
            if current is None:
                current = Piece(index=len(pieces), autocast=open_before)
                pieces.append(current)
            piece = current
        piece.nodes.append(node)
        piece_of[node] = piece

    symbols = _symbol_providers(graph)
    for piece in pieces:
        _find_inputs(piece, piece_of, symbols)
    needed = {n for p in pieces for n in p.inputs}
    needed |= {a for n in graph.nodes if n not in piece_of for a in n.all_input_nodes}
    for piece in pieces:
        piece.outputs = [n for n in piece.nodes if n in needed]
    return pieces


def _find_inputs(piece: Piece, piece_of: dict[fx.Node, Piece], symbols: dict) -> None:
    """Inputs of ``piece``: what its nodes read from elsewhere, and the size symbols its
    values mention. A number computed by another piece (``x.item()``, ``x.size(1) * 2``)
    is recomputed here rather than passed, and so is the size it was read from (``s =
    x.size()`` there, ``s[1]`` here): Inductor binds numbers from its own inputs."""
    members = set(piece.nodes)
    inputs: dict[fx.Node, None] = {}

    def visit(arg: fx.Node, user: fx.Node) -> None:
        if arg in members or arg in piece.autocast:  # an open region is re-entered here
            return
        if arg in piece_of and _is_number(arg):
            members.add(arg)
            for a in arg.all_input_nodes:
                visit(a, arg)
            piece.recomputed.append(arg)  # after its own inputs: topological order
            return
        _check_crossing(arg, user)
        inputs.setdefault(arg)

    for node in piece.nodes:
        for arg in node.all_input_nodes:
            visit(arg, node)
    while True:  # a recomputed number may mention further symbols
        before = (len(inputs), len(piece.recomputed))
        for sym_node in _needed_symbols(piece, list(inputs), symbols):
            visit(sym_node, piece.nodes[0])
        if (len(inputs), len(piece.recomputed)) == before:
            break
    piece.inputs = list(inputs)


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_NUMBERS = (*_SYMBOLIC, int, float, bool)


def _is_number(node: fx.Node) -> bool:
    """A symbolic number, or a tuple of numbers with a symbolic one (``x.size()`` with
    dynamic shapes): recomputed by the piece that reads it (see `_find_inputs`)."""
    value = node.meta.get("example_value")
    if isinstance(value, (tuple, list)):
        return (any(isinstance(v, _SYMBOLIC) for v in value)
                and all(isinstance(v, _NUMBERS) for v in value))
    return isinstance(value, _SYMBOLIC)


_CROSSING = (torch.Tensor, *_NUMBERS)


def _check_crossing(node: fx.Node, user: fx.Node) -> None:
    """Only tensors and numbers may flow from one piece to another."""
    if "example_value" in node.meta and not isinstance(node.meta["example_value"], _CROSSING):
        kind = type(node.meta["example_value"]).__name__
        raise NotImplementedError(
            f"node {node.name!r} has a {kind} value that {user.name!r} reads across a dlo "
            "schedule node; only tensors and numbers can cross. Use options="
            "{'compiler': 'eager'} for this model, or unpack the value before the block")


def _symbol_providers(graph: fx.Graph) -> dict[Any, fx.Node]:
    """Symbol -> the first node whose value is exactly that ``SymInt`` (placeholders first)."""
    import sympy

    found: dict[Any, fx.Node] = {}
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, (torch.SymInt, torch.SymFloat)):
            expr = value.node.expr
            if isinstance(expr, sympy.Symbol) and expr not in found:
                found[expr] = node
    return found


def free_symbols_of(value: Any) -> set:
    from torch.fx.experimental.symbolic_shapes import free_symbols

    if isinstance(value, (torch.Tensor, *_SYMBOLIC)):
        return set(free_symbols(value))
    if isinstance(value, (tuple, list)):
        out: set = set()
        for v in value:
            out |= free_symbols_of(v)
        return out
    return set()


def _needed_symbols(piece: Piece, inputs: list[fx.Node], providers: dict) -> list[fx.Node]:
    needed: set = set()
    for node in (*inputs, *piece.recomputed, *piece.nodes):
        needed |= free_symbols_of(node.meta.get("example_value"))
    return [providers[s] for s in sorted(needed, key=str) if s in providers]


# -- graphs ------------------------------------------------------------------------------
def piece_graph(piece: Piece, owner: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule computing ``piece``: its inputs become placeholders, it returns a
    tuple of its outputs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in piece.inputs:
        ph = graph.placeholder(node.name)
        value = node.meta.get("example_value")
        if value is not None:
            ph.meta["example_value"] = value
        env[node] = ph
    root: dict[str, Any] = {}
    open_regions = list(piece.autocast)
    for enter in piece.autocast:  # re-enter the regions open where the piece starts
        env[enter] = graph.node_copy(enter, lambda n: env[n])
    for node in (*piece.recomputed, *piece.nodes):
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.op == "call_module":
            root[node.target] = owner.get_submodule(node.target)
        if is_autocast_enter(node):
            open_regions.append(node)
        elif is_autocast_exit(node) and open_regions:
            open_regions.pop()
    for enter in reversed(open_regions):  # close what is still open where it ends
        graph.call_function(torch.amp._exit_autocast, (env[enter],))
    graph.output(tuple(env[n] for n in piece.outputs))
    return fx.GraphModule(root, graph, class_name=f"DLOPiece{piece.index}")


def outer_graph(gm: fx.GraphModule, pieces: list[Piece],
                modules: dict[str, torch.nn.Module]) -> fx.GraphModule:
    """The scheduled graph with every piece replaced by one ``call_module`` of
    ``modules[piece.name]``; schedule nodes and placeholders are copied as they are."""
    piece_of = {n: p for p in pieces for n in p.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    emitted: set[int] = set()
    root: dict[str, Any] = dict(modules)
    for node in gm.graph.nodes:  # inputs first: a piece may read a later get_attr
        if node.op in ("placeholder", "get_attr"):
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.op == "get_attr":
                root[node.target] = _attr(gm, node.target)
    for node in gm.graph.nodes:
        if node in env:
            continue
        piece = piece_of.get(node)
        if piece is None:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.op == "call_module":
                root[node.target] = gm.get_submodule(node.target)
            continue
        if piece.index in emitted:
            continue
        emitted.add(piece.index)
        call = graph.create_node("call_module", piece.name, tuple(env[n] for n in piece.inputs),
                                 name=piece.name)
        call.meta["dlo_piece"] = {"index": piece.index, "nodes": len(piece.nodes),
                                  "outputs": [n.name for n in piece.outputs]}
        for i, out in enumerate(piece.outputs):
            # keep the scheduled graph's names, so the outer graph reads like it
            item = graph.create_node("call_function", operator.getitem, (call, i), name=out.name)
            if "example_value" in out.meta:
                item.meta["example_value"] = out.meta["example_value"]
            env[out] = item
    return fx.GraphModule(root, graph, class_name="DLOInductorGraph")


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj

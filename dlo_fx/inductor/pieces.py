"""Compile one piece with Inductor, and reuse a compiled piece for every identical piece.

[Note: what a compiled piece may assume]
A compiled piece assumes nothing of a weight but its size, strides and dtype: it reads
whatever tensor it is given on each call. A piece is compiled by
``torch._inductor.compile_fx.compile_fx`` (AOTAutograd, then Inductor), exactly as
``backend="inductor"`` compiles a whole graph, from fake example inputs built here:

- Weights (``slot_view`` / ``resident`` outputs) are fresh fake tensors with the
  parameter's shape, strides and dtype, storage offset 0, not ``requires_grad`` and not
  aliasing anything. They are graph *inputs*, never constants: pieces compile with
  ``freezing`` and ``triton.cudagraphs`` off, so nothing is folded or prepacked from their
  values and no address is recorded (the runtime re-creates and caches slot views per
  (slot, parameter), and one graph serves every layer of the same shape).
- Inductor checks size, strides and dtype on every call (the generated
  ``assert_size_stride``), and, on GPUs, assumes 16-byte alignment of the data pointer,
  which a storage offset of 0 lets it; it checks that at run time and copies a misaligned
  input, so correctness never depends on it, speed does. Slot views start at a multiple of
  ``alignment`` (>= 16, default 256) bytes inside a slot buffer that the allocator aligns,
  so no weight is ever copied.
- Other inputs keep Dynamo's fake values, so aliasing between them (views of one tensor)
  and their symbolic sizes are what AOTAutograd sees; an input given twice is passed as an
  alias, never deduplicated.

Identical pieces (every transformer layer's, every slot count's and every mode's) share
one compiled callable: the key is the piece's code with node names replaced by positions,
its inputs' metadata, grad mode, the intra-op thread count and the Inductor/AOTAutograd
configuration. A piece without symbolic sizes is kept in a process-wide LRU; a piece with
symbolic sizes is reused only within the graph being compiled (its symbols belong to that
graph's shape environment).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx

from .. import torch_private
from .partition import Piece, free_symbols_of, moves_data_only

log = logging.getLogger(__name__)

CACHE_SIZE = 512
_CACHE: "collections.OrderedDict[tuple, Callable]" = collections.OrderedDict()
_LOCK = threading.Lock()
STATS: collections.Counter = collections.Counter()
"""``compiled``: pieces Inductor compiled; ``reused``: pieces served by an identical one;
``views``: pieces that only move data, run uncompiled."""


def clear_cache() -> None:
    """Forget every compiled piece kept for reuse (and the counters)."""
    with _LOCK:
        _CACHE.clear()
        STATS.clear()


class CompiledPiece(torch.nn.Module):
    """A piece in the outer graph: called with the piece's inputs, returns the tuple of
    its outputs. Holds no tensors. ``compiled`` is False for a piece that only moves data
    (views, copies, dtype conversions), which runs as its FX graph: there is nothing to
    fuse, and its bits are the same either way."""

    def __init__(self, fn: Callable, piece: Piece, key_hash: int, reused: bool,
                 compiled: bool = True) -> None:
        super().__init__()
        self.fn = fn
        self.num_nodes = len(piece.recomputed) + len(piece.nodes)
        self.num_inputs = len(piece.inputs)
        self.key_hash = key_hash
        self.reused = reused
        self.compiled = compiled

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)

    def extra_repr(self) -> str:
        how = ("inductor" + (", reused" if self.reused else "")) if self.compiled else "views"
        return (f"{how}, nodes={self.num_nodes}, inputs={self.num_inputs}, "
                f"key={self.key_hash & 0xFFFFFFFF:08x}")


# -- example inputs ----------------------------------------------------------------------
def _weight_source(node: fx.Node) -> Optional[fx.Node]:
    """The parameter placeholder a ``slot_view``/``resident`` node (or the cast after a
    slot view of a parameter stored in another dtype) stands for."""
    meta = node.meta.get("dlo", {})
    if meta.get("kind") == "slot_view":
        return node.args[3]
    if meta.get("kind") == "cast":  # a stored dtype's cast: the parameter's own metadata
        return node.args[0].args[3]
    if meta.get("kind") == "resident":
        return node.args[1]
    return None


def example_inputs(piece: Piece, fake_mode: Any) -> list[Any]:
    """Fake values to compile ``piece`` with. See [Note: what a compiled piece may assume]."""
    values: list[Any] = []
    seen: set[int] = set()
    for node in piece.inputs:
        source = _weight_source(node)
        if source is not None:
            ref = source.meta.get("example_value")
            if not isinstance(ref, torch.Tensor):
                raise ValueError(f"parameter placeholder {source.name!r} read by {node.name!r} "
                                 "has no fake example_value; it was not traced by Dynamo")
            with fake_mode:
                value = torch.empty_strided(ref.shape, ref.stride(), dtype=ref.dtype,
                                            device=ref.device)
        elif "example_value" in node.meta:
            value = node.meta["example_value"]
            if isinstance(value, torch.Tensor) and torch_private.fake_mode_of(value) is None:
                value = fake_mode.from_tensor(value)  # a real constant (get_attr)
            elif isinstance(value, torch.Tensor) and id(value) in seen:
                with fake_mode:  # the same tensor read twice: pass an alias of it
                    value = torch.ops.aten.alias.default(value)
        elif node.op == "get_attr":
            value = fake_mode.from_tensor(_get_attr(node))
        else:
            raise ValueError(
                f"node {node.name!r} ({node.op} {node.target}) feeds a compiled piece but has "
                "no example_value; a user pass that adds tensor nodes must set "
                "node.meta['example_value'] (e.g. with FakeTensorProp), or use "
                "options={'compiler': 'eager'}")
        if isinstance(value, torch.Tensor):
            seen.add(id(value))
        values.append(value)
    return values


def _get_attr(node: fx.Node) -> torch.Tensor:
    obj: Any = node.graph.owning_module
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj


# -- the key of a piece --------------------------------------------------------------------
def _const(value: Any, shared: list[bool]) -> Any:
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_const(v, shared) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _const(v, shared)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _const((value.start, value.stop, value.step), shared))
    if value is None or isinstance(value, (bool, int, float, complex, str, torch.dtype,
                                           torch.device, torch.layout, torch.memory_format)):
        return (type(value).__name__, repr(value))
    if value is Ellipsis:
        return ("...",)
    shared[0] = False  # an object we cannot compare by value: key by identity, locally
    return ("id", id(value))


def _tensor_meta(value: torch.Tensor, storages: dict) -> tuple:
    storage = storages.setdefault(torch_private.storage_key(value), len(storages))
    return ("t", tuple(map(str, value.shape)), tuple(map(str, value.stride())),
            str(value.storage_offset()), value.dtype, str(value.device),
            value.requires_grad, storage)


def piece_key(piece: Piece, inputs: Sequence[Any]) -> tuple[tuple, bool]:
    """(key, shareable): equal keys compute the same function of their inputs;
    ``shareable`` is False when the key is only meaningful within this graph."""
    shared = [not any(free_symbols_of(v) for v in inputs)]
    storages: dict = {}
    index: dict[fx.Node, tuple] = {n: ("in", i) for i, n in enumerate(piece.inputs)}
    index.update({n: ("autocast", i) for i, n in enumerate(piece.autocast)})
    parts: list = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            parts.append(_tensor_meta(value, storages))
        elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            parts.append(("sym", str(value.node.expr)))
        else:
            parts.append(_const(value, shared))
    for i, node in enumerate((*piece.recomputed, *piece.nodes)):
        if free_symbols_of(node.meta.get("example_value")):
            shared[0] = False
        if node.op == "call_method":
            target: Any = ("method", node.target)
        elif node.op == "call_module":
            target = ("module", id(node.graph.owning_module.get_submodule(node.target)))
            shared[0] = False
        else:
            target = (getattr(node.target, "__module__", None),
                      getattr(node.target, "__qualname__", repr(node.target)), id(node.target))
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: ("node", index[n]))
        parts.append((node.op, target, _const(args, shared)))
        index[node] = ("n", i)
    parts.append(("out", tuple(index[n] for n in piece.outputs)))
    parts.append(("autocast", tuple(_const(e.args, shared) for e in piece.autocast)))
    parts.append(("ctx", torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                  torch.get_num_threads(), torch_private.inductor_config_key()))
    return tuple(parts), shared[0]


# -- compiling -----------------------------------------------------------------------------
def compile_piece(piece: Piece, gm: fx.GraphModule, inputs: list[Any],
                  local: dict) -> CompiledPiece:
    """Inductor-compile ``gm`` (the graph of ``piece``), or reuse an identical piece."""
    if all(moves_data_only(n) for n in (*piece.recomputed, *piece.nodes)):
        STATS["views"] += 1
        return CompiledPiece(gm, piece, 0, reused=False, compiled=False)
    key, shareable = piece_key(piece, inputs)
    cache = _CACHE if shareable else local
    with _LOCK:
        fn = cache.get(key)
        if fn is not None and shareable:
            _CACHE.move_to_end(key)
    reused = fn is not None
    if fn is None:
        fn = torch_private.inductor_compile(gm, inputs)
        with _LOCK:
            cache[key] = fn
            if shareable and len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
    STATS["reused" if reused else "compiled"] += 1
    log.debug("dlo inductor: %s %s (%d nodes, %d inputs)", "reused" if reused else "compiled",
              piece.name, len(piece.nodes), len(piece.inputs))
    return CompiledPiece(fn, piece, hash(key), reused)


__all__ = ["CompiledPiece", "STATS", "clear_cache", "compile_piece", "example_inputs",
           "piece_key"]

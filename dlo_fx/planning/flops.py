"""FLOPs of the matrix products of an FX graph, from the shapes Dynamo recorded.

The device budget (`dlo_fx.planning.budget`) needs each block's compute time before the first
call; this counts the floating-point operations of the nodes of the graph Dynamo hands
the backend and `dlo_fx.planning.stages.resident_set` divides them by a measured matmul rate.

What is counted, 2 FLOPs per multiply-add: linear layers (``torch._C._nn.linear``,
``F.linear``), matrix products (``torch.matmul``, ``@``, ``mm``, ``bmm``, ``addmm``,
``baddbmm``, as functions or tensor methods), ``F.scaled_dot_product_attention`` (the
two products ``QK^T`` and ``PV``; a causal mask is not halved) and convolutions
(``conv1d/2d/3d``, transposed ones, ``torch.convolution``), with their ATen overloads
for graphs of ATen ops. Nothing else: norms, softmax, activations, additions and bias
terms are memory-bound and left out, so the count is that of the work a matmul rate
describes. Shapes come from each node's fake tensor (``node.meta["example_value"]`` from
Dynamo, ``"val"`` from AOT/export); a symbolic size counts at its hint (no guard is
added); a node without shapes counts 0.

    linear(x, w)   x: (2, 16, 64), w: (256, 64) -> out (2, 16, 256):
                   2 * (2 * 16 * 256) * 64 = 1,048,576 FLOPs
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import fx

from ..torch_private import NN_LINEAR

try:  # a SymInt's hint, read without adding a guard
    from torch.fx.experimental.symbolic_shapes import optimization_hint as _hint
except ImportError:  # torch 2.11 and older: the same reading under its older name
    from torch.fx.experimental.symbolic_shapes import size_hint as _hint

__all__ = ["node_flops", "node_dtype", "graph_flops"]


def _int(n: Any) -> int:
    if isinstance(n, int):
        return n
    try:
        return int(_hint(n, fallback=1))
    except Exception:  # no hint at all (unbacked): counted as 1
        return 1


def _value(arg: Any) -> Any:
    """The fake tensor (or value) behind an argument: a node's recorded value."""
    if isinstance(arg, fx.Node):
        meta = arg.meta
        return meta["example_value"] if "example_value" in meta else meta.get("val")
    return arg


def _shape(arg: Any) -> Optional[tuple[int, ...]]:
    value = _value(arg)
    if isinstance(value, torch.Tensor):
        return tuple(_int(s) for s in value.shape)
    return None


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _arg(node: fx.Node, index: int, name: str) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name)


# -- one formula per kind of op: (node, output shape) -> FLOPs ------------------------------
def _contract(first: int, name: str) -> Callable[[fx.Node, tuple[int, ...]], int]:
    """A product whose output elements each sum over the last dimension of argument
    ``first`` (matmul, mm, bmm, linear; addmm and baddbmm from their second argument)."""

    def flops(node: fx.Node, out: tuple[int, ...]) -> int:
        a = _shape(_arg(node, first, name))
        return 2 * _numel(out) * a[-1] if a else 0

    return flops


def _attention(node: fx.Node, out: tuple[int, ...]) -> int:
    q, k = _shape(_arg(node, 0, "query")), _shape(_arg(node, 1, "key"))
    if not q or not k or len(out) < 2:
        return 0
    length, ev = out[-2], out[-1]
    batch_heads = _numel(out) // max(length * ev, 1)
    return 2 * batch_heads * length * k[-2] * (q[-1] + ev)  # Q K^T, then P V


def _convolution(node: fx.Node, out: tuple[int, ...]) -> int:
    w = _shape(_arg(node, 1, "weight"))
    return 2 * _numel(out) * (_numel(w) // w[0]) if w and w[0] else 0


def _transposed_convolution(node: fx.Node, out: tuple[int, ...]) -> int:
    x, w = _shape(_arg(node, 0, "input")), _shape(_arg(node, 1, "weight"))
    return 2 * _numel(x) * (_numel(w) // w[0]) if x and w and w[0] else 0


def _aten_convolution(node: fx.Node, out: tuple[int, ...]) -> int:
    transposed = _arg(node, 6, "transposed")
    return (_transposed_convolution if transposed else _convolution)(node, out)


def _targets() -> dict[Any, Callable[[fx.Node, tuple[int, ...]], int]]:
    aten = torch.ops.aten
    matmul, mm_add = _contract(0, "input"), _contract(1, "mat1")
    table: dict[Any, Callable] = {
        NN_LINEAR: matmul, F.linear: matmul,
        torch.matmul: matmul, operator.matmul: matmul, torch.mm: matmul, torch.bmm: matmul,
        torch.addmm: mm_add, torch.baddbmm: mm_add,
        F.scaled_dot_product_attention: _attention,
        torch.conv1d: _convolution, torch.conv2d: _convolution, torch.conv3d: _convolution,
        F.conv1d: _convolution, F.conv2d: _convolution, F.conv3d: _convolution,
        torch.conv_transpose1d: _transposed_convolution,
        torch.conv_transpose2d: _transposed_convolution,
        torch.conv_transpose3d: _transposed_convolution,
        F.conv_transpose1d: _transposed_convolution,
        F.conv_transpose2d: _transposed_convolution,
        F.conv_transpose3d: _transposed_convolution,
        torch.convolution: _aten_convolution,
        "matmul": matmul, "__matmul__": matmul, "mm": matmul, "bmm": matmul,  # methods
        "addmm": mm_add, "baddbmm": mm_add,
    }
    for name, fn in (("linear", matmul), ("matmul", matmul), ("mm", matmul), ("bmm", matmul),
                     ("addmm", mm_add), ("baddbmm", mm_add),
                     ("scaled_dot_product_attention", _attention),
                     ("_scaled_dot_product_flash_attention_for_cpu", _attention),
                     ("_scaled_dot_product_efficient_attention", _attention),
                     ("_scaled_dot_product_flash_attention", _attention),
                     ("_scaled_dot_product_cudnn_attention", _attention),
                     ("convolution", _aten_convolution)):
        packet = getattr(aten, name, None)  # some exist only in some builds
        if packet is not None:
            table[packet] = fn
            table[packet.default] = fn
    return table


_FORMULAS: Optional[dict] = None


def _formula(node: fx.Node) -> Optional[Callable[[fx.Node, tuple[int, ...]], int]]:
    global _FORMULAS
    if _FORMULAS is None:
        _FORMULAS = _targets()
    if node.op == "call_function":
        try:
            return _FORMULAS.get(node.target)
        except TypeError:  # an unhashable target
            return None
    if node.op == "call_method" and isinstance(node.target, str):
        return _FORMULAS.get(node.target)
    return None


def _output(node: fx.Node) -> Optional[torch.Tensor]:
    value = _value(node)
    if isinstance(value, (tuple, list)) and value:  # ATen attention: (out, logsumexp, ...)
        value = value[0]
    return value if isinstance(value, torch.Tensor) else None


def node_flops(node: fx.Node) -> int:
    """FLOPs of one node (0 for what is not a product of matrices, or has no shapes)."""
    formula = _formula(node)
    out = _output(node) if formula is not None else None
    if out is None:
        return 0
    return int(formula(node, tuple(_int(s) for s in out.shape)))


def node_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype a node's product runs in (its output's), None when it has none."""
    out = _output(node)
    return out.dtype if out is not None else None


def graph_flops(nodes: Iterable[fx.Node]) -> list[tuple[int, Optional[torch.dtype]]]:
    """``(FLOPs, dtype)`` of each node, in the order given (dtype None where FLOPs is 0)."""
    out = []
    for node in nodes:
        flops = node_flops(node)
        out.append((flops, node_dtype(node) if flops else None))
    return out

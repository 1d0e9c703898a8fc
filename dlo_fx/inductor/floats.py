"""Python floats that Dynamo passes to the graph as tensors (``dynamic=True``).

[Note: tensorified floats]
With ``dynamic=True`` (and ``torch._dynamo.config.specialize_float=False``, the default),
Dynamo passes Python floats, a module's float attributes (``LayerNorm.eps``) and float
arguments of ``forward`` alike, as 0-d float64 tensors and reads each with ``.item()``,
a backed ``SymFloat``. ``backend="inductor"`` compiles the whole graph: it turns the
float arithmetic it can into tensor arithmetic, and the rest (LayerNorm's eps, on which
Dynamo already guarded) it specializes, restarting Dynamo's analysis of the frame with
the float a constant checked by a guard (``tensorify_python_scalars``). A piece cannot
do either: Inductor traces it from its own inputs, where the ``.item()`` of such a tensor
is a data-dependent number, and the compile fails (``GuardOnDataDependentSymNode`` for
the eps, ``DataDependentOutputException`` for a float argument). So
`restart_with_floats_specialized` specializes every such float before anything is
compiled or stored, and Dynamo traces the frame again. Values are unchanged (the graph
reads the same float, as a constant); what differs from ``backend="inductor"`` is that a
float argument Inductor would keep symbolic is guarded on, so each new value compiles
the frame again, up to Dynamo's recompile limit (past it the frame runs eagerly, still
exact).
"""

from __future__ import annotations

import sympy
import torch
from torch import fx


def restart_with_floats_specialized(gm: fx.GraphModule) -> None:
    """Have Dynamo trace the frame again with ``gm``'s tensorified float inputs
    specialized, if any is not yet. See [Note: tensorified floats]."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch._subclasses.fake_tensor import FakeTensor

    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        memo = value.item_memo if isinstance(value, FakeTensor) else None
        if not isinstance(memo, torch.SymFloat):
            continue
        symbol = memo.node._expr  # the symbol itself, not what it was replaced by
        if isinstance(symbol, sympy.Symbol) and not TensorifyState.should_specialize(
                symbol.name):
            names.append(symbol.name)
    for name in names:
        TensorifyState.specialize(name)
    if names:
        raise TensorifyScalarRestartAnalysis

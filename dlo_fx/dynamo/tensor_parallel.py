"""A graph whose parameters are DTensors: each placeholder takes the parameter's local
tensor, and one node rebuilds the DTensor around what the schedule gives it.

See [Note: a tensor-parallel parameter streams its local shard] in
runtime/weights/tensor_parallel.py. Before/after, for a column-wise parallel linear::

    w = placeholder  # example: the DTensor parameter
    linear = linear(x, w, b)

    w = placeholder  # example: its local tensor, a StoredWeight (planned, streamed)
    w_dtensor = as_dtensor(w)  # AsDTensor(DTensorLayout(mesh, (Shard(dim=0),), (16, 8), (8, 1)))
    linear = linear(x, w_dtensor, b_dtensor)

The placeholder keeps its place and Dynamo's source (its FQN), so the planning stages
and the schedule see a graph of plain parameters; `insert_schedule` replaces the
placeholder's one use, the rewrap's input, by a slot view. The call hands each DTensor
argument's local tensor in its place (`local_args`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import fx

from ..planning.stages.identify_params import fqn_from_source
from ..runtime import DTensorLayout, refusal
from ..torch_private import dtensor_local


class AsDTensor:
    """The target of a graph's rewrap node: its argument in a DTensor of ``layout``. An
    object, not a function with the layout as an argument: FX writes a node's arguments
    into the graph's code by their repr, and its target as a global (the mesh has no repr
    that evaluates)."""

    __name__ = "as_dtensor"

    def __init__(self, layout: DTensorLayout):
        self.layout = layout

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        return self.layout.around(local)


def unwrap_dtensor_params(gm: fx.GraphModule, example_inputs: Sequence[Any]
                          ) -> tuple[list[Any], Callable[[Callable], Callable]]:
    """Rewrite ``gm`` in place so that every placeholder of a DTensor parameter takes its
    local tensor (the module docstring); return the example inputs with those local
    tensors in place and the wrapper that makes a call hand them over. A graph without
    DTensor parameters is left as it is (the wrapper returns the call itself).
    ValueError, naming the parameter, for one dlo cannot stream (`refusal`)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    inputs = list(example_inputs)
    positions = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        local = dtensor_local(value)
        if local is None or not isinstance(value, torch.nn.Parameter):
            continue
        why = refusal(value, local.device)
        if why is not None:
            grapharg = node.meta.get("grapharg")
            fqn = fqn_from_source(grapharg.source.name) if grapharg is not None else node.name
            raise ValueError(f"dlo: parameter {fqn!r} {why}")
        fake = node.meta.get("example_value")
        with gm.graph.inserting_after(placeholders[-1]):
            rewrap = gm.graph.create_node("call_function", AsDTensor(DTensorLayout.of(value)),
                                          (node,), name=f"{node.name}_dtensor")
        rewrap.meta["example_value"] = fake
        node.replace_all_uses_with(rewrap, delete_user_cb=lambda user: user is not rewrap)
        node.meta["example_value"] = dtensor_local(fake) if fake is not None else None
        inputs[i] = local
        positions.append(i)
    if not positions:
        return inputs, lambda run: run
    gm.graph.lint()
    gm.recompile()
    return inputs, lambda run: local_args(run, positions)


def local_args(run: Callable, positions: Sequence[int]) -> Callable:
    """``run`` called with the local tensor of the DTensor at each of ``positions``."""
    at = frozenset(positions)

    def call(*args: Any) -> Any:
        return run(*(dtensor_local(a) if i in at else a for i, a in enumerate(args)))

    return call


__all__ = ["AsDTensor", "local_args", "unwrap_dtensor_params"]

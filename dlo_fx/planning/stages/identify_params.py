"""Planning stage 1: find the placeholders that carry parameters, and their FQNs.

Dynamo lifts parameters as graph inputs; ``node.meta["grapharg"].source`` names where the
value came from (``L['self']._modules['blocks']._modules['0']._parameters['weight']``) and
the example input *is* the ``nn.Parameter``. A parameter already in the host store keeps
the FQN it was stored under.

``identify_params(gm, example_inputs, view) -> tuple[ParamInfo, ...]``: one `ParamInfo` per
parameter placeholder (node, parameter, FQN, bytes of its storage span), in graph order::

    l_self_modules_blocks_modules_0_modules_qkv_parameters_weight_   # placeholder
    -> ParamInfo(fqn="blocks.0.qkv.weight", nbytes=24576)
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import fx

from ..view import StoreView
from .plan import ParamInfo

_KEY = re.compile(r"\.?(?:_modules|_parameters|_buffers)\['([^']*)'\]|\.([A-Za-z_]\w*)|\['?([^'\]]*)'?\]")


def fqn_from_source(name: str) -> str:
    """``L['self']._modules['blocks']._modules['0']._parameters['w']`` -> ``blocks.0.w``."""
    root = name.split("]", 1)[1] if name.startswith(("L[", "G[")) else name
    parts = []
    for m in _KEY.finditer(root):
        part = m.group(1) or m.group(2) or m.group(3)
        if part not in ("_modules", "_parameters", "_buffers", "__dict__"):
            parts.append(part)
    if parts:
        return ".".join(parts)
    local = re.match(r"[LG]\['([^']*)'\]", name)
    return local.group(1) if local else name


def is_param_placeholder(node: fx.Node, value: object) -> bool:
    return node.op == "placeholder" and isinstance(value, torch.nn.Parameter)


def param_placeholders(gm: fx.GraphModule, example_inputs: Sequence[Any]
                       ) -> Iterator[tuple[fx.Node, torch.nn.Parameter]]:
    """``(placeholder, parameter)`` of every placeholder that carries a parameter: the
    parameters a plan of ``gm`` needs in its `StoreView`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        value = example_inputs[i] if i < len(example_inputs) else None
        grapharg = node.meta.get("grapharg")
        if value is None and grapharg is not None:
            value = grapharg.example
        if is_param_placeholder(node, value):
            yield node, value


def identify_params(gm: fx.GraphModule, example_inputs: Sequence[Any],
                    view: Optional[StoreView]) -> tuple[ParamInfo, ...]:
    return tuple(_param_info(node, value, view)
                 for node, value in param_placeholders(gm, example_inputs))


def _param_info(node: fx.Node, value: torch.nn.Parameter,
                view: Optional[StoreView]) -> ParamInfo:
    grapharg = node.meta.get("grapharg")
    facts = view.facts(value) if view is not None else None
    if facts is None:
        raise RuntimeError(f"dlo: internal error: parameter placeholder {node.name!r} is "
                           "not in the plan's StoreView (the backend builds it from "
                           "every parameter among the example inputs)")
    if facts.fqn is not None:
        fqn = facts.fqn
    elif grapharg is not None:
        fqn = fqn_from_source(grapharg.source.name)
    else:
        fqn = node.name
    if facts.unstreamable is not None:  # see `dlo_fx.runtime.store_view.unstreamable`
        raise ValueError(f"dlo: parameter {fqn!r} {facts.unstreamable}")
    return ParamInfo(node=node, param=value, fqn=fqn, nbytes=facts.nbytes,
                     stored_as=facts.stored_as)

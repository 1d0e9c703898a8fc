"""Planning stage 1: find the placeholders that carry parameters, and their FQNs.

Dynamo lifts parameters as graph inputs; ``node.meta["grapharg"].source`` names where the
value came from (``L['self']._modules['blocks']._modules['0']._parameters['weight']``) and
the example input *is* the ``nn.Parameter``. A parameter already in the host store keeps
the FQN it was stored under.

Before/after: no graph change; fills ``ctx.params`` (one `ParamInfo` per parameter
placeholder: node, parameter, FQN, bytes of its storage span)::

    l_self_modules_blocks_modules_0_modules_qkv_parameters_weight_   # placeholder
    -> ParamInfo(fqn="blocks.0.qkv.weight", nbytes=24576)
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Sequence

import torch
from torch import fx

from .context import ParamInfo, PassContext

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


def identify_params(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node, value in param_placeholders(gm, ctx.example_inputs):
        grapharg = node.meta.get("grapharg")
        facts = ctx.view.facts(value) if ctx.view is not None else None
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
        ctx.params.append(ParamInfo(node=node, param=value, fqn=fqn, nbytes=facts.nbytes,
                                    stored_as=facts.stored_as))
    return gm

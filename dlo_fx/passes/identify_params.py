"""Pass 1: find the placeholders that carry parameters, and their FQNs.

Dynamo lifts parameters as graph inputs; ``node.meta["grapharg"].source`` names where the
value came from (``L['self']._modules['blocks']._modules['0']._parameters['weight']``) and
the example input *is* the ``nn.Parameter``. A parameter already in the host store keeps
the FQN it was stored under.

Before/after: fills ``ctx.params`` (one `ParamInfo` per parameter placeholder: node,
parameter, FQN, bytes of its storage span); the one graph change is that a stored GGUF
weight's ``as_tensor()`` call is replaced by the weight itself (`_inline_as_tensor`)::

    l_self_modules_blocks_modules_0_modules_qkv_parameters_weight_   # placeholder
    -> ParamInfo(fqn="blocks.0.qkv.weight", nbytes=24576)
"""

from __future__ import annotations

import re

import torch
from torch import fx

from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..runtime.layout import span_bytes
from ..runtime.stored import is_stored
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


def identify_params(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        value = ctx.example_inputs[i] if i < len(ctx.example_inputs) else None
        grapharg = node.meta.get("grapharg")
        if value is None and grapharg is not None:
            value = grapharg.example
        if not is_param_placeholder(node, value):
            continue
        entry = ctx.runtime.store.entry(value) if ctx.runtime is not None else None
        if entry is not None:
            fqn = entry.fqn
        elif grapharg is not None:
            fqn = fqn_from_source(grapharg.source.name)
        else:
            fqn = node.name
        check_streamable(value, fqn)
        _inline_as_tensor(gm, node)
        ctx.params.append(ParamInfo(node=node, param=value, fqn=fqn, nbytes=span_bytes(value)))
    return gm


def _inline_as_tensor(gm: fx.GraphModule, node: fx.Node) -> None:
    """``p.as_tensor()`` of a stored parameter (diffusers' GGUF dequantisation calls it on
    its ``GGUFParameter``s) is the parameter itself: Dynamo records it as a method call on
    the `StoredWeight` input, and the slot view that replaces the input has no such
    method."""
    for user in list(node.users):
        if user.op == "call_method" and user.target == "as_tensor" and user.args == (node,):
            user.replace_all_uses_with(node)
            gm.graph.erase_node(user)


def check_streamable(param: torch.Tensor, fqn: str) -> None:
    """ValueError for a parameter whose bytes are not its own storage: a tensor subclass
    that holds other tensors (torchao's quantized weights, DTensor), other than dlo's own
    `StoredWeight`. Its storage span says nothing about its data."""
    if is_traceable_wrapper_subclass(param) and not is_stored(param):
        kind = f"{type(param).__module__}.{type(param).__qualname__}"
        raise ValueError(
            f"dlo: parameter {fqn!r} is a {kind}, a tensor subclass whose data are other "
            "tensors (as torchao's quantized weights are); dlo does not stream such weights, "
            "and nothing was stored. Stream the unquantized weights (in bfloat16: "
            "dlo_fx.load(..., dtype=torch.bfloat16)), or run the quantized model without dlo "
            "(backend='inductor')")

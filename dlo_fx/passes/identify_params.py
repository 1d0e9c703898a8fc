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

import torch
from torch import fx

from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..runtime.layout import leaf_tensors, param_bytes, span_bytes, storage_dtype_of
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
        stored_as = storage_dtype_of(value)  # see [Note: a storage dtype] in runtime/layout.py
        if entry is not None:
            fqn = entry.fqn
            stored_as = entry.dtype if entry.compute_dtype is not None else None
        elif grapharg is not None:
            fqn = fqn_from_source(grapharg.source.name)
        else:
            fqn = node.name
        check_streamable(value, fqn)
        ctx.params.append(ParamInfo(node=node, param=value, fqn=fqn,
                                    nbytes=param_bytes(value, stored_as),
                                    stored_as=stored_as))
    return gm


def check_streamable(param: torch.Tensor, fqn: str) -> None:
    """ValueError for a parameter whose bytes dlo cannot lay out: a tensor subclass with no
    storage of its own that does not flatten into plain tensors (``__tensor_flatten__``),
    or a DTensor (already sharded by another framework). A traceable subclass made of plain
    tensors (torchao's quantized weights) streams as those tensors: see [Note: a quantized
    weight is its inner tensors] in runtime/layout.py."""
    if is_stored(param):
        return
    kind = f"{type(param).__module__}.{type(param).__qualname__}"
    if type(param).__name__ == "DTensor":
        raise ValueError(
            f"dlo: parameter {fqn!r} is a DTensor, sharded by torch.distributed already; dlo "
            "shards weights itself and nothing was stored. Compile the model with plain "
            "parameters (full_tensor() of each) and dlo's own shard_group")
    if not is_traceable_wrapper_subclass(param):
        if _has_storage(param):
            return
        raise ValueError(
            f"dlo: parameter {fqn!r} is a {kind}, a tensor subclass with no storage of its own "
            "that does not implement __tensor_flatten__/__tensor_unflatten__, so dlo cannot "
            "find its bytes, and nothing was stored. Make the subclass traceable (as torchao's "
            "are), or run the model without dlo")
    try:
        leaves = leaf_tensors(param)
    except Exception as exc:  # a flatten that fails, or names attributes it lacks
        raise ValueError(
            f"dlo: parameter {fqn!r} is a {kind} whose __tensor_flatten__ failed "
            f"({type(exc).__name__}: {exc}); dlo cannot lay out its inner tensors, and nothing "
            "was stored") from None
    bad = [x for x in leaves if is_traceable_wrapper_subclass(x) or not _has_storage(x)]
    if bad:
        raise ValueError(
            f"dlo: parameter {fqn!r} is a {kind} whose inner tensors include a "
            f"{type(bad[0]).__qualname__} without storage of its own; dlo streams subclasses "
            "made of plain tensors only, and nothing was stored")


def _has_storage(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are a storage of its own (a wrapper subclass has a storage
    object of the right size whose data pointer cannot be read)."""
    if t.numel() == 0:
        return True
    try:
        storage = t.untyped_storage()
        storage.data_ptr()
        return storage.nbytes() >= span_bytes(t)
    except (NotImplementedError, RuntimeError, TypeError):
        return False

"""Planning stage 2: first and last use of every parameter, counting uses of its aliases.

A parameter's slot may be refilled only after the last read of the parameter *or of any
view of it* (``w.t()``, ``w[0]``, a chunk). Aliases are found through the fake tensors
Dynamo recorded (``node.meta["example_value"]``): a node aliases a parameter when one of
its outputs shares the parameter's (fake) storage. Hand-built graphs without example
values fall back to a list of view operations.

Before/after: no graph change; fills ``ctx.order`` (node -> index), each parameter's
``first`` and ``last`` (-1 when the graph never reads it) and ``ctx.escaping`` (parameters
a view of which reaches the output)::

    wt = t(w); h = matmul(x, wt); ...; out = matmul(h, wt)   # w.first = t, w.last = out
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import fx

from ... import torch_private
from ...torch_private import tree_leaves
from ...runtime.view import FAKE_STAND_IN
from .context import ParamInfo, PassContext

_VIEW_NAMES = {
    "t", "transpose", "permute", "view", "reshape", "expand", "unsqueeze", "squeeze",
    "flatten", "unflatten", "chunk", "split", "narrow", "select", "getitem", "as_strided",
    "contiguous", "to", "type_as", "float", "half", "bfloat16", "detach", "view_as",
    "reshape_as", "expand_as", "unbind", "movedim", "swapaxes", "mT", "T",
}


def _storages(value: object) -> Iterator[int]:
    """The storage identities (`torch_private.storage_key`) of ``value``'s tensors. A fake
    stored weight stands for the fake tensor its traced ops read (`FAKE_STAND_IN`,
    runtime/weights/stored.py), whose storage its views share; where its ops made none, its own.
    A DTensor: its local tensor's."""
    for leaf in tree_leaves(value):
        local = torch_private.dtensor_local(leaf)
        if local is not None:  # a DTensor's views share its local tensor's storage
            yield from _storages(local)
        elif isinstance(leaf, torch.Tensor):
            for t in (vars(leaf).get(FAKE_STAND_IN), leaf):
                if t is None:
                    continue
                try:
                    yield torch_private.storage_key(t)
                except (NotImplementedError, RuntimeError):
                    continue


def _target_name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def use_intervals(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    nodes = list(gm.graph.nodes)
    ctx.order = {n: i for i, n in enumerate(nodes)}
    by_storage: dict[int, list[ParamInfo]] = {}
    alias_of: dict[fx.Node, list[ParamInfo]] = {}
    for info in ctx.params:
        alias_of[info.node] = [info]
        ev = info.node.meta.get("example_value")
        for ref in _storages(ev):
            by_storage.setdefault(ref, []).append(info)
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        owners: list[ParamInfo] = []
        for arg in node.all_input_nodes:
            for info in alias_of.get(arg, ()):
                info.first = ctx.order[node] if info.first < 0 else info.first
                info.last = ctx.order[node]
                owners.append(info)
        if not owners:
            continue
        ev = node.meta.get("example_value")
        if ev is not None:
            aliased = [i for ref in _storages(ev) for i in by_storage.get(ref, ())]
        else:
            aliased = owners if _target_name(node) in _VIEW_NAMES else []
        if aliased:
            alias_of[node] = list(dict.fromkeys(aliased))
    output = nodes[-1]
    ctx.escaping = {i.node for arg in output.all_input_nodes for i in alias_of.get(arg, ())}
    return gm

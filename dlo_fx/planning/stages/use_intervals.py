"""Planning stage 2: first and last use of every parameter, counting uses of its aliases.

A parameter's slot may be refilled only after the last read of the parameter *or of any
view of it* (``w.t()``, ``w[0]``, a chunk). Aliases are found through the fake tensors
Dynamo recorded (``node.meta["example_value"]``): a node aliases a parameter when one of
its outputs shares the parameter's (fake) storage. Hand-built graphs without example
values fall back to a list of view operations.

``use_intervals(gm, params) -> Uses``: the parameters with their ``first`` and ``last``
(node indices; -1 when the graph never reads it) and ``escaping`` (the placeholders a view
of which reaches the output)::

    wt = t(w); h = matmul(x, wt); ...; out = matmul(h, wt)   # w.first = t, w.last = out
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch
from torch import fx

from ... import torch_private
from ...torch_private import tree_leaves
from ..view import FAKE_STAND_IN
from .plan import ParamInfo

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


@dataclass(frozen=True)
class Uses:
    """What `use_intervals` found: ``params`` with their use intervals, and ``escaping``."""

    params: tuple[ParamInfo, ...]
    escaping: frozenset  # placeholders whose views reach the output


def use_intervals(gm: fx.GraphModule, params: Sequence[ParamInfo]) -> Uses:
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    first: dict[int, int] = {}  # by position in ``params``
    last: dict[int, int] = {}
    by_storage: dict[int, list[int]] = {}
    alias_of: dict[fx.Node, list[int]] = {}
    for k, info in enumerate(params):
        alias_of[info.node] = [k]
        ev = info.node.meta.get("example_value")
        for ref in _storages(ev):
            by_storage.setdefault(ref, []).append(k)
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        owners: list[int] = []
        for arg in node.all_input_nodes:
            for k in alias_of.get(arg, ()):
                first.setdefault(k, order[node])
                last[k] = order[node]
                owners.append(k)
        if not owners:
            continue
        ev = node.meta.get("example_value")
        if ev is not None:
            aliased = [k for ref in _storages(ev) for k in by_storage.get(ref, ())]
        else:
            aliased = owners if _target_name(node) in _VIEW_NAMES else []
        if aliased:
            alias_of[node] = list(dict.fromkeys(aliased))
    output = nodes[-1]
    escaping = frozenset(params[k].node for arg in output.all_input_nodes
                         for k in alias_of.get(arg, ()))
    return Uses(params=tuple(replace(p, first=first.get(k, -1), last=last.get(k, -1))
                             for k, p in enumerate(params)),
                escaping=escaping)

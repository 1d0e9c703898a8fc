"""One forward of a model on the meta device, recorded: the ATen graph it ran, where each
parameter is first read, and the activation peak, in seconds and without weights.

[Note: a forward planned on the meta device]
`dlo_fx.plan` needs what a compile learns of a model at given input shapes (the FLOPs of
each block's nodes and where each block is first read) and what the first call measures
(the activation peak), on a machine that has neither the target device nor the weights.
Dynamo's trace of a real DiT takes minutes on a CPU; an eager forward on the meta device
takes about two seconds for FLUX.1-dev (7,000 ATen ops, no values). So the forward runs
once under two modes:

- a `TorchDispatchMode` records every ATen op as a node of an `fx.Graph` whose
  ``meta["val"]`` is a meta tensor of the op's output: the FLOPs are the graph's, counted
  by the compile's own counter (`dlo_fx.planning.flops`), and a block's compute spans the
  nodes from its first read to the next block's (`planning.stages.resident_set.block_spans`),
  as at compile time;
- every storage an op creates is counted while it lives (a weak reference to the storage
  says when it dies): the peak of those bytes is the activation peak (fake-tensor memory;
  the parameters, buffers and inputs existed before the call and are not counted), which
  is what the auto budget measures on a device (the allocator's peak during the call minus
  what was allocated before it);
- a `TorchFunctionMode` answers ``F.scaled_dot_product_attention`` with its output alone
  (one node whose FLOPs are the two products), as the fused kernels of a device compute it:
  the meta device's math path would materialise the score matrix, which no GPU kernel dlo
  runs does (FLUX.1-dev at 1,024^2: 0.45 GiB predicted this way, 0.45 GiB measured on an
  H200, docs/benchmarks.md).

The model is called through ``torch.func.functional_call`` with meta copies of any real
parameters and buffers, so a real model is planned without being changed or copied.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from ...torch_private import TorchDispatchMode, tree_flatten, tree_map

__all__ = ["Forward", "trace_forward"]

_SDPA_ARGS = ("query", "key", "value")


@dataclass
class Forward:
    """What one meta forward showed: its graph (every ATen op, plus one node per attention),
    the indices of the first and the last node that read each parameter (by FQN; a
    parameter never read is absent), and the activation peak in bytes."""

    nodes: list[fx.Node]
    first_use: dict[str, int]
    last_use: dict[str, int]
    activation_peak: int


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not x.is_meta:
        return x.detach().to("meta")
    return x


class _Recorder(TorchDispatchMode):
    """The dispatch half of [Note: a forward planned on the meta device]."""

    def __init__(self, names: Mapping[int, str], existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self.node_of: dict[int, fx.Node] = {}
        self.names = names  # id of a parameter tensor -> FQN
        self.first_use: dict[str, int] = {}
        self.last_use: dict[str, int] = {}
        self.count = 0
        self.attention: Any = None  # (q, k, v) of the attention whose output comes next
        self.live = self.peak = 0
        self.counted: dict[int, int] = {id(t.untyped_storage()): 0 for t in existing}
        self.keep = [t.untyped_storage() for t in existing]  # their ids stay theirs

    def node(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        found = self.node_of.get(id(x))
        if found is None:
            found = self.graph.placeholder(f"t{len(self.node_of)}")
            found.meta["val"] = torch.empty(x.shape, dtype=x.dtype, device="meta")
            self.node_of[id(x)] = found
            self.count += 1
        fqn = self.names.get(id(x))
        if fqn is not None:
            self.first_use.setdefault(fqn, self.count)
            self.last_use[fqn] = self.count
        return found

    def record(self, target: Any, args: tuple, kwargs: dict, out: Any) -> None:
        node = self.graph.call_function(target, tree_map(self.node, args),
                                        tree_map(self.node, kwargs))
        first = next((o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)), None)
        if first is not None:
            node.meta["val"] = torch.empty(first.shape, dtype=first.dtype, device="meta")
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                self.node_of[id(o)] = node
        self.count += 1

    def allocated(self, out: Any) -> None:
        for o in tree_flatten(out)[0]:
            if not isinstance(o, torch.Tensor):
                continue
            storage = o.untyped_storage()
            key = id(storage)
            if key in self.counted:
                continue
            self.counted[key] = storage.nbytes()
            self.live += self.counted[key]
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.live -= self.counted.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        for a in flat:  # first reads in call order, before the op's own node
            if isinstance(a, torch.Tensor) and id(a) in self.names:
                self.node(a)
        out = func(*args, **kwargs)
        if self.attention is not None:  # the output `_Attention` asked for: the attention
            self.record(F.scaled_dot_product_attention, self.attention, {}, out)
            self.attention = None
        else:
            self.record(func, args, kwargs, out)
        self.allocated(out)
        return out


class _Attention(TorchFunctionMode):
    """The function half: ``F.scaled_dot_product_attention`` as a fused kernel runs it."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = (args[i] if len(args) > i else kwargs[n] for i, n in enumerate(_SDPA_ARGS))
        # recorded by the dispatch mode, whose ops make no tensor it would itself record
        self.recorder.attention = (q, k, v)
        return q.new_empty((*q.shape[:-1], v.shape[-1]))


def trace_forward(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> Forward:
    """Run ``model(*args, **kwargs)`` once on the meta device and record it (see [Note: a
    forward planned on the meta device]); the model is left as it was."""
    state = {n: _meta(t) for n, t in model.named_parameters(remove_duplicate=False)}
    names = {id(t): n for n, t in reversed(list(state.items()))}
    state.update({n: _meta(t) for n, t in model.named_buffers(remove_duplicate=False)})
    args = tuple(_meta(a) for a in args)
    kwargs = {k: _meta(v) for k, v in kwargs.items()}
    existing = [t for t in (*state.values(), *args, *kwargs.values())
                if isinstance(t, torch.Tensor)]
    recorder = _Recorder(names, existing)
    try:
        with torch.no_grad(), _Attention(recorder), recorder:
            out = torch.func.functional_call(model, state, args, kwargs)
            del out
    except Exception as exc:
        raise ValueError(
            f"dlo_fx.plan: {type(model).__name__}'s forward failed on the meta device with "
            f"the inputs given ({type(exc).__name__}: {exc}); give the inputs the forward "
            "takes (tensors, meta or real, or its keyword arguments), at the shapes to plan "
            "for") from exc
    return Forward(list(recorder.graph.nodes), recorder.first_use, recorder.last_use,
                   recorder.peak)

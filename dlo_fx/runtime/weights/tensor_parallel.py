"""A tensor-parallel parameter (a DTensor): what dlo stores of it, and what it refuses.

[Note: a tensor-parallel parameter streams its local shard]
torch's ``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``, which diffusers'
``TensorParallelConfig`` applies) makes a layer's parameters DTensors: each rank holds a
local tensor, its shard of the weight (or all of it, ``Replicate``), and the DTensor
carries the mesh and the placements, from which the model's own collectives follow (the
all-reduce after a row-wise linear). Those shards are already rank-local, so dlo streams
each rank's local tensor as it is and keeps the DTensor around it:

- the parameter stays the DTensor the module holds; its local tensor (the very object,
  `torch_private.dtensor_local`) is what dlo stores, under the parameter's FQN: it
  becomes a `StoredWeight` in place, as a plain parameter does. The host store holds this
  rank's shard only, and in allgather mode 1/dp of it, gathered over the shard group.
  Outside a graph the DTensor's ops run on the stored local tensor, which reads it as
  any stored weight is read;
- in a graph (dynamo/tensor_parallel.py) the parameter's placeholder takes the local
  tensor, which streams like any parameter, and one node right after the placeholders
  wraps what the schedule gives (a slot view) in a DTensor of the parameter's mesh,
  placements, shape and strides. Every other node of the graph is as Dynamo traced it,
  the model's redistributions and collectives included, so the call computes what the
  resident tensor-parallel model computes. Dynamo traces a DTensor whose local tensor is a
  `StoredWeight` as it traces both (each is a traceable subclass), and a graph made of
  plain local tensors plans as every other graph does; a DTensor whose local tensor
  were a slot view made per call would be built outside the graph, where the schedule
  is not. So the rewrap is a graph node, not a Python wrapper around the call.

What dlo refuses, by parameter, before anything changes (`refusal`): a ``Partial``
placement (a pending reduction, not a layout of the weight), a mesh this rank is not
part of (its local tensor is empty), a mesh of another device type than the compute
device (the rebuilt DTensor would put a slot of one device on a mesh of another), and,
where dlo gathers, a shard group whose ranks hold different shards (a rank's block is its
own shard's bytes; gathering two ranks' shards together would mix two weights): the
shard group must be ranks of one tensor-parallel coordinate, the DP replicas beside the
TP ranks. The last is a fact the ranks compare when the blocks are stored (`shard_fact`),
in the exchange that compares their layouts: a rank knows its own coordinate on its
mesh, not another rank's on the other's (the TP submesh of a 2-D mesh differs per DP
replica). Tensor parallelism applied after dlo stored the weights is refused too
(`check_not_distributing`, and diffusers' ``enable_parallelism`` in model/guard.py): its
``distribute_tensor`` would scatter a stored weight's bytes, which no memory holds.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ...torch_private import dtensor_local
from ..ranks.agreement import Fact


def stored_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor dlo stores for parameter ``p``: a DTensor's local tensor, else ``p``."""
    local = dtensor_local(p)
    return p if local is None else local


def refusal(p: torch.Tensor, device: torch.device) -> Optional[str]:
    """Why dlo cannot stream tensor-parallel parameter ``p`` on compute device ``device``
    (the rest of a sentence that begins ``dlo: parameter '<fqn>'``), or None (also for a
    parameter that is no DTensor). See [Note: a tensor-parallel parameter streams its
    local shard]; the shard group is checked when the blocks are stored (`shard_fact`)."""
    if dtensor_local(p) is None:
        return None
    mesh, placements = p.device_mesh, tuple(p.placements)
    shown = f"a DTensor with placements {placements} on {mesh}"
    partial = [pl for pl in placements if pl.is_partial()]
    if partial:
        return (f"is {shown}: a {partial[0]} placement holds a pending reduction, not a "
                "layout of the weight, which dlo does not stream; nothing was stored. "
                "Redistribute it to Shard or Replicate before dlo_fx.offload "
                "(parallelize_module's ColwiseParallel/RowwiseParallel give those)")
    if mesh.get_coordinate() is None:
        return (f"is {shown}, a mesh this rank ({_global_rank()}) is not part of, so it "
                "holds no shard to stream; nothing was stored. Build the mesh over the "
                "ranks that run the model")
    if mesh.device_type != device.type:
        return (f"is {shown}, a mesh of device type {mesh.device_type!r}, but dlo computes "
                f"on {device}: the DTensor rebuilt around a slot would mix the two; nothing "
                f"was stored. Offload with options={{'device': {mesh.device_type!r}}} (the "
                "mesh's device type), or build the mesh on the compute device")
    return None


def shard_fact(blocks: Sequence[Sequence[torch.Tensor]], fqns: Sequence[str]) -> Fact:
    """What the ranks that gather ``blocks`` (their parameters as the module holds them;
    ``fqns``: each block's first parameter) must share of their tensor-parallel shards:
    each DTensor parameter's mesh coordinate on the dimensions it is sharded over. A
    block is this rank's shard's bytes, so ranks of one shard group must hold the same
    shards (compared in allgather mode only, with the blocks' layouts)."""
    rows = []
    for params in blocks:
        row = []
        for p in params:
            if dtensor_local(p) is not None:
                coordinate = p.device_mesh.get_coordinate()
                row.append([coordinate[i] for i, pl in enumerate(p.placements)
                            if not pl.is_replicate()])
        rows.append(row)
    return Fact(
        "tensor-parallel shards (each DTensor parameter's mesh coordinate where it is "
        "sharded)", rows,
        "A gathered block would mix two ranks' shards of one weight. Gather over the ranks "
        "that hold the same shard (the data-parallel replicas beside the tensor-parallel "
        "ranks: options={'shard_group': [...]}), or stream each rank's shard alone "
        "(options={'mode': 'rank_local'})", blocks=list(fqns))


@dataclass(frozen=True)
class DTensorLayout:
    """What a DTensor parameter is besides its local tensor: its mesh, placements, shape
    and strides (the graph's rewrap node holds one)."""

    mesh: Any
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, p: torch.Tensor) -> "DTensorLayout":
        return cls(p.device_mesh, tuple(p.placements), tuple(p.shape), tuple(p.stride()))

    def around(self, local: torch.Tensor) -> torch.Tensor:
        """A DTensor of this layout whose local tensor is ``local`` (a slot view, a host
        copy)."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.shape), stride=self.stride)


def rebuilt(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as parameter ``p`` holds it: in a DTensor of ``p``'s layout where ``p``
    is one, else as it is."""
    return local if dtensor_local(p) is None else DTensorLayout.of(p).around(local)


def _global_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def check_not_distributing(fqn: str) -> None:
    """ValueError naming ``fqn`` where torch's ``distribute_tensor`` (tensor parallelism
    applied with ``parallelize_module``, or diffusers' ``enable_parallelism``) is reading a
    stored weight: raised at its ``detach``, the first op it runs on the tensor, on every
    rank, before its scatter or broadcast."""
    from torch.distributed.tensor import distribute_tensor

    code = distribute_tensor.__code__
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return
        if frame.f_code is code:
            break
        frame = frame.f_back
    else:
        return
    raise ValueError(
        f"dlo: tensor parallelism was applied after dlo stored the weights: "
        f"distribute_tensor of parameter {fqn!r} (parallelize_module, or diffusers' "
        "enable_parallelism with a TensorParallelConfig) would scatter bytes that only the "
        "dlo host store holds; nothing was distributed. Apply tensor parallelism first, then "
        "dlo_fx.offload(model, options) (dlo streams each rank's shard), or call "
        "dlo_fx.release(model) first to put the weights back")


__all__ = ["DTensorLayout", "check_not_distributing", "rebuilt", "refusal", "shard_fact",
           "stored_tensor"]

"""The inputs of a model dlo streams: on its compute device, or refused by name.

[Note: inputs on the compute device]
An offloaded model computes on dlo's compute device (``options["device"]``: its streamed
weights are read into slots there, its other parameters and buffers live there). Called
with an input on another device, the first op that mixes the two fails: eagerly inside
torch's kernel, compiled inside Dynamo's fake-tensor propagation ("Tensor device
mismatch", "Unhandled FakeTensor Device Propagation ... found two different devices"),
before any backend runs and with no word of dlo, its device or the fix. So the model's
root module (the one `dlo_fx.offload`, `dlo_fx.load` or `compile_pipeline` attached) gets
a forward pre-hook, `check_input_devices`, that refuses a tensor argument of one or more
dimensions on another device with a ``ValueError`` naming the compute device and the two
ways out, before anything runs. Dynamo traces the hook with the call: on the compute
device its checks are constants of the trace (the inputs' devices are guarded anyway) and
add nothing to the graph; on another one Dynamo runs the frame as Python and the hook's
error reaches the caller as raised. A zero-dimensional tensor on the CPU is let through, as
torch lets a CPU scalar into any device's op. `release` removes the hook with the guards.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["check_input_devices"]


def check_input_devices(device: torch.device) -> Callable[[nn.Module, tuple, dict], None]:
    """A forward pre-hook (``with_kwargs=True``) refusing tensor arguments of one or more
    dimensions that are not on ``device`` (canonical: `config.canonical_device`). See
    [Note: inputs on the compute device]."""
    return functools.partial(_check, device)  # not a closure: a model pickles with it


def _check(device: torch.device, module: nn.Module, args: tuple, kwargs: dict) -> None:
    for name, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
            raise ValueError(_refusal(module, name, value.device, device))


def _refusal(module: nn.Module, name: Any, got: torch.device, device: torch.device) -> str:
    what = f"argument {name}" if isinstance(name, int) else f"argument {name!r}"
    return (f"dlo: {type(module).__name__} computes on {device} (dlo's compute device: its "
            f"streamed weights are read into slots there) but its {what} is a tensor on "
            f"{got}; nothing was run. Move the inputs to {device} (x.to({str(device)!r})), or "
            f"compute on {got}: dlo_fx.release(model), then dlo_fx.offload(model, "
            f"options={{'device': {str(got)!r}}})")

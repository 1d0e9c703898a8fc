"""diffusers' parallelism (`ModelMixin.enable_parallelism`) on a CPU-only torch, over gloo.

diffusers 0.42 refuses both of its parallel routes on a machine without an accelerator,
by checks that concern the accelerator, not the computation:

- context parallelism (``ContextParallelConfig(ulysses_degree=N)``): ``_resolve_parallel_config``
  picks each rank's device as ``torch.device(device_type, rank % torch.accelerator.device_count())``,
  a ``ZeroDivisionError`` where the count is 0. ``device_type`` is
  ``torch._C._get_accelerator().type``, ``"cpu"`` on a CPU-only build, and so is the mesh
  it builds (``init_device_mesh("cpu", ...)``), whose collectives gloo runs.
- tensor parallelism (``TensorParallelConfig(tp_degree=N)``): ``apply_tensor_parallel``
  refuses a mesh whose device type is not in ``diffusers.hooks.tensor_parallel._SUPPORTED_TP_DEVICES``
  (``cuda``, ``neuron``, ``tpu``, ``xpu``): "Tensor parallelism is not supported on
  device type 'cpu'". Past that check it calls torch's ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` (and diffusers' packed variants), which
  shard on a CPU mesh as on any other: DTensor's ops and the all-reduce / all-gather
  they need are gloo's.

`cpu_parallelism` passes exactly these two checks, for the duration of the block:
``torch.accelerator.device_count`` reads 1, so every rank's device is ``cpu:0`` (the one
CPU, which all ranks of a machine share; diffusers uses the index for nothing else on
the CPU), and ``"cpu"`` joins the supported TP device types. Nothing else changes:
the model, the mesh, the placements and the collectives are those diffusers and torch
build on an accelerator, so a CPU run checks the same sharding and the same graphs.
On a machine with an accelerator it changes nothing (both checks pass there as shipped).
Ring attention stays out of reach on the CPU: diffusers' native attention backend returns
no log-sum-exp (``return_lse``), which ring attention needs; Ulysses needs none.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from dlo_fx.apps.engine.context_parallel import device_count_on_host


@contextlib.contextmanager
def cpu_parallelism() -> Iterator[None]:
    """Let diffusers' ``enable_parallelism`` (context or tensor parallelism) run on a CPU-only
    torch over gloo: see this module's docstring. Use it around the ``enable_parallelism``
    call (the mesh and the device are resolved there); the forward needs nothing. The
    device count is the engine's own swap (`dlo_fx.apps.engine.context_parallel`, which
    enables context parallelism on a CPU-only torch the same way); the TP device check is
    the tests' alone (the engine runs no tensor parallelism)."""
    if torch.accelerator.is_available():
        yield
        return
    from diffusers.hooks import tensor_parallel

    supported = tensor_parallel._SUPPORTED_TP_DEVICES
    tensor_parallel._SUPPORTED_TP_DEVICES = (*supported, "cpu")
    try:
        with device_count_on_host():
            yield
    finally:
        tensor_parallel._SUPPORTED_TP_DEVICES = supported


__all__ = ["cpu_parallelism"]

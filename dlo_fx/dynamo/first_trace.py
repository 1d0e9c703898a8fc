"""A model compiled with ``backend="dlo"`` without `dlo_fx.offload`: offloaded at the
first graph Dynamo traces of it.

[Note: a model compiled without offload]
The way in is ``dlo_fx.offload(model)`` (or `dlo_fx.load`), then ``torch.compile``: the
model Dynamo traces is then the streamed model, its weights `StoredWeight`s on the compute
device (see [Note: a streamed model exists before Dynamo traces it] in loading/offload.py),
and the backend is a function of the graph it is given. ``torch.compile(model,
backend="dlo")`` of a model never offloaded works only where Dynamo can trace the model as
it is, with the compute device the device its parameters are on (a CPU-only machine, or a
model already on the accelerator): on a GPU machine a model in host memory called with
device inputs fails inside Dynamo's fake-tensor propagation before any backend is called.

There, the backend offloads the model the first graph reads (found here, `traced_model`),
once, as `offload` would with the options of the compile and that device, keeping its
modes as traced (`loading.offload.offload_module`), and has Dynamo trace the frame again
(`torch_private.trace_again`): the model Dynamo then traces is the one `offload` would
have given it, and everything after is the offloaded model's path. Dynamo's guards then
expect `StoredWeight`s: the model's later calls pass them, and another model of the class
(plain parameters) fails them and is traced, and so offloaded, on its own.

The graph reads parameters, not modules, so the model is found here and only here: the
outermost module holding the graph's parameters among the modules the user compiled that
are being called (``torch.compile(model)``'s wrapper, ``model.compile()``), the locals of
the frame Dynamo compiles, and the modules it reached through a global
(``G['pipe'].transformer``). A graph reading two models is refused before anything
changes, as it is for models offloaded apart: each model is compiled on its own. Where the
compile of the model's first graph fails after the offload (a budget below the minimum, a
failing pass), the weights go back (`undo_failed`): a refused compile leaves the model as
it was.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch

from .. import torch_private
from ..loading.offload import check_model
from ..model.guard import give_back
from ..runtime.runtime import Runtime

__all__ = ["traced_model", "undo_failed"]


def traced_model(params: Sequence[torch.Tensor]) -> tuple[torch.nn.Module, bool]:
    """The model whose ``params`` (none stored) a graph reads, checked for `offload_module`,
    and whether the frame Dynamo compiles is that model's own forward from its start (its
    ``at_start``): see [Note: a model compiled without offload]. ValueError, before
    anything changes, where no single model holds them."""
    ours = {id(p) for p in params}
    models = [m for m in outermost(candidates())
              if any(id(p) in ours for p in m.parameters())]
    if len(models) != 1:
        what = ("no module Dynamo traced holds them" if not models else
                "they belong to " + " and ".join(type(m).__name__ for m in models))
        raise ValueError(
            f"dlo: a graph compiled with backend='dlo' reads {len(params)} parameters of no "
            f"model offloaded ({what}); a graph streams one model: offload and compile each "
            "model on its own (dlo_fx.offload(model, options); torch.compile(model, "
            "backend='dlo'))")
    model = models[0]
    check_model(model)
    # Whether the frame is the model's own forward from its start: else layers ran
    # eagerly before it, which a storage_dtype would make differ (storage_dtype.py)
    name = torch_private.compiling_frame_name() or ""
    at_start = any(v is model for v in (torch_private.compiling_frame_locals() or {}).values()
                   ) and not name.startswith("torch_dynamo_resume_in")
    return model, at_start


def undo_failed(runtime: Runtime) -> None:
    """Give back the weights of a model the backend offloaded when the compile of its
    first graph failed after all (a budget below the minimum, a failing pass): a refused
    compile leaves the model as it was. With a shard group gathering, the ranks would
    have to give back together; the model stays offloaded there."""
    ref, runtime.offloaded_by_trace = runtime.offloaded_by_trace, None
    model = ref() if ref is not None else None
    if model is not None and not runtime.gathers:
        give_back(model)


def candidates() -> list[torch.nn.Module]:
    """The modules that may be the model: those the user compiled whose call is on the
    stack, the locals of the frame Dynamo compiles, the modules it reached."""
    found: list[torch.nn.Module] = []
    frame = sys._getframe(1)
    while frame is not None:
        value = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        root = torch_private.compiled_module_of(value)  # torch.compile(model)'s wrapper
        if root is None and isinstance(value, torch.nn.Module) and \
                torch_private.compile_backend_name(vars(value).get("_compiled_call_impl")):
            root = value  # model.compile(...)
        if root is not None:
            found.append(root)
        frame = frame.f_back
    found += [v for v in (torch_private.compiling_frame_locals() or {}).values()
              if isinstance(v, torch.nn.Module)]
    found += [m for m, _ in torch_private.traced_modules()]
    unique: dict[int, torch.nn.Module] = {}
    for m in found:
        unique.setdefault(id(m), m)
    return list(unique.values())


def outermost(modules: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules of ``modules`` that no other of them contains."""
    inside = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inside]

"""The `dlo` torch.compile backend.

Registered under the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="dlo", options={...})`` works without importing dlo_fx.
Each graph Dynamo captures is scheduled on its own; every graph compiled with one
configuration shares one `Runtime` (host store, slots, executor).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import fx

from .config import DLOConfig
from .passes import PassContext, run_passes
from .runtime.collectives import check_same_plan
from .runtime.eager import fetch_eagerly
from .runtime.fingerprint import block_fingerprint, check_same_weights
from .runtime.layout import span_as_bytes
from .runtime.graph_call import bind, compile_clock, run_graph
from .runtime.host_store import is_hollow
from .runtime.ops import SCHEDULE_OPS
from .runtime.runtime import Runtime, runtime_for

log = logging.getLogger(__name__)


def dlo_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                options: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None,
                **unused: Any) -> Callable:
    """Schedule ``gm`` so that its parameters stream through the device slots."""
    if mode not in (None, "default"):
        raise ValueError(f"torch.compile mode={mode!r} is not supported by backend 'dlo'; "
                         "use options={'compiler': ...} instead")
    config = DLOConfig.from_options(options)
    device = resolve_device(config, example_inputs)
    runtime = runtime_for(config, device)
    ctx = PassContext(config=config, example_inputs=example_inputs, runtime=runtime)
    gm = run_passes(gm, ctx, extra=config.user_passes)
    compiled = gm.forward
    if config.compiler == "inductor":  # before commit: a failure leaves the model intact
        from .inductor import compile_pieces

        compiled = compile_pieces(gm, example_inputs, ctx)
    with runtime.lock:  # no graph of another thread gathers while this one compares plans
        runtime.drain()
        commit(ctx, runtime)
    _guard_eager_calls(runtime)
    if config.dump_dir:
        from .dump import write_dump

        write_dump(gm, ctx, runtime, config.dump_dir)
    return _scheduled_call(gm, ctx, runtime, compiled)


def _scheduled_call(gm: fx.GraphModule, ctx: PassContext, runtime: Runtime,
                    compiled: Callable) -> Callable:
    """``compiled`` run under the runtime's lock and collective clock (graph_call.py)."""
    sched = getattr(ctx, "schedule", None)
    if sched is None:
        return compiled
    bind(gm, sched, tuple(SCHEDULE_OPS))

    def run(*args: Any) -> Any:
        return run_graph(runtime, sched, compiled, args)

    return run


def resolve_device(config: DLOConfig, example_inputs: Sequence[Any]) -> torch.device:
    if config.device is not None:
        return torch.device(config.device)
    for value in example_inputs:
        if isinstance(value, torch.nn.Parameter):
            return value.device
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def commit(ctx: PassContext, runtime: Runtime) -> None:
    """Move the graph's new blocks into the host store (hollowing their parameters).

    Runs only after every pass succeeded, so a failing compile leaves the model as it was.
    """
    grad = torch.is_grad_enabled()
    for block in ctx.blocks:
        for p in block.params:
            if grad and p.param.requires_grad:
                raise NotImplementedError(
                    f"dlo streams weights for inference only, but parameter {p.fqn!r} "
                    "requires grad under grad mode; call model.requires_grad_(False) or run "
                    "under torch.no_grad() / torch.inference_mode()")
            if block.host_block is None and p.param.device != runtime.device:
                raise ValueError(
                    f"parameter {p.fqn!r} is on {p.param.device} but dlo computes on "
                    f"{runtime.device}; build the model on that device's metadata with "
                    "dlo_fx.load(...), or set options={'device': ...} to match it")
            if block.host_block is None and is_hollow(p.param):
                raise ValueError(
                    f"parameter {p.fqn!r} has no storage and is in no host store; it was "
                    "hollowed by another runtime (a different dlo configuration). Compile "
                    "every graph of one model with the same options")
    for p in ctx.resident:
        if p.first >= 0 and not ctx.in_store(p.param) and p.param.device != runtime.device:
            raise ValueError(
                f"resident parameter {p.fqn!r} ({p.reason}) is on {p.param.device} but dlo "
                f"computes on {runtime.device}; load the model with dlo_fx.load(...) so resident "
                "parameters are placed on the device")
    if runtime.mode == "allgather":
        compile_clock(runtime, len(ctx.blocks), f"compiling a graph of {len(ctx.params)} parameters")
        rows = [(len(b.params), b.nbytes, b.params[0].fqn) for b in ctx.blocks]
        check_same_plan(rows, runtime.group, f"a graph of {len(ctx.params)} parameters")
    new = [b for b in ctx.blocks if b.host_block is None]
    if runtime.mode == "allgather":
        fingerprints = []
        for b in new:
            params = [p.param for p in b.params]
            entries, _ = runtime.store.layout(params, [p.fqn for p in b.params])
            fingerprints.append(block_fingerprint(
                entries, [span_as_bytes(p) if p.numel() else None for p in params]))
        check_same_weights(runtime, fingerprints, [b.params[0].fqn for b in new],
                           f"a graph of {len(ctx.params)} parameters")
    for block in new:
        runtime.register_block([p.param for p in block.params], [p.fqn for p in block.params])
    log.info("dlo: scheduled a graph with %d blocks (budget %d bytes), %d resident parameters",
             len(ctx.blocks), ctx.budget, len(ctx.resident))


# -- calling a hollow model outside the backend ------------------------------------------
_GUARDED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

HOLLOW_CALL_MESSAGE = (
    "this model's weights were moved into a dlo host store (its parameters are hollow), "
    "so it cannot run eagerly; call it through torch.compile(model, backend=\"dlo\")")


def _under_torch_compile() -> bool:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
    return get_eval_frame_callback() not in (None, False)


def _hollow_call_guard(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling() or _under_torch_compile():
        return
    if any(is_hollow(p) for p in module.parameters()):
        raise RuntimeError(f"{type(module).__name__}: {HOLLOW_CALL_MESSAGE}")


def guard_module(module: torch.nn.Module) -> None:
    """Make an eager call of ``module`` with hollow parameters raise a clear error."""
    if module not in _GUARDED:
        module.register_forward_pre_hook(_hollow_call_guard)
        _GUARDED.add(module)


def _guard_eager_calls(runtime: Runtime) -> None:
    """Guard the module(s) of the frame being compiled, when Dynamo exposes it, and
    fetch their hollow parameters for eager calls (see runtime/eager.py)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        local_values = list(tx.f_locals.items()) if tx is not None else []
        code = tx.f_code if tx is not None else None
    except Exception:  # private API: best effort only
        return
    for name, value in local_values:
        if isinstance(value, torch.nn.Module) and any(is_hollow(p) for p in value.parameters()):
            guard_module(value)
            forward = getattr(type(value).forward, "__code__", None)
            fetch_eagerly(value, runtime, compiled_forward=code is not None and code is forward)

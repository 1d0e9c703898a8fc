"""The `dlo` torch.compile backend.

Registered under the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="dlo", options={...})`` works without importing dlo_fx.
Each graph Dynamo captures is scheduled on its own; every graph of one model shares the
model's `Runtime` (its host store; slots and executor shared per device), found from
the model's parameters. Each compile takes its own options (`CompileOptions`); the model's
runtime was made with its own (`DLOConfig`) by `dlo_fx.offload` or `dlo_fx.load` (see
[Note: options belong to a verb] in config.py).
"""

from __future__ import annotations

import logging
import re
import time
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import fx

from .errors import CompileOptionsError, surfaced
from ..config import (CompileOptions, DLOConfig, conflict_error, runtime_conflicts, same_device,
                      split_options)
from ..passes import run_passes, schedule_of
from ..planning.settle import Budget
from ..planning.stages import GraphPlan, param_placeholders, plan_graph
from ..planning.stages.identify_params import fqn_from_source
from .auto_budget import AutoResidency, copy_graph, fixed_residency
from .probes import probe_for_budget, resolve_budget
from .tensor_parallel import unwrap_dtensor_params
from ..runtime import (READ_DIRECTLY, GraphSchedule, NewBlock, Runtime, claim, compile_clock,
                       compile_facts, is_composite, is_stored, note_compile, note_graph, owner_of,
                       read_unstored, run_graph, store_view, was_released)
from .. import torch_private

log = logging.getLogger(__name__)

#: Called with ``(gm, plan, runtime, compile_options)`` once a graph is scheduled and committed.
#: The package root registers the schedule-dump writer (``dump_dir``), an application the
#: backend does not import itself.
SCHEDULED_OBSERVERS: list[Callable[[fx.GraphModule, Any, Any, CompileOptions], None]] = []

# Before Dynamo traces anything for this backend: see [Note: `x in list` with a symbolic
# element] (a model skipping blocks by a list argument took the wrong branch).
torch_private.install_contains_fix()


def dlo_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                options: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None,
                **unused: Any) -> Callable:
    """Schedule ``gm`` so that its parameters stream through the device slots. dlo's own
    errors reach the caller as raised: see [Note: dlo's errors past Dynamo] in errors.py."""
    try:
        return _compile(gm, example_inputs, options, mode)
    except Exception as exc:
        own = surfaced(exc)
        if own is None:
            raise
        raise own from exc.__cause__


def _compile(gm: fx.GraphModule, example_inputs: Sequence[Any],
             options: Optional[Mapping[str, Any]], mode: Optional[str]) -> Callable:
    if mode not in (None, "default"):
        raise CompileOptionsError(
            f"torch.compile mode={mode!r} is not supported by backend 'dlo' (it takes "
            "mode=None or 'default'); drop mode= and use options={'compiler': 'inductor'} "
            "to compile the compute with Inductor")
    made_with, compile_options = given_options(options)
    params = [v for v in example_inputs if isinstance(v, torch.nn.Parameter)]
    runtime = owner_of(params)
    if params and (runtime is None or runtime.closed):  # see [Note: one way in]
        raise not_offloaded(gm, example_inputs, params)
    if runtime is not None:
        runtime.check_process()  # a forked child: before any pass probes or gathers
        conflicts = runtime_conflicts(made_with, runtime.config)
        if conflicts:  # before anything changes: see [Note: options belong to a verb]
            raise CompileOptionsError(str(conflict_error(conflicts, COMPILE_VERB)))
        config = runtime.config
    else:  # a graph without parameters gets no runtime: it streams nothing
        config = DLOConfig()
    if compile_options.compiler == "inductor":  # may trace the frame again; nothing is made yet
        torch_private.restart_with_floats_specialized(gm)
    note_compile()  # a forward that compiles is not replayed gather-only (forward_log.py)
    example_inputs, local_args = unwrap_dtensor_params(gm, example_inputs)
    params = [v for v in example_inputs if isinstance(v, torch.nn.Parameter)]
    return local_args(schedule_for(gm, example_inputs, runtime, config,
                                   compile_options, tuple(made_with.items()), params))


# [Note: one way in]
# A model becomes dlo's before anything traces it: `dlo_fx.offload` (a model in memory),
# `dlo_fx.load` (a checkpoint) or `compile_pipeline` (each streamed component), as FSDP2's
# ``fully_shard`` and diffusers' group offloading wrap before ``torch.compile`` (see [Note:
# a streamed model exists before Dynamo traces it] in loading/offload.py). The backend is
# a function of the graph it is given: it finds the runtime from the graph's parameters
# and makes none. A graph with parameters no live runtime owns (a model never offloaded,
# or one `dlo_fx.release` gave back) is refused at once, before anything changes, naming
# what the graph tells of the model (its parameters' names, the class of the outermost
# module Dynamo records calling, where it is one of the graph's roots: a graph reads
# parameters, not modules, and the backend does not look for the model elsewhere) and the
# one-line fix. A released model's handle is refused naming `release`: it never stores the
# weights again by itself.
def not_offloaded(gm: fx.GraphModule, example_inputs: Sequence[Any],
                  params: Sequence[torch.Tensor]) -> ValueError:
    """The refusal of a graph whose ``params`` no dlo runtime owns: see [Note: one way in]."""
    sources = [n.meta["grapharg"].source.name for n, _ in param_placeholders(gm, example_inputs)
               if n.meta.get("grapharg") is not None]
    names = [fqn_from_source(s) for s in sources]
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more"
                                                     if len(names) > 3 else "")
    models = model_classes(gm, sources)
    what = (f"a graph of {' and '.join(models)} reading {len(params)} parameters" if models
            else f"a graph reading {len(params)} parameters") + (f" ({shown})" if shown else "")
    if was_released(params):
        return ValueError(
            f"dlo: torch.compile(..., backend='dlo') traced {what} that dlo_fx.release gave "
            "back: a released model is an ordinary module, and its compiled handle never "
            "stores it again by itself; nothing was changed. Call the model itself, or "
            "dlo_fx.offload(model, options) again before calling this handle")
    each = ("; a graph streams one model: offload each model and compile it on its own"
            if len(models) > 1 else "")
    return ValueError(
        f"dlo: torch.compile(..., backend='dlo') traced {what} that no dlo runtime holds: "
        "dlo streams a model made dlo's before it is compiled; nothing was changed. Call "
        "dlo_fx.offload(model, options) first (or build it with dlo_fx.load, or a pipeline "
        f"with dlo_fx.compile_pipeline), then torch.compile(model, backend='dlo'){each}")


_ROOT = re.compile(r"[LG]\['[^']*'\]")  # ``L['model']`` of ``L['model']._modules[...]``


def model_classes(gm: fx.GraphModule, sources: Sequence[str]) -> list[str]:
    """The class names of the modules whose parameters ``sources`` name, one per module,
    where Dynamo recorded a call of it in the graph's ``nn_module_stack`` (a compiled
    function that takes or closes over the model); none for a compiled module's own frame
    (``self`` is not recorded)."""
    roots = {m.group(0) for m in map(_ROOT.match, sources) if m is not None}
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            if path in roots and isinstance(cls, type):
                found.setdefault(path, cls.__name__)
    return list(found.values())


def schedule_for(gm: fx.GraphModule, example_inputs: Sequence[Any], runtime: Optional[Runtime],
                 config: DLOConfig, compile_options: CompileOptions,
                 made_with: tuple, params: list) -> Callable:
    """Plan ``gm`` onto ``runtime``'s stored blocks, write and commit the schedule, and
    return the graph's call (wrapped in the auto budget's re-plans where it applies).
    Plan (no collective), settle mode="auto", then write the schedule: the probes and the
    mode choice are collectives, run here and not in a pass (dynamo/probes.py).
    ``made_with``: the runtime options the compile was given (`runtime_conflicts` checks
    them again for every runtime a call binds)."""
    budget = resolve_budget(config, runtime)  # device_budget None under "auto": per call
    auto_capacity = budget.auto_capacity
    if params and (budget.device_budget is not None or auto_capacity is not None):
        probe_for_budget(runtime)
    pristine = copy_graph(gm) if auto_capacity is not None and params else None
    plan = with_schedule(plan_graph(gm, example_inputs, config,
                                    store_view(runtime, graph_params(gm, example_inputs)),
                                    budget, compile_options.debug_passes),
                         runtime, compile_options.trace, made_with)  # the mode: settled at offload
    gm, run = schedule_and_commit(gm, plan, runtime, example_inputs, compile_options,
                                  lambda: claim(params, runtime))
    if pristine is not None and plan.budget_plan is not None and schedule_of(gm) is not None:
        run = auto_residency(pristine, plan, runtime, (run, schedule_of(gm)), compile_options)
    elif plan.budget_plan is not None and plan.budget_plan.resident:
        run = fixed_residency(run, plan.budget_plan)
    return run


def graph_params(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The parameters the planning stages will meet in ``gm``: those its `StoreView` (made
    after the probes, so it carries their figures) describes."""
    return [value for _, value in param_placeholders(gm, example_inputs)]


def with_schedule(plan: GraphPlan, runtime: Optional[Runtime], trace: bool = False,
                  made_with: tuple = ()) -> GraphPlan:
    """``plan`` with the runtime's `GraphSchedule` for it (its mode settled), which
    `insert_schedule` writes into the graph; a plan without a runtime schedules nothing.
    ``trace`` and ``made_with``: the compile's (see `GraphSchedule`)."""
    if runtime is None:
        return plan
    k = plan.config.num_slots
    return plan.with_schedule(GraphSchedule(
        runtime=runtime, slot_of=[b.index % k for b in plan.blocks],
        fqns=[[p.fqn for p in b.params] for b in plan.blocks], trace=trace,
        made_with=made_with))


def schedule_and_commit(gm: fx.GraphModule, plan: GraphPlan, runtime: Optional[Runtime],
                        example_inputs: Sequence[Any], compile_options: CompileOptions,
                        then: Optional[Callable[[], None]] = None
                        ) -> tuple[fx.GraphModule, Callable]:
    """Write ``plan`` into ``gm`` (`schedule_graph`), commit its blocks to ``runtime`` and
    run ``then`` under the runtime's lock (no graph of another thread gathers while this
    one compares plans), tell the observers (the dump writer, registered by the package
    root), and return the scheduled graph and its call. The compile and the auto budget's
    re-plans (`auto_residency`) both end here."""
    gm, compiled = schedule_graph(gm, plan, example_inputs, compile_options)
    if runtime is not None:
        with runtime.lock:
            runtime.machine.drain()
            commit(plan, runtime)
            if then is not None:
                then()
    for observe in SCHEDULED_OBSERVERS:
        observe(gm, plan, runtime, compile_options)
    return gm, scheduled_call(gm, plan, example_inputs, compiled)


def schedule_graph(gm: fx.GraphModule, plan: GraphPlan, example_inputs: Sequence[Any],
                   compile_options: CompileOptions) -> tuple[fx.GraphModule, Callable]:
    """Write ``plan`` into ``gm`` (the schedule and the user's passes), check it, and
    compile its compute (Inductor pieces when asked): before `commit`, so a failure leaves
    the model intact."""
    gm = run_passes(gm, plan, compile_options.user_passes, compile_options.debug_passes)
    streamed = {id(p.param) for b in plan.blocks for p in b.params}
    check_inference_only(gm, plan.example_inputs, lambda p: id(p) in streamed,
                         {id(p.param): p.fqn for p in plan.params})
    compiled = gm.forward
    if compile_options.compiler == "inductor":
        from ..inductor import compile_pieces

        check_no_subclass_weights(plan, plan.schedule.runtime if plan.schedule else None)

        compiled = compile_pieces(gm, example_inputs, plan)
    return gm, compiled


def auto_residency(pristine: fx.GraphModule, plan: GraphPlan, runtime: Runtime,
                   first: tuple[Callable, Any], compile_options: CompileOptions) -> Callable:
    """``first`` (every block streamed: its call and its `GraphSchedule`) wrapped in the
    auto device budget's re-plans: each
    resident set is scheduled from a copy of ``pristine`` (the graph before the passes),
    with ``plan``'s blocks and those resident. See dynamo/auto_budget.py.

    What it keeps of the model is weak (its runtime, its parameters, the example inputs):
    Dynamo may keep a compiled graph's callable after the model is gone, and a scheduled
    graph holds no parameter either (each call binds the ones it is called with)."""
    config = plan.config
    runtime_ref = weakref.ref(runtime)
    # Parameters weakly; the other tensors as Dynamo traced them (their fake values: the
    # planning stages read their metadata only), so no call's inputs are kept either.
    holders = pristine.graph.find_nodes(op="placeholder")
    inputs = [weakref.ref(v) if isinstance(v, torch.nn.Parameter) else
              node.meta.get("example_value", v) if isinstance(v, torch.Tensor) else v
              for node, v in zip(holders, plan.example_inputs)]

    def build(forced: Any) -> Callable:
        runtime = runtime_ref()
        example_inputs = [v() if isinstance(v, weakref.ref) else v for v in inputs]
        if runtime is None or any(v is None for v in example_inputs):
            raise RuntimeError("dlo: the model this graph was compiled for is gone")
        gm = copy_graph(pristine)
        plan = with_schedule(plan_graph(gm, example_inputs, config,
                                        store_view(runtime, graph_params(gm, example_inputs)),
                                        Budget(forced=forced), compile_options.debug_passes),
                             runtime, compile_options.trace, made_with)
        # every block is stored already: the commit runs no collective
        gm, call = schedule_and_commit(gm, plan, runtime, example_inputs, compile_options)
        return call, schedule_of(gm)

    made_with = tuple(first[1].made_with.items())  # each variant binds as the first does
    where = {id(v): i for i, v in enumerate(plan.example_inputs)
             if isinstance(v, torch.nn.Parameter)}
    positions = {p.fqn: where[id(p.param)] for p in plan.params if id(p.param) in where}
    first_param = plan.example_inputs[min(positions.values())] if positions else None
    controller = AutoResidency(runtime, plan.budget_plan,
                               tuple(p.fqn for p in plan.params), first, build, positions,
                               first_param)

    def run(*args: Any) -> Any:
        # A function, not the object: Dynamo wraps what a backend returns with
        # functools.wraps, which copies a callable object's __dict__ onto the wrapper.
        return controller(*args)

    return run


COMPILE_VERB = "torch.compile(backend='dlo')"


def given_options(options: Any) -> tuple[dict[str, Any], CompileOptions]:
    """The options a compile call was given, validated: the runtime options among them (a
    dict, checked against the runtime's own: see [Note: options belong to a verb] in
    config.py) and its `CompileOptions`."""
    if isinstance(options, CompileOptions):
        return {}, options
    try:
        made_with, compile_options = split_options(options, COMPILE_VERB)
        return made_with, CompileOptions.from_options(compile_options)
    except ValueError as exc:  # the user's input: raised past Dynamo, not wrapped by it
        raise CompileOptionsError(str(exc)) from None


def scheduled_call(gm: fx.GraphModule, plan: GraphPlan, example_inputs: Sequence[Any], compiled: Callable) -> Callable:
    """``compiled``, each call bound to the runtime of the parameters it is called with
    (`GraphSchedule.bind`: Dynamo reuses a graph for other models of the same class) and
    run under that runtime's lock and collective clock (graph_call.py)."""
    sched = schedule_of(gm)
    positions = [i for i, v in enumerate(example_inputs) if isinstance(v, torch.nn.Parameter)]
    if not positions:  # no parameter: nothing to bind
        return compiled
    if sched is None:  # nothing streamed
        return unscheduled_call(compiled, positions)
    sched.bound_at = tuple(positions)
    sched.direct = tuple(i for i in positions if i not in sched.arg_positions)
    budget_plan = plan.budget_plan

    def run(*args: Any) -> Any:
        bound = [args[i] for i in positions]
        with sched.call_lock:  # sched holds this call's binding: one call at a time
            runtime = sched.bind(bound)
            note_graph(sched, bound, args)  # for gather-only forwards (forward_log.py)
            start = time.perf_counter()
            try:
                out = run_graph(runtime, sched, compiled, args)
            finally:
                runtime.reads.drop_block_copy()  # resident copies are made: free their source
        if budget_plan is not None:
            budget_plan.measured_s = time.perf_counter() - start  # beside the prediction (memory_report)
        return out

    return run


def unscheduled_call(compiled: Callable, positions: Sequence[int]) -> Callable:
    """``compiled``, a graph with parameters and no schedule, reading the resident copy of
    each `StoredWeight` it is called with: see [Note: a graph compiled for another model
    of the class] in runtime/weights/weight_reads.py."""
    def run(*args: Any) -> Any:
        stored = [args[i] for i in positions if is_stored(args[i])]
        if not stored:
            return compiled(*args)
        runtime = owner_of(stored)
        if runtime is None or runtime.closed:
            read_unstored(stored[0], stored[0].device)  # raises: not in a live store
        with runtime.lock:
            runtime.check_open()
            # Clocked as an eager fetch is (no graph clock was exchanged), made once: a
            # rank whose history differs raises instead of pairing other collectives.
            try:
                args = runtime.reads.direct_reads(args, positions, clock=True)
            finally:
                runtime.reads.drop_block_copy()
            return compiled(*args)

    return run


def check_inference_only(gm: fx.GraphModule, example_inputs: Sequence[Any],
                         streams: Callable[[torch.Tensor], bool],
                         names: Optional[Mapping[int, str]] = None) -> None:
    """NotImplementedError naming the first graph input that requires grad, under grad
    mode, in a graph that streams weights (a parameter ``streams`` says yes to): a
    parameter (stored or resident) or a tensor argument. Autograd would save views of the
    device slots for backward, and later blocks (or another model sharing the slots)
    overwrite them before it runs: backward raised autograd's "modified by an inplace
    operation", or read other weights. ``names``: parameter names by id."""
    if not torch.is_grad_enabled() or not any(
            isinstance(v, torch.nn.Parameter) and streams(v) for v in example_inputs):
        return
    names = names or {}
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            grapharg = node.meta.get("grapharg")
            what = (f"parameter {names[id(value)]!r}" if id(value) in names else
                    f"input {grapharg.source.name if grapharg is not None else node.name}")
            raise NotImplementedError(
                f"dlo streams weights for inference only, but {what} requires grad under "
                "grad mode (backward would read weights from device slots that later blocks "
                "overwrite); run under torch.no_grad() / torch.inference_mode(), or call "
                "model.requires_grad_(False) and pass inputs that do not require grad")


def check_no_subclass_weights(ctx: GraphPlan, runtime: Optional[Runtime]) -> None:
    """ValueError for ``compiler="inductor"`` over quantized tensor-subclass weights: the
    pieces Inductor compiles take plain tensors, and a subclass rebuilt from slot views
    reached them unallocated (a raw RuntimeError)."""
    for p in ctx.params:
        entry = runtime.store.entry(p.param) if runtime is not None else None
        if is_composite(p.param) or (entry is not None and entry.parts):
            kind = type(p.param).__qualname__ if entry is None else entry.wrapper[0].__qualname__
            raise ValueError(
                f"dlo: parameter {p.fqn!r} is a {kind} (a quantized tensor subclass); it "
                "streams with options={'compiler': 'eager'} (the default), which runs the "
                "subclass's own kernels, not with compiler='inductor'")


def commit(ctx: GraphPlan, runtime: Runtime) -> None:
    """Move the graph's new blocks (parameters the model gained after it was stored: a
    LoRA adapter, fused projections) into the host store; they become `StoredWeight`s once
    the ranks agree (see [Note: when a parameter becomes a StoredWeight]).

    Runs only after every pass succeeded, so a failing compile leaves the model as it was.
    """
    for block in ctx.blocks:
        for p in block.params:
            if block.host_block is None and not same_device(p.param.device, runtime.device):
                raise ValueError(
                    f"parameter {p.fqn!r} is on {p.param.device} but dlo computes on "
                    f"{runtime.device}; build the model on that device's metadata with "
                    "dlo_fx.load(...), or set options={'device': ...} to match it")
            if block.host_block is None and is_stored(p.param):
                raise ValueError(
                    f"parameter {p.fqn!r} is stored by dlo but not in the host store of "
                    "the model this graph belongs to (a graph that mixes the parameters of "
                    "models stored by dlo separately); compile each model on its own")
    for p in ctx.resident:
        if (p.first >= 0 and p.param not in runtime.store
                and not same_device(p.param.device, runtime.device)):
            raise ValueError(
                f"resident parameter {p.fqn!r} ({p.reason}) is on {p.param.device} but dlo "
                f"computes on {runtime.device}; load the model with dlo_fx.load(...) so resident "
                "parameters are placed on the device")
    new = [b for b in ctx.blocks if b.host_block is None]
    if new:  # see [Note: a compile on one rank only] and [Note: storing blocks]
        what = f"a graph of {len(ctx.params)} parameters"
        if runtime.gathers:
            compile_clock(runtime, len(ctx.blocks), f"compiling {what}")
        rows = [(len(b.params), b.nbytes, b.params[0].fqn) for b in ctx.blocks]
        runtime.store_blocks([NewBlock([p.param for p in b.params], [p.fqn for p in b.params])
                              for b in new],
                             compile_facts(rows, [p.fqn for p in ctx.resident if p.first >= 0]),
                             what)
    for p in ctx.resident:  # this graph reads them from the module: never stored later
        if p.first >= 0 and p.param not in runtime.store:
            runtime.keep_resident(p.param, READ_DIRECTLY)
    plan = ctx.budget_plan
    if plan is not None:
        runtime.budget_plans[tuple(p.fqn for p in ctx.params)] = plan
        log.info("dlo: device_budget %d B keeps %d of %d blocks resident (%d B); predicted "
                 "%.3f ms per call (%.3f ms with every block streamed)", plan.device_budget,
                 len(plan.resident), len(plan.block_bytes), plan.resident_bytes,
                 plan.predicted_s * 1e3, plan.streamed_s * 1e3)
    log.info("dlo: scheduled a graph with %d blocks (budget %d bytes), %d resident parameters",
             len(ctx.blocks), ctx.budget, len(ctx.resident))

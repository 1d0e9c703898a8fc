"""The `dlo` torch.compile backend.

Registered under the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="dlo", options={...})`` works without importing dlo_fx.
Each graph Dynamo captures is scheduled on its own; every graph of one model shares the
model's `Runtime` (its host store; slots and executor shared per device), found from
the model's parameters. Options are given once: a model loaded with options compiles
without any and inherits them (see [Note: the model owns its runtime]).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import time
import warnings
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import fx

from .errors import CompileOptionsError
from ..config import DLOConfig
from ..passes import run_passes, schedule_of
from ..planning.stages import GraphPlan, PassContext, param_placeholders, plan_graph
from .auto_budget import AutoResidency, copy_graph
from .probes import probe_for_budget, resolve_budget, settle_mode
from ..runtime.agreement import compile_facts
from ..model.guard import attach
from ..runtime.layout import is_composite
from ..runtime.forward_log import note_compile
from ..runtime.graph_call import compile_clock, gathers, note_graph, run_graph
from ..runtime.ops import GraphSchedule, conflict_message
from ..runtime.owners import claim, owner_of
from ..runtime.runtime import READ_DIRECTLY, NewBlock, Runtime
from ..runtime.store_view import store_view
from ..runtime.weight_reads import read_unstored
from .. import torch_private
from ..runtime.stored import _caller_level, is_stored
from ..model.storage_dtype import mark_model

log = logging.getLogger(__name__)

#: Called with ``(gm, plan, runtime, config)`` once a graph is scheduled and committed.
#: The package root registers the schedule-dump writer (``dump_dir``), an application the
#: backend does not import itself.
SCHEDULED_OBSERVERS: list[Callable[[fx.GraphModule, Any, Any, DLOConfig], None]] = []

# Before Dynamo traces anything for this backend: see [Note: `x in list` with a symbolic
# element] (a model skipping blocks by a list argument took the wrong branch).
torch_private.install_contains_fix()


def dlo_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                options: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None,
                **unused: Any) -> Callable:
    """Schedule ``gm`` so that its parameters stream through the device slots."""
    if mode not in (None, "default"):
        raise CompileOptionsError(
            f"torch.compile mode={mode!r} is not supported by backend 'dlo' (it takes "
            "mode=None or 'default'); drop mode= and use options={'compiler': 'inductor'} "
            "to compile the compute with Inductor")
    given = given_options(options)
    params = [v for v in example_inputs if isinstance(v, torch.nn.Parameter)]
    modules = frame_modules()
    reached = reached_modules(params, modules)
    modules += [m for m, _ in reached]
    # The roots only find and claim the runtime; hooks go on the frame's own modules.
    roots = [m for m in compiled_roots(modules) if all(m is not k for k in modules)]
    owners = modules + roots
    runtime = owner_of(params) or owner_of(p for m in owners for p in m.parameters())
    if runtime is not None and not runtime.closed:
        runtime.check_process()  # a forked child: before any pass probes or gathers
        differing = runtime.config.differing(given)
        if differing:  # before anything changes
            raise CompileOptionsError(conflict_message(differing))
        config = runtime.config.merged(given)
    else:
        config = DLOConfig.from_options(options)
        runtime = None
    if config.compiler == "inductor":  # may trace the frame again; nothing is made yet
        torch_private.restart_with_floats_specialized(gm)
    key = _graph_key(gm, example_inputs, config)
    if runtime is not None and any(is_stored(p) for p in params) and all(
            p in runtime.store for p in params if is_stored(p)):
        again = _SCHEDULED.get(key)
        if again is not None:  # see [Note: a graph compiled again for stored weights]
            return again
    note_compile()  # a forward that compiles is not replayed gather-only (forward_log.py)
    if runtime is None and (params or any(True for m in owners for _ in m.parameters())):
        runtime = Runtime(config, resolve_device(config, example_inputs))
    if runtime is not None:  # before the passes size the blocks: see [Note: storing weights
        # in another dtype] in storage_dtype.py
        roots_now = outermost_callers(owners)
        name = torch_private.compiling_frame_name()
        at_start = any(r is m for r in roots_now for m in modules) and not (
            name or "").startswith("torch_dynamo_resume_in")
        mark_model(roots_now, config.storage_dtype, runtime.device, at_start)
    # A graph without parameters and no model's runtime around it (a helper function
    # Dynamo compiles apart) gets none: it streams nothing, and making one is a collective
    # (the ranks agree on its settings) that a recompile on one rank alone, at a shape only
    # that rank sees, could not pair.
    # Plan (no collective), settle mode="auto", then write the schedule: the probes and
    # the mode choice are collectives, run here and not in a pass (dynamo/probes.py).
    budget = resolve_budget(config, runtime)
    auto_capacity = budget.auto_capacity
    device_budget = probe_for_budget(runtime, budget.device_budget if auto_capacity is None
                                     else auto_capacity, bool(params))
    ctx = PassContext(config=config, example_inputs=example_inputs,
                      view=store_view(runtime, graph_params(gm, example_inputs)))
    ctx.device_budget = None if auto_capacity is not None else device_budget  # auto: per call
    ctx.auto_capacity = auto_capacity
    pristine = copy_graph(gm) if auto_capacity is not None and params else None
    plan = with_schedule(settle_mode(plan_graph(gm, ctx), runtime), runtime)
    reached_names = [n for _, n in reached]

    def attach_model() -> None:
        claim(params, runtime)
        adopt(runtime, modules, roots)

    gm, run = schedule_and_commit(gm, plan, runtime, example_inputs, given, reached_names,
                                  attach_model)
    if pristine is not None and plan.budget_plan is not None and schedule_of(gm) is not None:
        run = auto_residency(pristine, plan, runtime, run, given, reached_names)
    if params:
        _SCHEDULED[key] = run
    return run


def graph_params(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The parameters the planning stages will meet in ``gm``: those its `StoreView` (made
    after the probes, so it carries their figures) describes."""
    return [value for _, value in param_placeholders(gm, example_inputs)]


def with_schedule(plan: GraphPlan, runtime: Optional[Runtime]) -> GraphPlan:
    """``plan`` with the runtime's `GraphSchedule` for it (its mode settled), which
    `insert_schedule` writes into the graph; a plan without a runtime schedules nothing."""
    if runtime is None:
        return plan
    k = plan.config.num_slots
    return plan.with_schedule(GraphSchedule(
        runtime=runtime, slot_of=[b.index % k for b in plan.blocks],
        fqns=[[p.fqn for p in b.params] for b in plan.blocks]))


def schedule_and_commit(gm: fx.GraphModule, plan: GraphPlan, runtime: Optional[Runtime],
                        example_inputs: Sequence[Any], given: Mapping[str, Any],
                        reached: Sequence[str],
                        then: Optional[Callable[[], None]] = None
                        ) -> tuple[fx.GraphModule, Callable]:
    """Write ``plan`` into ``gm`` (`schedule_graph`), commit its blocks to ``runtime`` and
    run ``then`` under the runtime's lock (no graph of another thread gathers while this
    one compares plans), tell the observers (the dump writer, registered by the package
    root), and return the scheduled graph and its call. The compile and the auto budget's
    re-plans (`auto_residency`) both end here."""
    gm, compiled = schedule_graph(gm, plan, example_inputs)
    if runtime is not None:
        with runtime.lock:
            runtime.drain()
            commit(plan, runtime)
            if then is not None:
                then()
    for observe in SCHEDULED_OBSERVERS:
        observe(gm, plan, runtime, plan.config)
    return gm, scheduled_call(gm, plan, given, example_inputs, compiled, reached)


def schedule_graph(gm: fx.GraphModule, plan: GraphPlan,
                   example_inputs: Sequence[Any]) -> tuple[fx.GraphModule, Callable]:
    """Write ``plan`` into ``gm`` (the schedule and the user's passes), check it, and
    compile its compute (Inductor pieces when asked): before `commit`, so a failure leaves
    the model intact."""
    gm = run_passes(gm, plan, extra=plan.config.user_passes)
    check_inference_only(gm, plan)
    compiled = gm.forward
    if plan.config.compiler == "inductor":
        from ..inductor import compile_pieces

        check_no_subclass_weights(plan, plan.schedule.runtime if plan.schedule else None)

        compiled = compile_pieces(gm, example_inputs, plan)
    return gm, compiled


def auto_residency(pristine: fx.GraphModule, plan: GraphPlan, runtime: Runtime, first: Callable,
                   given: Mapping[str, Any], reached: Sequence[str]) -> Callable:
    """``first`` (every block streamed) wrapped in the auto device budget's re-plans: each
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
        ctx = PassContext(config=config, example_inputs=example_inputs,
                          view=store_view(runtime, graph_params(gm, example_inputs)))
        ctx.forced_plan = forced
        plan = with_schedule(plan_graph(gm, ctx).with_mode(runtime.mode), runtime)
        # every block is stored already: the commit runs no collective
        return schedule_and_commit(gm, plan, runtime, example_inputs, given, reached)[1]

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


# [Note: a graph compiled again for stored weights]
# A frame Dynamo traces again only because its parameters became `StoredWeight`s gets back
# the scheduled graph made the first time: its passes, Inductor's kernels and dump are not
# made twice. The parameters a compile stores become `StoredWeight`s at the graph's first
# call (see [Note: when a parameter becomes a StoredWeight] in runtime/host_store.py), and
# Dynamo's guards check each parameter's type, so the model's next call fails them and
# Dynamo traces the frame again, once (every later model of the class passes one of the two
# entries: its first call the plain one, then the converted one). That trace gives the same
# graph over inputs of the same metadata, all stored already. The key is the graph's code,
# every input's metadata (not its type) and the options; a graph none of whose parameters
# is a `StoredWeight` of the model's runtime always compiles.
_SCHEDULED: "weakref.WeakValueDictionary[tuple, Callable]" = weakref.WeakValueDictionary()


def _graph_key(gm: fx.GraphModule, example_inputs: Sequence[Any], config: DLOConfig) -> tuple:
    def meta(v: Any) -> Any:
        if isinstance(v, torch.Tensor):  # sizes as traced: symbols where they are dynamic
            return ("tensor", tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.dtype,
                    str(v.device), v.requires_grad, isinstance(v, torch.nn.Parameter),
                    v.is_inference())
        return (type(v).__name__, str(v))

    traced = [n.meta.get("example_value", v)
              for n, v in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)]
    # The signature annotates each placeholder with its input's type: left out
    code = re.sub(r" : [\w.]+", "", gm.code)
    return (code, tuple(meta(v) for v in traced), repr(config))


# [Note: the modules a graph's parameters belong to]
# Every module that holds stored parameters is guarded (model/guard.py: ``state_dict``
# returns the real weights, ``.to()`` and ``load_state_dict`` are refused before anything
# changes) from the call that stores them; unguarded, ``model.state_dict()`` would return
# `StoredWeight`s that safetensors cannot serialise. The graph sees parameters, not
# modules: the compile finds the modules on Dynamo's frame (`frame_modules`,
# `compiled_roots`). A graph Dynamo reuses meets parameters no compile saw: the next
# layer's (a graph break inside the blocks makes one graph per layer) or another model's of
# the same class, whose blocks are stored on that call. So the first call of a graph for a
# runtime, and any call that stored new blocks, adopts the modules on the call stack that
# hold its parameters (`adopt_callers`: the modules being called, and the module locals of
# frames Dynamo compiled), as the compile adopts those on its frame. Both adopt under the
# runtime's lock.


def adopt(runtime: Runtime, modules: Sequence[torch.nn.Module],
          roots: Sequence[torch.nn.Module]) -> None:
    """`attach` ``modules`` (a graph's frame) and ``roots`` (the models compiled around
    it) to ``runtime``, so the model's later graphs find it, and watch them for parameters
    no graph reaches. Idempotent; the caller holds ``runtime.lock``."""
    attach(runtime, [*modules, *roots])
    runtime.watched.update([*modules, *roots])


def adopt_callers(runtime: Runtime, params: Sequence[torch.Tensor],
                  reached: Sequence[str] = ()) -> None:
    """`adopt` the modules on the stack that hold any of ``params``, nearest first: the
    modules being called (``self`` of each frame), every module among the locals of a frame
    Dynamo compiled (as `frame_modules` reads them at compile time: ``torch.compile(step)``
    of a ``step(model, ...)`` calls no module frame), and the compiled models around them.
    For the call of a graph Dynamo reused (see [Note: the modules a graph's parameters
    belong to]). ``reached``: the sources of the modules the graph's frame reached without
    a local (`reached_modules`), evaluated in the nearest frame Dynamo compiled."""
    with runtime.lock:  # a release waits; one that came first leaves nothing to adopt for
        if runtime.closed:
            return
        ours = {id(p) for p in params}
        modules: list[torch.nn.Module] = []
        frame = sys._getframe(1)
        while frame is not None:
            if torch_private.is_dynamo_code(frame.f_code):
                values = list(frame.f_locals.values()) + _evaluate(reached, frame)
                reached = ()  # the graph's own frame is the nearest one
            else:
                values = [frame.f_locals.get("self")] if "self" in frame.f_code.co_varnames else []
            for value in values:
                if (isinstance(value, torch.nn.Module) and all(value is not m for m in modules)
                        and any(id(p) in ours for p in value.parameters())):
                    modules.append(value)
            frame = frame.f_back
        wrapped = [torch_private.compiled_module_of(m) for m in modules]  # torch.compile wrappers
        roots = [m for m in wrapped if m is not None]
        adopt(runtime, [m for m, w in zip(modules, wrapped) if w is None
                        and all(m is not r for r in roots)], roots)


# [Note: parameters no graph reaches]
# A large parameter of a compiled model that no graph streams is reported, once. Only the
# parameters a graph reads are streamed; code Dynamo does not trace runs eagerly on the
# parameters as they are (a hook installed before the first call that runs the blocks
# itself, such as diffusers' MagCache; a forward Dynamo skips), and those stay resident on
# the device: on a real model, an out-of-memory error. So at the second call of a model's
# first graph (its first forward is complete then) the parameters of the modules it
# compiled that no graph stored or read are counted, and one RuntimeWarning names them and
# their bytes. Parameters below ``resident_bytes`` are left out: a graph would have kept
# them anyway.
def warn_unreached(runtime: Runtime) -> None:
    """Warn once per runtime about large parameters of its modules that no graph reached:
    see [Note: parameters no graph reaches]."""
    with runtime.lock:
        if runtime.reach_checked:
            return
        runtime.reach_checked = True
        seen: set[int] = set()
        unreached: list[tuple[str, int]] = []
        for module in list(runtime.watched):
            for name, p in module.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                nbytes = p.numel() * p.element_size()
                if (p in runtime.store or p in runtime.kept_resident
                        or nbytes <= max(runtime.config.resident_bytes, 0)):
                    continue
                unreached.append((name, nbytes))
    if not unreached:
        return
    shown = ", ".join(repr(n) for n, _ in unreached[:5])
    more = f" and {len(unreached) - 5} more" if len(unreached) > 5 else ""
    warnings.warn(
        f"dlo: {len(unreached)} parameters ({sum(b for _, b in unreached)} bytes: {shown}"
        f"{more}) were read by no compiled graph, so they are not streamed: they stay where "
        "they are, on the device, for the whole run. Code Dynamo runs eagerly reads them: "
        "most often a hook installed before the first call that calls the blocks itself "
        "(diffusers' enable_cache with MagCache, say), or a graph break around them. Enable "
        "such hooks after the first call, or release the model (dlo_fx.release) and run "
        "without them", RuntimeWarning, stacklevel=_caller_level())


def given_options(options: Any) -> dict[str, Any]:
    """The options a compile call set itself (validated), as a dict."""
    if isinstance(options, DLOConfig):
        return {f.name: getattr(options, f.name) for f in dataclasses.fields(DLOConfig)}
    try:
        DLOConfig.from_options(options)
    except ValueError as exc:  # the user's input: raised past Dynamo, not wrapped by it
        raise CompileOptionsError(str(exc)) from None
    return dict(options or {})


def scheduled_call(gm: fx.GraphModule, plan: GraphPlan, given: Mapping[str, Any],
                   example_inputs: Sequence[Any], compiled: Callable,
                   reached: Sequence[str] = ()) -> Callable:
    """``compiled``, each call bound to the runtime of the parameters it is called with
    (`GraphSchedule.bind`: Dynamo reuses a graph for other models of the same class) and
    run under that runtime's lock and collective clock (graph_call.py)."""
    sched = schedule_of(gm)
    positions = [i for i, v in enumerate(example_inputs) if isinstance(v, torch.nn.Parameter)]
    if not positions:  # no parameter: nothing to bind
        return compiled
    if sched is None:  # nothing streamed
        return unscheduled_call(compiled, positions)
    sched.direct = tuple(i for i in positions if i not in sched.arg_positions)
    sched.given = dict(given)
    budget_plan = plan.budget_plan

    def run(*args: Any) -> Any:
        bound = [args[i] for i in positions]
        with sched.call_lock:  # sched holds this call's binding: one call at a time
            runtime = sched.bind(bound)
            if runtime.store.pending:  # see [Note: when a parameter becomes a StoredWeight]
                with runtime.lock:
                    runtime.store.convert_pending()
            if runtime in sched.adopted and not runtime.reach_checked:
                warn_unreached(runtime)  # a second call: the first forward is complete
            note_graph(sched, bound, args)  # for gather-only forwards (forward_log.py)
            start = time.perf_counter()
            blocks = len(runtime.store.blocks)
            try:
                out = run_graph(runtime, sched, compiled, args)
            finally:
                runtime.drop_block_copy()  # resident copies are made: free their source
                if runtime not in sched.adopted or len(runtime.store.blocks) != blocks:
                    adopt_callers(runtime, bound, reached)  # a reused graph's: guard them
                    sched.adopted.add(runtime)
        if budget_plan is not None:
            budget_plan.measured_s = time.perf_counter() - start  # beside the prediction (memory_report)
        return out

    return run


def unscheduled_call(compiled: Callable, positions: Sequence[int]) -> Callable:
    """``compiled``, a graph with parameters and no schedule, reading the resident copy of
    each `StoredWeight` it is called with: see [Note: a graph compiled for another model
    of the class] in runtime/weight_reads.py."""
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
                args = runtime.direct_reads(args, positions, clock=True)
            finally:
                runtime.drop_block_copy()
            return compiled(*args)

    return run


def resolve_device(config: DLOConfig, example_inputs: Sequence[Any]) -> torch.device:
    if config.device is not None:
        return torch.device(config.device)
    for value in example_inputs:
        if isinstance(value, torch.nn.Parameter):
            return value.device
    for value in example_inputs:  # a meta tensor (a hook's placeholder) places nothing
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            return value.device
    return torch.device("cpu")


def check_inference_only(gm: fx.GraphModule, ctx: GraphPlan) -> None:
    """NotImplementedError naming the first graph input that requires grad, under grad
    mode, in a graph that streams weights: a parameter (stored or resident) or a tensor
    argument. Autograd would save views of the device slots for backward, and later blocks
    (or another model sharing the slots) overwrite them before it runs: backward raised
    autograd's "modified by an inplace operation", or read other weights."""
    if not torch.is_grad_enabled() or not ctx.blocks:
        return
    fqns = {id(info.param): info.fqn for info in ctx.params}
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), ctx.example_inputs):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            grapharg = node.meta.get("grapharg")
            what = (f"parameter {fqns[id(value)]!r}" if id(value) in fqns else
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
    """Move the graph's new blocks into the host store (their parameters become
    `StoredWeight`s at the graph's first call: see [Note: when a parameter becomes a
    StoredWeight]).

    Runs only after every pass succeeded, so a failing compile leaves the model as it was.
    """
    for block in ctx.blocks:
        for p in block.params:
            if block.host_block is None and p.param.device != runtime.device:
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
        if p.first >= 0 and p.param not in runtime.store and p.param.device != runtime.device:
            raise ValueError(
                f"resident parameter {p.fqn!r} ({p.reason}) is on {p.param.device} but dlo "
                f"computes on {runtime.device}; load the model with dlo_fx.load(...) so resident "
                "parameters are placed on the device")
    new = [b for b in ctx.blocks if b.host_block is None]
    if new:  # see [Note: a compile on one rank only] and [Note: storing blocks]
        what = f"a graph of {len(ctx.params)} parameters"
        if gathers(runtime):
            compile_clock(runtime, len(ctx.blocks), f"compiling {what}")
        rows = [(len(b.params), b.nbytes, b.params[0].fqn) for b in ctx.blocks]
        runtime.store_blocks([NewBlock([p.param for p in b.params], [p.fqn for p in b.params])
                              for b in new],
                             compile_facts(rows, [p.fqn for p in ctx.resident if p.first >= 0]),
                             what, convert=False)
    for p in ctx.resident:  # this graph reads them from the module: never stored later
        if p.first >= 0 and p.param not in runtime.store:
            runtime.kept_resident.setdefault(p.param, READ_DIRECTLY)
    plan = ctx.budget_plan
    if plan is not None:
        runtime.budget_plans[tuple(p.fqn for p in ctx.params)] = plan
        log.info("dlo: device_budget %d B keeps %d of %d blocks resident (%d B); predicted "
                 "%.3f ms per call (%.3f ms with every block streamed)", plan.device_budget,
                 len(plan.resident), len(plan.block_bytes), plan.resident_bytes,
                 plan.predicted_s * 1e3, plan.streamed_s * 1e3)
    log.info("dlo: scheduled a graph with %d blocks (budget %d bytes), %d resident parameters",
             len(ctx.blocks), ctx.budget, len(ctx.resident))


# -- the modules of the frame being compiled ----------------------------------------------
def frame_modules() -> list[torch.nn.Module]:
    """The modules among the locals of the frame Dynamo is compiling (``self`` of a
    ``forward``): their parameters are claimed by the graph's runtime, so every later
    graph of the model (after a graph break) finds it, and they are guarded. Read from
    Dynamo's current instruction translator (`torch_private`): a torch that lacks it fails
    here, loudly, rather than leaving models unguarded."""
    frame_locals = torch_private.compiling_frame_locals()
    if frame_locals is None:  # the backend called on a graph outside Dynamo
        return []
    return [v for v in frame_locals.values() if isinstance(v, torch.nn.Module)]


# [Note: models a frame reaches without a local]
# A model the compiled frame reaches only through a global is guarded too.
# ``torch.compile(step)`` of a ``step(x)`` that calls a global model (or
# ``pipe.transformer`` of a global pipeline) has no local naming the model, so
# `frame_modules` misses it; unguarded, its ``state_dict()`` would hold `StoredWeight`s and
# ``.to()`` would be refused only at the first stored parameter, the module half converted.
# Dynamo's tracker of every module it traced holds the module and the source it came from
# (``G['model']``, ``G['pipe'].transformer``; `torch_private.traced_modules`):
# `reached_modules` takes the outermost ones holding the graph's parameters. When Dynamo
# reuses the graph for another model behind the same name (the global reassigned),
# `adopt_callers` evaluates those sources in the graph's frame on the new model's first call.
def reached_modules(params: Sequence[torch.Tensor], found: Sequence[torch.nn.Module]
                    ) -> list[tuple[torch.nn.Module, str]]:
    """``(module, source)`` of the outermost modules, not under ``found``, holding any of
    ``params`` that the frame Dynamo is compiling reached: see [Note: models a frame
    reaches without a local]. Empty on a torch without Dynamo's tracker cache."""
    covered = {id(sub) for m in found for sub in m.modules()}
    reached: dict[int, tuple[torch.nn.Module, str]] = {}
    for module, name in torch_private.traced_modules():
        if id(module) not in covered:
            reached.setdefault(id(module), (module, name))
    inside = {id(sub) for m, _ in reached.values() for sub in m.modules() if sub is not m}
    ours = {id(p) for p in params}
    return [(m, name) for key, (m, name) in reached.items()
            if key not in inside and any(id(p) in ours for p in m.parameters())]


def _evaluate(sources: Sequence[str], frame: Any) -> list[Any]:
    """The values of Dynamo source names (``G['model']``) in ``frame``; those that fail
    to evaluate are skipped."""
    scope = {"G": frame.f_globals, "L": frame.f_locals}
    values = []
    for name in sources:
        try:
            # Dynamo's own source names: item and attribute reads, as its guards do
            values.append(eval(name, {"__builtins__": {}}, scope))  # noqa: S307
        except Exception:
            continue
    return values


def outermost_callers(modules: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The outermost modules holding ``modules``' parameters: the ``self`` of the
    outermost module call on the stack that holds any of them (the model whose call is
    running: a frame Dynamo compiles after a graph break is a block's ``forward``, whose
    locals name the block only), else the outermost of ``modules``. ``storage_dtype``'s
    layer rule names layers from the model's root, as diffusers does (see [Note: storing
    weights in another dtype])."""
    ours = {id(p) for m in modules for p in m.parameters()}
    found: list[torch.nn.Module] = list(modules)
    frame = sys._getframe(1)
    while frame is not None and ours:
        value = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        value = torch_private.compiled_module_of(value) or value  # torch.compile's wrapper
        if isinstance(value, torch.nn.Module) and all(value is not m for m in found) and any(
                id(p) in ours for p in value.parameters()):
            found.append(value)
        frame = frame.f_back
    inside = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inside]


def compiled_roots(modules: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules the user compiled (``torch.compile(model)``) whose call is on the stack
    and which contain one of ``modules``.

    Dynamo compiles the frames it can: when a model's own ``forward`` is skipped (its first
    instruction breaks the graph, or a decorator Dynamo does not trace), each submodule's
    ``forward`` becomes a graph of its own, with only that submodule in its locals
    (diffusers' Mochi). Without the root, every such graph would find no runtime and make
    one: six host stores for one model. The compiled module's call frame names the root."""
    if not modules:
        return []
    ours = {id(p) for m in modules for p in m.parameters()}
    if not ours:
        return []
    roots: list[torch.nn.Module] = []
    frame = sys._getframe(1)
    while frame is not None:
        wrapper = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        root = torch_private.compiled_module_of(wrapper)
        if root is not None:
            if all(root is not r for r in roots) and any(id(p) in ours for p in root.parameters()):
                roots.append(root)
        frame = frame.f_back
    return roots

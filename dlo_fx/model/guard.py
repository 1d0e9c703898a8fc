"""What keeps a module with stored weights whole outside the graph, and `release`.

[Note: a module with stored weights]
A module holding stored parameters refuses, before anything changes, every operation that
would change them; a refusal never leaves it half changed. Each stored parameter is a
`StoredWeight` (`runtime/weights/stored.py`): every read of it is exact and every write to it is
refused, one tensor at a time. What a tensor cannot see is the module around it, so the
modules that hold stored parameters get these guards:

- ``module.to(...)``, ``.cpu()``, ``.half()`` and every other ``nn.Module._apply``: the
  conversion function is first tried on an empty tensor of each stored parameter's dtype
  and device, of its shape and strides for a 4-D or 5-D one (``.to(memory_format=...)``
  restrides those). Where it changes none (``.to("cpu:0")`` on a CPU runtime, which
  accelerate's offload hooks call) the stored parameters are skipped and the rest of the
  module (buffers, resident parameters) is converted as usual. Where it would change any,
  ``ValueError`` names the parameter and the way out (`release` first, or load with
  ``dtype=``) before anything is converted: ``_apply`` converts parameter by parameter,
  so a refusal of the first stored one alone (in the dispatch) would leave the module half
  converted;
- ``state_dict()`` returns the stored weights (new host tensors) in place of the
  `StoredWeight`s, so ``safetensors.torch.save_file`` and ``save_pretrained`` work;
- ``load_state_dict`` of a dict that holds a stored parameter's key raises ValueError naming
  it before anything is loaded (a pre-hook on every guarded module checks its whole
  subtree, so the outermost module called refuses first). Keys of resident parameters and
  buffers load as usual;
- methods that rewrite several weights in place raise ValueError naming the method before
  anything changes (instance attributes shadowing the class's method): LoRA's fusing (a
  model's ``fuse_lora``/``unfuse_lora``, peft's layer ``merge``/``unmerge``),
  ``load_lora_adapter(..., hotswap=True)``, diffusers' ``enable_layerwise_casting`` and
  ``enable_group_offload``; a compiled pipeline's ``fuse_lora``/``unfuse_lora`` and its
  offloading (``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``,
  ``enable_group_offload``: `guard_pipeline`) refuse while a component's weights are stored. Refused one weight at
  a time, each would change the small resident weights (LoRA's adapters, norms) before the
  first stored one refused. A plain ``load_lora_adapter`` runs: the next call stores the
  new adapter like any new parameter; ``fuse_qkv_projections`` runs too (it reads the q, k
  and v weights and builds new ones, which the next call stores).

`release` puts the weights back into the parameters and closes the runtime: the module
is an ordinary module again.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .. import torch_private
from ..config import same_device
from ..runtime import (become_real, claim, is_stored, mark_released, owned_by, Owner,
                       owner_of, real_parameter, rebuilt, release_advice, runtimes_holding,
                       stored_tensor, was_released)
from .input_device import check_input_devices
from .state import ABSENT, guarded_modules, peek, state_of
from .storage_dtype import forget_storage_marks

__all__ = ["attach", "give_back", "guard_module", "guard_pipeline", "release", "restore",
           "shadow", "shadowing", "unguard_pipeline"]


def _in_store(t: torch.Tensor) -> bool:
    """A tensor whose weights a live dlo runtime stores (a `StoredWeight`, or a parameter
    of a compiled graph not called yet; of a tensor-parallel parameter, its local tensor)."""
    t = stored_tensor(t)
    runtime = owner_of((t,))
    return runtime is not None and t in runtime.store


def _stored(t: torch.Tensor) -> bool:
    """A `StoredWeight` whose weights a live dlo runtime stores (or a DTensor whose local
    tensor is one)."""
    return is_stored(stored_tensor(t)) and _in_store(t)


# -- .to() and every other _apply -------------------------------------------------------
def _check_conversion(module: nn.Module, fn: Callable) -> None:
    seen: set[int] = set()
    for fqn, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen or not _in_store(p):
            continue
        seen.add(id(p))
        probe = fn(_probe_like(p))
        restrided = (isinstance(probe, torch.Tensor) and probe.dim() in (4, 5)
                     and probe.stride() != p.stride())
        if isinstance(probe, torch.Tensor) and (
                not same_device(probe.device, p.device) or probe.dtype != p.dtype or restrided):
            # strides named only for a memory-format change
            to, had = ((f", strides {tuple(probe.stride())}", f", strides {tuple(p.stride())}")
                       if restrided else ("", ""))
            if _casts_layerwise(module):
                raise ValueError(
                    f"dlo: {type(module).__name__} has diffusers' layerwise casting enabled, "
                    f"which casts each layer's weights around its call (here {fqn!r} to "
                    f"{probe.dtype}); dlo cannot do that to weights in its host store (hooks "
                    "applied after dlo stored them). dlo stores "
                    "and casts them itself, once it takes the casting over. "
                    + release_advice(then="(the weights come back), then dlo_fx.offload(model) "
                                          "(it takes the casting over), then compile it")
                    + "; a pipeline: dlo_fx.compile_pipeline(pipe)")
            raise ValueError(
                f"dlo: cannot convert {type(module).__name__} to {probe.device} / "
                f"{probe.dtype}{to}: parameter {fqn!r} ({p.device}, {p.dtype}{had}) has its "
                "weights "
                "in a dlo host store, and the module is left unchanged. " + release_advice(
                    then="to put the weights back into the parameters", load=True))


def _casts_layerwise(module: nn.Module) -> bool:
    """diffusers' ``enable_layerwise_casting`` hook is on ``module`` (it calls ``.to()``)."""
    registry = getattr(module, "_diffusers_hook", None)
    return registry is not None and registry.get_hook("layerwise_casting") is not None


def _probe_like(p: torch.Tensor) -> torch.Tensor:
    """What a conversion is tried on in place of ``p``: an empty tensor of its dtype and
    device, or, for a 4-D or 5-D one, a tensor of its shape and strides (``.to(memory_format=
    ...)`` restrides only those; a conv weight is small). Its values are never read."""
    if p.dim() in (4, 5):
        return torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device)
    return torch.empty(0, dtype=p.dtype, device=p.device)


def _guarded_apply(module_ref: "weakref.ReferenceType[nn.Module]", original: Callable,
                   fn: Callable, *args: Any, **kwargs: Any) -> nn.Module:
    module = module_ref()
    if module is None:  # pragma: no cover - the bound method outlived its module
        raise RuntimeError("dlo: internal error: _apply of a collected module")
    _check_conversion(module, fn)
    # The stored parameters are left out of the conversion (it changes none of them): a
    # `StoredWeight` handed back by ``fn`` would be swapped into itself (torch swaps
    # tensor subclasses), and a real copy (``.to("cpu:0")`` copies a "cpu" tensor) would
    # be refused as ``param.data = ...``. Children are guarded modules of their own.
    stored = {k: p for k, p in module._parameters.items() if p is not None and _in_store(p)}
    for key in stored:
        module._parameters[key] = None
    try:
        return original(module, fn, *args, **kwargs)
    finally:
        module._parameters.update(stored)


# -- state_dict ---------------------------------------------------------------------------
def _real_weights(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for name, p in module._parameters.items():
        key = prefix + name
        if p is not None and key in state_dict and _stored(p):
            local = stored_tensor(p)
            state_dict[key] = rebuilt(p, owner_of((local,)).reads.host_tensor(local))


# -- load_state_dict ------------------------------------------------------------------------
def _refuse_load(module: nn.Module, state_dict: dict, prefix: str, *unused: Any) -> None:
    for name, p in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        if key in state_dict and _in_store(p):
            raise ValueError(
                f"dlo: cannot load_state_dict into {type(module).__name__}: parameter {key!r} "
                "has its weights in a dlo host store, where the compiled model reads them, and "
                "nothing was loaded. " + release_advice(
                    then="and load the weights, then compile the model again",
                    after="load the new checkpoint with dlo_fx.load"))


# -- diffusers and peft methods that rewrite the weights ---------------------------------------
#: method -> what it would do to the stored weights
_REWRITING = {
    "enable_layerwise_casting": "it casts the weights layer by layer",
    "enable_group_offload": "it moves the weights between devices",
    # diffusers' LoRA fusing (a model's, and a pipeline's for its components) and peft's
    # layer merging write through param.data, layer by layer
    "fuse_lora": "it adds the LoRA weights into the base weights in place",
    "unfuse_lora": "it subtracts the LoRA weights from the base weights in place",
    "merge": "it adds the adapter's weights into the base weights in place",
    "unmerge": "it subtracts the adapter's weights from the base weights in place",
}
_PEFT_ONLY = ("merge", "unmerge")  # generic names: shadowed on peft's layers only


def _refusal(owner: str, name: str) -> ValueError:
    if name == "enable_layerwise_casting":  # its hooks cast around every call: never works
        advice = "dlo stores and casts low-precision weights itself. " + release_advice(
            instead="load or compile the model with options={'storage_dtype': "
                    "torch.float8_e4m3fn} (the same layers and casts as layerwise casting)",
            then="and run it without dlo")
    else:
        advice = release_advice(instead=f"call {name}() before the weights are stored (before "
                                        "the model's first call compiled with backend='dlo')",
                                then="and compile it again")
    return ValueError(
        f"dlo: cannot call {owner}.{name}(): {_REWRITING[name]}, and its weights are in a "
        f"dlo host store; nothing was changed. {advice}")


def _refuse_rewrite(module_ref: "weakref.ReferenceType[nn.Module]", name: str,
                    *args: Any, **kwargs: Any) -> None:
    raise _refusal(type(module_ref()).__name__, name)


def _refuse_pickle(module_ref: "weakref.ReferenceType[nn.Module]", protocol: Any = None) -> None:
    """``__reduce_ex__`` of a guarded module: pickling it (``torch.save(model)``, pickle,
    a process handed the model) would copy a module whose guards are bound to this one and
    whose weights this runtime's host store holds; refused as ``copy.deepcopy`` is."""
    raise ValueError(
        f"dlo: cannot pickle this {type(module_ref()).__name__} (torch.save(model), pickle, "
        "multiprocessing): the weights of its parameters are in a dlo host store, which a "
        "copy would not own; nothing was written. " + release_advice(
            then="to put them back", after="save the weights alone: model.state_dict() "
                                           "(safetensors' save_file, save_pretrained)"))


def _refuse_deepcopy(module_ref: "weakref.ReferenceType[nn.Module]", memo: Any = None) -> None:
    """``__deepcopy__`` of a guarded module: the refusal of its first stored parameter's
    copy (`StoredWeight.__deepcopy__`, naming it), before anything is copied (without it,
    ``copy.deepcopy`` would reach the module's `_refuse_pickle` first)."""
    module = module_ref()
    for p in module.parameters():
        if is_stored(p):
            p.__deepcopy__(memo)  # raises, naming the parameter
    raise ValueError(f"dlo: cannot deepcopy this {type(module).__name__}: dlo guards it. " +
                     release_advice(then="to copy an ordinary module"))


def _guarded_lora_load(module_ref: "weakref.ReferenceType[nn.Module]", original: Callable,
                       *args: Any, **kwargs: Any) -> Any:
    """diffusers' ``load_lora_adapter``: a new adapter is stored by the next call like any
    new parameter, but ``hotswap=True`` copies it into the stored adapter's weights in
    place (peft's ``.data.copy_``), the small resident ones before the stored ones."""
    module = module_ref()
    bound = inspect.signature(original).bind(module, *args, **kwargs)
    if bound.arguments.get("hotswap"):
        raise ValueError(
            f"dlo: cannot hotswap a LoRA adapter into {type(module).__name__}: hotswapping "
            "copies the new adapter's weights into the loaded adapter's in place, and those "
            "are in a dlo host store; nothing was changed. " + release_advice(
                instead="load it without hotswap=True (the next call stores the new adapter "
                        "and Dynamo recompiles)"))
    return original(module, *args, **kwargs)


def _guarded_parallelism(module_ref: "weakref.ReferenceType[nn.Module]", original: Callable,
                         *args: Any, **kwargs: Any) -> Any:
    """diffusers' ``enable_parallelism``: context parallelism runs on stored weights (it
    splits the sequence, not the weights), tensor parallelism would distribute them:
    refused on every rank before diffusers builds a mesh or records the config (see
    [Note: a tensor-parallel parameter streams its local shard])."""
    module = module_ref()
    config = inspect.signature(original).bind(module, *args, **kwargs).arguments.get("config")
    tp = config if type(config).__name__ == "TensorParallelConfig" else \
        getattr(config, "tensor_parallel_config", None)
    if tp is not None and any(_stored(p) for p in module.parameters()):
        raise ValueError(
            f"dlo: cannot apply tensor parallelism to {type(module).__name__} "
            "(enable_parallelism with a TensorParallelConfig): it would distribute weights "
            "that are in a dlo host store; nothing was changed. Apply it first, then "
            "dlo_fx.offload(model, options) (dlo streams each rank's shard), or call "
            "dlo_fx.release(model) first and offload again after enable_parallelism")
    return original(module, *args, **kwargs)


def shadow(pipe: Any, name: str, func: Callable, refs: list, *rest: Any) -> None:
    """Put ``func`` over ``pipe``'s method ``name``, on the instance, as
    ``partial(func, weakref to pipe, refs, *rest)``; where it is there already (the
    pipeline compiled again), add ``refs`` to the list it holds. Nothing where the instance
    holds something else under ``name``."""
    installed = shadowing(pipe, name, func)
    if installed is not None:
        installed.args[1].extend(refs)
    elif name not in vars(pipe):
        vars(pipe)[name] = functools.partial(func, weakref.ref(pipe), list(refs), *rest)


def shadowing(pipe: Any, name: str, func: Callable) -> Optional[functools.partial]:
    """What `shadow` put over ``pipe``'s ``name`` with ``func``, or None."""
    installed = vars(pipe).get(name) if pipe is not None else None
    ours = isinstance(installed, functools.partial) and installed.func is func
    return installed if ours else None


_PIPELINE_OFFLOADS = {
    "enable_model_cpu_offload": "it moves each component between the host and the device "
                                "around its call, with accelerate hooks",
    "enable_sequential_cpu_offload": "it moves each layer's weights between the host and the "
                                     "device around its call, with accelerate hooks",
    "enable_group_offload": "it moves the components' weights between devices in groups",
}
"""A pipeline's own offloading, which would move (and re-wrap) the weights dlo streams."""
_PIPELINE_GUARDED = ("fuse_lora", "unfuse_lora", *_PIPELINE_OFFLOADS)


def guard_pipeline(pipe: Any, modules: list[nn.Module]) -> None:
    """Refuse, while any of ``modules`` (its compiled components) has stored weights, a
    pipeline's ``fuse_lora``/``unfuse_lora`` (it fuses text encoders through peft's layers,
    which a model's guards do not reach before their first call: an adapter loaded since)
    and its offloading (`_PIPELINE_OFFLOADS`: its hooks rebuilt each stored parameter as a
    plain one, a raw TypeError, after installing some hooks), before anything changes."""
    for name in _PIPELINE_GUARDED:
        original = getattr(type(pipe), name, None)
        if callable(original):
            shadow(pipe, name, _guarded_pipe_rewrite, [weakref.ref(m) for m in modules],
                   name, original)


def _guarded_pipe_rewrite(pipe_ref: Any, refs: list, name: str, original: Callable,
                          *args: Any, **kwargs: Any) -> Any:
    pipe = pipe_ref()
    if any(_stored(p) for ref in refs if ref() is not None for p in ref().parameters()):
        raise _offload_refusal(pipe, name) if name in _PIPELINE_OFFLOADS else \
            _refusal(type(pipe).__name__, name)
    return original(pipe, *args, **kwargs)


def _offload_refusal(pipe: Any, name: str) -> ValueError:
    return ValueError(
        f"dlo: cannot call {type(pipe).__name__}.{name}(): {_PIPELINE_OFFLOADS[name]}, and "
        "dlo offloads this pipeline already: it streams its compiled components' weights "
        "from a dlo host store, so they are never all on the device; nothing was changed. "
        + release_advice(instead="run the pipeline as it is",
                         then=f"to offload with {name}() instead of dlo (the pipeline then "
                              "runs without dlo)", target="pipe"))


# -- installing and removing ----------------------------------------------------------------
def _shadows(sub: nn.Module) -> dict[str, Callable]:
    """The instance attributes that shadow ``sub``'s class methods while it is guarded
    (an instance attribute wins over the class's method for this module only)."""
    ref = weakref.ref(sub)
    cls = type(sub)
    shadows = {"_apply": functools.partial(_guarded_apply, ref, cls._apply),
               "__reduce_ex__": functools.partial(_refuse_pickle, ref),
               "__deepcopy__": functools.partial(_refuse_deepcopy, ref)}
    shadows.update({name: functools.partial(_refuse_rewrite, ref, name) for name in _REWRITING
                    if callable(getattr(cls, name, None))
                    and (name not in _PEFT_ONLY or cls.__module__.startswith("peft."))})
    if callable(getattr(cls, "load_lora_adapter", None)):
        shadows["load_lora_adapter"] = functools.partial(_guarded_lora_load, ref,
                                                         cls.load_lora_adapter)
    if callable(getattr(cls, "enable_parallelism", None)):
        shadows["enable_parallelism"] = functools.partial(_guarded_parallelism, ref,
                                                          cls.enable_parallelism)
    return shadows


def attach(runtime: Owner, modules: Sequence[nn.Module]) -> None:
    """Attach ``modules`` to the runtime that stored their blocks (`Runtime.store_blocks`):
    claim every parameter of theirs, the resident ones too (the model's later graphs find
    the runtime through any of them), and guard those holding stored parameters. Called by
    the one attach sequence alone ([Note: one attach sequence] in loading/attach.py), the
    last of its steps. Idempotent."""
    claim((t for m in modules for p in m.parameters() for t in (p, stored_tensor(p))), runtime)
    for module in modules:
        if any(stored_tensor(p) in runtime.store for p in module.parameters()):
            guard_module(module)
            state = state_of(module)
            if state.input_check is None:  # see [Note: inputs on the compute device]
                state.input_check = module.register_forward_pre_hook(
                    check_input_devices(runtime.device), with_kwargs=True)


def guard_module(module: nn.Module) -> None:
    """Guard ``module`` and its submodules that hold stored parameters: see [Note: a
    module with stored weights]. Idempotent."""
    for sub in module.modules():
        direct = any(p is not None and _in_store(p) for p in sub._parameters.values())
        state = peek(sub)
        if state is None or state.guards is None:
            if sub is not module and not any(_in_store(p) for p in sub.parameters()):
                continue
            state = state_of(sub)
            state.guards = [sub.register_load_state_dict_pre_hook(_refuse_load)]
            shadows = _shadows(sub)
            state.shadowed = {name: vars(sub).get(name, ABSENT) for name in shadows}
            vars(sub).update(shadows)
        # Its own parameters may be stored after it was guarded (a layer's second graph,
        # after a graph break inside it): state_dict must read those from the store too.
        if direct and not state.state_hooked:
            state.guards.append(sub.register_state_dict_post_hook(_real_weights))
            state.state_hooked = True


def unguard_module(module: nn.Module) -> None:
    for sub in module.modules():
        state = peek(sub)
        if state is not None and state.input_check is not None:
            state.input_check.remove()
            state.input_check = None
        handles = state.guards if state is not None else None
        if handles is None:
            continue
        shadowed = state.shadowed or {}
        state.guards, state.shadowed, state.state_hooked = None, None, False
        for handle in handles:
            handle.remove()
        for name, before in shadowed.items():  # what the instance held, as it was
            if before is ABSENT:
                vars(sub).pop(name, None)
            else:
                vars(sub)[name] = before


def _give_back(p: torch.Tensor, value: torch.Tensor, holders: list[nn.Module]) -> None:
    """Give stored parameter ``p`` its weights back, in place (the same object). Where
    something outside Python holds its tensor (the swap refuses then), the modules in
    ``holders`` get a new parameter in its place instead; ``p`` itself reads nothing
    afterwards (its runtime is closed)."""
    try:
        become_real(p, value)
        return
    except RuntimeError:
        mark_released(p)
    fresh = real_parameter(p, value)
    for module in holders:
        for name, q in module._parameters.items():
            if q is p:
                module._parameters[name] = fresh


def release(model: nn.Module) -> nn.Module:
    """Put the weights dlo stores for ``model`` back into its parameters and free its
    runtime (host store, resident copies, and slots nothing else uses); then `restore` it.

    Each parameter comes back a tensor of its own, with its values and, where they are
    dense, its strides (a transposed weight stays transposed): a parameter that was a view of
    a larger tensor (a storage offset, a strided slice, q and k cut from one fused tensor)
    is no view any more, so ``.to()``, ``torch.save`` and ``save_pretrained`` treat it as
    any parameter. Afterwards the module runs eagerly, can be saved, moved or cast like any
    module; see [Note: a released module is as on the first day]. Models
    that share parameters (a layer assigned to both) share one runtime, so releasing one
    releases them all: every parameter the runtime stores gets its weights back. Every
    rank of an allgather shard group must call it (the blocks are gathered). Returns
    ``model``. Final and idempotent: releasing a released model again does nothing. Raises
    ValueError when nothing of ``model`` ever was dlo's: no parameter stored by dlo, no
    ``backend="dlo"`` compile to undo.
    """
    modules = give_back(model)
    if modules is None:
        if restore(model) or was_released(model.parameters()):
            return model
        raise ValueError(f"dlo_fx.release: no parameter of {type(model).__name__} is in a dlo "
                         "host store (was it offloaded with dlo_fx.offload, loaded with "
                         "dlo_fx.load or compiled with dlo_fx.compile_pipeline?)")
    for module in modules:
        restore(module)
    return model


def give_back(model: nn.Module) -> Optional[list[nn.Module]]:
    """The weights of `release`, without undoing what a compile left on the modules: put
    the stored weights back, close the runtimes, unguard the modules, and return them;
    None where no parameter of ``model`` is stored."""
    params = list(dict.fromkeys(stored_tensor(p) for p in model.parameters()))
    runtimes = runtimes_holding(params)
    if not runtimes:
        return None
    with contextlib.ExitStack() as locks:
        for runtime in runtimes:  # a graph another thread is running finishes first
            locks.enter_context(runtime.lock)
        for runtime in runtimes:
            runtime.machine.drain(raise_errors=False)
        # Closing a runtime shared with another model left that model's parameters
        # without weights: all of them come back, and the other model's guards come off too.
        ids = {id(p) for p in params}
        params += [p for p in owned_by(runtimes) if id(p) not in ids]
        ids.update(id(p) for p in params)
        modules = [model, *(m for m in guarded_modules()
                            if any(id(stored_tensor(p)) in ids for p in m.parameters()))]
        values = []
        for p in params:  # read everything first: a failure leaves the model as it was
            runtime = owner_of((p,))
            # A parameter of a graph not called yet is still real (host_store.py)
            if runtime is not None and p in runtime.store and is_stored(p):
                values.append((p, runtime.reads.host_tensor(p).to(runtime.attachment.home
                                                                   or p.device)))
        holders = [m for root in modules for m in root.modules()]
        for p, value in values:
            _give_back(p, value, holders)
        for runtime in runtimes:
            if runtime.attachment.undo_moves is not None:  # what offload moved to the device
                runtime.attachment.undo_moves()
            runtime.close()
    for module in modules:
        unguard_module(module)
    return modules


# -- what a compile left on a module ------------------------------------------------------------
# [Note: a released module is as on the first day]
# `release` is final and idempotent (as diffusers' ``remove_all_hooks`` and accelerate's
# ``remove_hook_from_module``): the module is an ordinary module again, releasing it twice
# does nothing the second time, and nothing dlo left on it stores its weights again by
# itself; only `dlo_fx.offload` (or `compile_pipeline`) makes it dlo's again, with any
# options. Besides the weights, a compile leaves: ``module.compile(backend="dlo")``'s
# compiled ``_compiled_call_impl`` (diffusers' ``compile_repeated_blocks`` sets one on
# each block); `compile_pipeline`'s compiled methods as instance attributes (a VAE's
# ``encode``/``decode``) and its guard on the pipeline's LoRA fusing; and
# ``storage_dtype``'s marks on the parameters. `restore` removes them, so those handles run
# the module as it now is, eagerly. A ``torch.compile`` wrapper the caller holds cannot be
# reached from the module: its next call traces the released model again and the backend
# refuses it, naming `release` and `offload` (see [Note: one way in] in
# dynamo/backend.py); offloaded again, the model runs through it as before. Not undone:
# ``eval()`` and ``requires_grad_(False)`` (`offload` sets them, and the module's earlier
# modes are not kept), and the values of weights stored in a lower-precision dtype (they
# are the values that dtype holds).
DLO_BACKENDS = ("dlo", "dlo_backend")
"""The names a ``torch.compile`` wrapper gives dlo's backend: the registered one, or the
function's name when the function itself was passed as ``backend=``."""


def restore(module: nn.Module) -> int:
    """Undo what a ``backend="dlo"`` compile left on ``module`` and its submodules besides
    the weights (see [Note: a released module is as on the first day]); returns how many
    things were undone."""
    count = forget_storage_marks(module)
    for sub in module.modules():
        # ``_compiled_call_impl`` (module.compile) and compiled methods set on the instance
        for name, value in list(vars(sub).items()):
            if torch_private.compile_backend_name(value) in DLO_BACKENDS:
                del vars(sub)[name]
                count += 1
            elif torch_private.compile_backend_name(
                    getattr(value, "__wrapped__", None)) in DLO_BACKENDS:
                value.__wrapped__ = None  # cfg_parallel's call around it stays
                count += 1
    return count


def unguard_pipeline(pipe: Any) -> int:
    """Remove `guard_pipeline`'s refusals from ``pipe``; returns how many."""
    count = 0
    for name in _PIPELINE_GUARDED:
        if shadowing(pipe, name, _guarded_pipe_rewrite) is not None:
            del vars(pipe)[name]
            count += 1
    return count

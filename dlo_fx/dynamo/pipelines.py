"""`compile_pipeline`: stream every large torch module of a diffusers pipeline.

A diffusers pipeline holds several torch modules: the denoiser (``transformer``,
``transformer_2`` for a Wan2.2-style pair, or ``unet``), one to three text encoders (a
T5-XXL is about 9 GB, as large as many transformers), an image encoder, and a VAE. Each
one chosen is compiled in place (``module.compile(backend="dlo", options=...)``), so
``pipe.transformer`` stays the same object: the pipeline reads its ``config`` and
``dtype`` as before, and every call of it runs through the dlo backend. A pipeline calls
its VAE through ``vae.decode(...)`` and ``vae.encode(...)``, never ``vae(...)``, which is all
``module.compile`` wraps: those methods (`ENTRY_METHODS`) are compiled too, as instance
attributes of the module, or a VAE named in ``components=`` ran eagerly and kept its
weights, with no error.

The components run one after the other within a pipeline call (text encoders, then the
denoising loop, then the VAE), never at the same time, and are compiled with the same
options (each half where it belongs: see [Note: options belong to a verb] in config.py):
each keeps its own host store, and they share one set of ``num_slots`` device
slots, sized for the largest block of any of them (see [Note: what a model owns and what a
device shares] in runtime/device/shared_slots.py).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..config import (DLOConfig, conflict_error, did_you_mean, runtime_conflicts, same_device,
                      split_options)
from ..loading.offload import check_hooks, compute_device, offload
from ..model.cfg_pairs import cache_refusal
from ..model.cfg_parallel import cfg_parallel, cfg_refusal, group_ranks
from ..model.guard import guard_pipeline, restore, shadow, shadowing, unguard_pipeline
from ..model.guard import release as release_module
from ..model.storage_dtype import take_over_hooks
from ..runtime import owner_of, runtimes_holding, was_released

log = logging.getLogger(__name__)

__all__ = ["compile_pipeline", "default_components", "release"]

SKIPPED_BY_DEFAULT = ("vae",)
"""Component name prefixes not compiled unless named in ``components=``: the VAE runs once
per call on full-resolution activations, and its weights are small."""


ENTRY_METHODS = ("encode", "decode")
"""Methods a pipeline calls on a component instead of calling it (a VAE's), compiled with
it where its class defines them."""


def default_components(pipe: Any) -> list[str]:
    """Names of the torch modules of ``pipe`` that `compile_pipeline` compiles by default:
    every ``nn.Module`` component except the VAE(s), in the pipeline's own order."""
    return [name for name, value in _components(pipe).items()
            if isinstance(value, nn.Module) and not name.startswith(SKIPPED_BY_DEFAULT)]


def compile_pipeline(pipe: Any, *, options: Union[Mapping[str, Any], DLOConfig, None] = None,
                     components: Optional[Sequence[str]] = None, cfg_group: Any = None,
                     **compile_kwargs: Any) -> Any:
    """Compile the large torch modules of a diffusers pipeline with ``backend="dlo"``.

    Args:
        pipe: a ``diffusers.DiffusionPipeline`` (anything with a ``components`` dict of
            named modules works).
        options: the dlo options, the same for every component, of both kinds: those of
            each component's runtime (`DLOConfig`, given to the `dlo_fx.offload` of each
            component not stored yet) and those of its compile (`CompileOptions`, given to
            its ``torch.compile``). See [Note: options belong to a verb].
        components: names of the components to compile; default: every torch module but
            the VAE (`default_components`: transformer(s) or unet, text encoder(s), image
            encoder). Name ``"vae"`` here to stream it too.
        cfg_group: two ranks that compute the guidance branches of the denoiser(s)
            (``transformer``, ``transformer_2``, ``unet``), one branch each, and exchange
            the noise predictions: `dlo_fx.cfg_parallel` (a list of two global ranks, a
            ProcessGroup or a DeviceMesh): a batched call split, the two calls of a step
            (Wan, Flux's ``true_cfg_scale``) paired. A pipeline with a third call per step,
            or diffusers' cache enabled on a denoiser, is refused by name. Give
            ``options["shard_group"]`` the same ranks to hold 1/2 of every block each.
            Default None (no split).
        compile_kwargs: further ``torch.compile`` arguments (``dynamic=``, ``fullgraph=``).

    Returns ``pipe``, its modules compiled in place, sharing one set of slots (see [Note:
    what a model owns and what a device shares] in runtime/device/shared_slots.py). Outputs are
    bit-identical to the resident pipeline's. A component with diffusers' layerwise casting
    enabled streams its weights in the storage dtype and casts
    them in the graph (`dlo_fx.model.storage_dtype.take_over_layerwise_casting`). Each streamed
    component is offloaded (`dlo_fx.offload`: its weights move into the dlo host store)
    before anything traces, and the other torch modules move to the compute device
    (``options["device"]``, else the accelerator, else the CPU), so the pipeline executes
    there; the modules are set to eval mode and ``requires_grad=False`` (dlo streams
    weights for inference only).

    Raises ValueError naming an unknown or non-module component, a bad option, or runtime
    options that differ from those a component's runtime was made with (`dlo_fx.load`,
    `dlo_fx.offload`, an earlier compile_pipeline), before anything changes: the pipeline
    keeps working as it was; `release` it first to change them.
    """
    # a bad option fails here, before anything compiles
    runtime_options, compile_options = split_options(options)
    config = DLOConfig.from_options(runtime_options)
    if "backend" in compile_kwargs or "options" in compile_kwargs:
        raise ValueError("compile_pipeline: pass the dlo options as options=...; the "
                         "backend is always 'dlo'")
    if compile_kwargs.get("mode") not in (None, "default"):
        raise ValueError(f"compile_pipeline: mode={compile_kwargs['mode']!r} is not supported "
                         "by backend 'dlo' (it takes mode=None or 'default'); drop mode= and "
                         "use options={'compiler': 'inductor'} to compile the compute with "
                         "Inductor")
    found = _components(pipe)
    names = default_components(pipe) if components is None else list(components)
    if isinstance(components, str):
        names = [components]
    for name in names:
        value = found.get(name, getattr(pipe, name, None))
        if not isinstance(value, nn.Module):
            modules = [n for n, v in found.items() if isinstance(v, nn.Module)]
            what = "is not a component" if value is None else f"is a {type(value).__name__}"
            raise ValueError(f"compile_pipeline: components={name!r} {what} of "
                             f"{type(pipe).__name__}, not a torch module; "
                             f"{did_you_mean(name, modules) if value is None else ''}"
                             f"its torch modules: {', '.join(modules) or 'none'}")
    for name in names:
        _check_runtime(pipe, name, runtime_options)
    if getattr(pipe, "_all_hooks", None):  # enable_model_cpu_offload's, on every component
        raise ValueError(
            f"compile_pipeline: {type(pipe).__name__} has accelerate's offload hooks "
            "(enable_model_cpu_offload), which move each component between the host and the "
            "device around its call; dlo offloads the pipeline itself; nothing was changed. "
            "Remove them first: pipe.remove_all_hooks(), then dlo_fx.compile_pipeline(pipe)")
    for name in names:
        if owner_of(getattr(pipe, name).parameters()) is None:
            check_hooks(getattr(pipe, name))
    denoisers = _cfg_denoisers(pipe, found, cfg_group)
    device = compute_device(config)
    for name in names:
        module = getattr(pipe, name)
        module.eval().requires_grad_(False)
        taken = take_over_hooks(module)  # see [Note: storing weights in another dtype]
        if taken:
            log.info("dlo_fx.compile_pipeline: %s.%s: diffusers' layerwise casting of %d layers "
                     "taken over (stored in their storage dtype, cast in the graph)",
                     type(pipe).__name__, name, taken)
        if owner_of(module.parameters()) is None:  # not loaded nor offloaded yet
            offload(module, runtime_options)  # before anything traces: see offload.py
        module.compile(backend="dlo", options=compile_options, **compile_kwargs)
        for method in ENTRY_METHODS:
            if callable(getattr(type(module), method, None)) and method not in vars(module):
                setattr(module, method, torch.compile(getattr(module, method), backend="dlo",
                                                      options=compile_options,
                                                      **compile_kwargs))
        log.info("dlo_fx.compile_pipeline: %s.%s (%s, %d parameters) compiled with "
                 "backend='dlo'", type(pipe).__name__, name, type(module).__name__,
                 sum(1 for _ in module.parameters()))
    for name in denoisers:
        cfg_parallel(getattr(pipe, name), cfg_group, timeout_s=config.collective_timeout_s)
    _execute_on(pipe, names, device)
    guard_pipeline(pipe, [getattr(pipe, name) for name in names])
    _measure_first_run(pipe, [getattr(pipe, name) for name in names], config)
    return pipe


DENOISERS = ("transformer", "unet")
"""Component name prefixes of the denoiser(s): what ``cfg_group=`` splits."""


def _cfg_denoisers(pipe: Any, found: Mapping[str, Any], cfg_group: Any) -> list[str]:
    """The denoisers ``cfg_group`` splits; ``ValueError`` naming the pipeline (or the group)
    before anything changes where it cannot (see [Note: a CFG-parallel call])."""
    if cfg_group is None:
        return []
    cls = type(pipe)
    why = cfg_refusal(cls)
    if why is not None:
        raise ValueError(f"compile_pipeline: cfg_group={cfg_group!r}: {cls.__name__} {why}; "
                         "nothing was changed. Run the ranks as data-parallel replicas "
                         "(shard_group over them) or split its sequence instead")
    names = [n for n, m in found.items() if n.startswith(DENOISERS) and isinstance(m, nn.Module)]
    if not names:
        raise ValueError(f"compile_pipeline: cfg_group={cfg_group!r}: {cls.__name__} has no "
                         "transformer or unet component to split")
    for name in names:
        why = cache_refusal(found[name])
        if why is not None:
            raise ValueError(f"compile_pipeline: cfg_group={cfg_group!r}: {name}: {why}; "
                             "nothing was changed")
    group_ranks(cfg_group)  # a bad group fails here, before anything compiles
    return names


RUN_ENDS = "maybe_free_model_hooks"
"""The method a diffusers pipeline calls as its ``__call__`` ends, after the VAE decode
(where model offloading resets its hooks)."""


def _measure_first_run(pipe: Any, modules: Sequence[nn.Module], config: DLOConfig) -> None:
    """Keep every block of ``modules`` streamed until ``pipe``'s first run has ended.

    [Note: a pipeline's first run is measured whole]
    ``device_budget="auto"`` plans resident blocks from what it measured, and within a
    pipeline run the transformer's calls are not all there is: the VAE decode after the
    last step, often the run's largest allocation, comes after the plan. Planned from the
    transformer's first call alone, the first run's decode would meet a device the
    resident blocks had filled and could fail with torch's out-of-memory error, raised to
    code dlo does not run. So the first run streams every block: its calls
    measure their activations, and the work after the last one (the decode, the next
    run's text encoders) is measured as the work between two calls ([Note: the auto device
    budget]) before any block goes resident, as a warm-up run is measured whole before a
    residency plan is applied. The run's end is the pipeline's own signal: every diffusers
    pipeline whose ``__call__`` calls ``maybe_free_model_hooks`` (`RUN_ENDS`) calls it last.
    A pipeline that never calls it keeps its plan as for a model compiled alone; a run that
    raises before its end keeps every block streamed until a run completes."""
    if config.device_budget != "auto":
        return
    call = getattr(type(pipe), "__call__", None)
    code = getattr(inspect.unwrap(call), "__code__", None) if call is not None else None
    original = getattr(type(pipe), RUN_ENDS, None)
    if code is None or RUN_ENDS not in code.co_names or not callable(original):
        return
    runtimes = {id(rt): rt for m in modules if (rt := owner_of(m.parameters())) is not None}
    for runtime in runtimes.values():
        runtime.hold_resident = f"{type(pipe).__name__}'s first run"
    if runtimes:
        shadow(pipe, RUN_ENDS, _run_ended, [weakref.ref(rt) for rt in runtimes.values()],
               original)


def _run_ended(pipe_ref: Any, refs: list, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """The pipeline's first run ended: plan the auto budget from the next call on."""
    pipe = pipe_ref()
    try:
        return original(pipe, *args, **kwargs)
    finally:
        _forget_first_run(pipe, refs)


def _forget_first_run(pipe: Any, refs: Optional[list] = None) -> int:
    """Stop holding the blocks of ``pipe``'s first run streamed and remove the signal
    `_measure_first_run` installed; returns 1 if it was installed."""
    installed = shadowing(pipe, RUN_ENDS, _run_ended)
    if refs is None:
        refs = installed.args[1] if installed is not None else []
    for ref in refs:
        runtime = ref()
        if runtime is not None:
            runtime.hold_resident = None
    if installed is not None:
        del vars(pipe)[RUN_ENDS]
    return int(installed is not None)


def _execute_on(pipe: Any, streamed: Sequence[str], device: torch.device) -> None:
    """Move the torch modules of ``pipe`` that dlo does not stream (the VAE) to the
    compute device, as ``pipe.to(device)`` would: the pipeline then executes there
    (diffusers' ``_execution_device`` is the device of its modules' parameters, the
    streamed ones' `StoredWeight`s included), its latents are made there, and every
    component computes on one device. The meta device is left out: moving a module there
    would drop its values, and a planning run has no use for the VAE's."""
    if device.type == "meta":
        return
    for name, module in _components(pipe).items():
        if name in streamed or not isinstance(module, nn.Module):
            continue
        if any(not same_device(t.device, device) for t in module.parameters()) or any(
                not same_device(t.device, device) for t in module.buffers()):
            module.to(device)
            log.info("dlo_fx.compile_pipeline: %s.%s (not streamed) moved to %s",
                     type(pipe).__name__, name, device)


def _check_runtime(pipe: Any, name: str, given: Mapping[str, Any]) -> None:
    """``ValueError`` when the runtime options ``given`` differ from those component
    ``name``'s runtime was made with: they would not reach it."""
    runtime = owner_of(getattr(pipe, name).parameters())
    conflicts = runtime_conflicts(given, runtime.config) if runtime is not None else []
    if conflicts and not runtime.closed:
        raise conflict_error(conflicts, "compile_pipeline",
                             f"{type(pipe).__name__}.{name} (release pipe)")


def release(target: Any) -> Any:
    """Put the weights dlo stores back into a module's parameters, or into every streamed
    component of a diffusers pipeline; returns ``target``.

    A module: see `dlo_fx.model.guard.release`. A pipeline (anything with a
    ``components`` dict): every torch module component whose weights dlo stores is
    released, and every component, stored or only compiled, is restored (see [Note: a
    released module is as on the first day] in model/guard.py), so the pipeline can be
    saved, moved or cast as usual, and compiling it again (`compile_pipeline`) takes any
    options. Final and idempotent: releasing a released pipeline again does nothing.
    Raises ValueError when nothing in ``target`` ever was dlo's (no weights stored, no
    compile to undo), and TypeError for anything but a module or a pipeline."""
    if isinstance(target, nn.Module):
        return release_module(target)
    found = getattr(target, "components", None)
    if not isinstance(found, Mapping):
        raise TypeError(f"dlo_fx.release takes a torch module (nn.Module) or a diffusers "
                        f"pipeline (an object with a 'components' dict), not a "
                        f"{type(target).__name__}")
    modules = {n: m for n, m in found.items() if isinstance(m, nn.Module)}
    stored = [n for n, m in modules.items() if runtimes_holding(list(m.parameters()))]
    for name in stored:
        module = modules[name]
        if runtimes_holding(list(module.parameters())):  # a shared runtime may be gone
            release_module(module)
        log.info("dlo_fx.release: %s.%s released", type(target).__name__, name)
    undone = (sum(restore(m) for m in modules.values()) + unguard_pipeline(target)
               + _forget_first_run(target))
    if not stored and not undone and not any(was_released(m.parameters())
                                             for m in modules.values()):
        raise ValueError(f"dlo_fx.release: no component of {type(target).__name__} "
                         f"({', '.join(modules) or 'it has no torch modules'}) has weights "
                         "in a dlo host store or a dlo compile to undo (was it compiled "
                         "with compile_pipeline, or its transformer loaded with dlo_fx.load?)")
    return target


def _components(pipe: Any) -> dict[str, Any]:
    found = getattr(pipe, "components", None)
    if not isinstance(found, Mapping):
        raise ValueError(f"compile_pipeline: {type(pipe).__name__} has no 'components' dict; "
                         "pass a diffusers pipeline (or compile a module with "
                         "torch.compile(module, backend='dlo'))")
    return dict(found)



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

[Note: one set of slots for a pipeline]
Every component is compiled with the same options, so its graphs go to the runtime those
options select; they run one after the other within a pipeline call (text encoders, then
the denoising loop, then the VAE), never at the same time, so one set of ``num_slots``
device slots, sized for the largest block of any of them, serves them all. Where a runtime
belongs to one model, each component gets its own host store; the slots are then shared
as far as the runtime shares them per device.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .config import DLOConfig
from .module_guard import guard_pipeline
from .storage_dtype import mark_model, take_over_layerwise_casting

log = logging.getLogger(__name__)

__all__ = ["compile_pipeline", "default_components"]

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
                     components: Optional[Sequence[str]] = None, **compile_kwargs: Any) -> Any:
    """Compile the large torch modules of a diffusers pipeline with ``backend="dlo"``.

    Args:
        pipe: a ``diffusers.DiffusionPipeline`` (anything with a ``components`` dict of
            named modules works).
        options: the dlo options, the same for every component (see `DLOConfig`).
        components: names of the components to compile; default: every torch module but
            the VAE (`default_components`: transformer(s) or unet, text encoder(s), image
            encoder). Name ``"vae"`` here to stream it too.
        compile_kwargs: further ``torch.compile`` arguments (``dynamic=``, ``fullgraph=``).

    Returns ``pipe``, its modules compiled in place (see [Note: one set of slots for a
    pipeline]). Outputs are bit-identical to the resident pipeline's. A component with
    diffusers' layerwise casting enabled streams its weights in the storage dtype and casts
    them in the graph (`dlo_fx.storage_dtype.take_over_layerwise_casting`). The weights move into
    the dlo host store at each module's first call; the modules are set to eval mode and
    ``requires_grad=False`` (dlo streams weights for inference only).

    Raises ValueError naming an unknown or non-module component, or a bad option.
    """
    config = DLOConfig.from_options(options)  # a bad option fails here, before anything compiles
    if "backend" in compile_kwargs or "options" in compile_kwargs:
        raise ValueError("compile_pipeline: pass the dlo options as options=...; the "
                         "backend is always 'dlo'")
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
                             f"{type(pipe).__name__}, not a torch module; its torch modules: "
                             f"{', '.join(modules) or 'none'}")
    for name in names:
        module = getattr(pipe, name)
        module.eval().requires_grad_(False)
        taken = take_over_layerwise_casting(module)  # see [Note: storing weights in another dtype]
        if config.storage_dtype is not None:  # before the first trace: every call exact
            mark_model([module], config.storage_dtype, _device_of(module, config))
        if taken:
            log.info("dlo_fx.compile_pipeline: %s.%s: diffusers' layerwise casting of %d layers "
                     "taken over (stored in their storage dtype, cast in the graph)",
                     type(pipe).__name__, name, taken)
        module.compile(backend="dlo", options=options, **compile_kwargs)
        for method in ENTRY_METHODS:
            if callable(getattr(type(module), method, None)) and method not in vars(module):
                setattr(module, method, torch.compile(getattr(module, method), backend="dlo",
                                                      options=options, **compile_kwargs))
        log.info("dlo_fx.compile_pipeline: %s.%s (%s, %d parameters) compiled with "
                 "backend='dlo'", type(pipe).__name__, name, type(module).__name__,
                 sum(1 for _ in module.parameters()))
    guard_pipeline(pipe, [getattr(pipe, name) for name in names])
    return pipe


def _components(pipe: Any) -> dict[str, Any]:
    found = getattr(pipe, "components", None)
    if not isinstance(found, Mapping):
        raise ValueError(f"compile_pipeline: {type(pipe).__name__} has no 'components' dict; "
                         "pass a diffusers pipeline (or compile a module with "
                         "torch.compile(module, backend='dlo'))")
    return dict(found)



def _device_of(module: nn.Module, config: DLOConfig) -> torch.device:
    if config.device is not None:
        return torch.device(config.device)
    return next((p.device for p in module.parameters()), torch.device("cpu"))

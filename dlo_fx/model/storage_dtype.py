"""Which parameters are stored in a low-precision dtype, and diffusers' layerwise casting.

[Note: storing weights in another dtype]
With ``options={"storage_dtype": torch.float8_e4m3fn}`` the output is bit-identical to the
model run resident with diffusers' layerwise casting, while only fp8 bytes are stored and
moved. The weights of a model's linear and convolution layers are stored as fp8 bytes: the
host store, the files `dlo-fx shard` writes, the transfers and the slots hold those bytes,
and the graph casts each weight to the parameter's own dtype on the device right after its
slot view (see [Note: a storage dtype] in `runtime/host/layout.py`). The layers are the ones
diffusers' ``enable_layerwise_casting`` picks (`layerwise_layers`): its default skip
patterns, the model's ``_skip_layerwise_casting_patterns`` and ``_keep_in_fp32_modules``,
and peft's adapter layers; the casts are the same (``fp8 -> compute dtype`` before the
layer runs).

The choice is a record per parameter (`mark_storage` makes a `StorageChoice`, read by
`storage_dtype_of`), made
on the whole model before its first graph is scheduled, so a graph Dynamo reuses for the
next layer stores that layer's weights the same way. A stored parameter keeps its own dtype
(a bf16 `StoredWeight` whose bytes are fp8): that is what Dynamo traces with, what
``model.dtype`` reports (diffusers reports the compute dtype of a layerwise-cast model too),
and what a read outside the graph returns.

diffusers' own hooks cannot run on a compiled model: each one casts its module's
parameters with ``module.to()`` around every call, which breaks Dynamo's graph at every
layer (with any backend, up to the recompile limit) and would rewrite the stored weights.
`take_over_layerwise_casting` replaces them before the model is stored (`dlo_fx.offload`
and `dlo_fx.compile_pipeline` call it; once the weights are stored it is refused): it removes each layer's hook, puts the parameter back
in the compute dtype (the fp8 values, exactly) and marks it to be stored in the hook's
storage dtype.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from ..runtime import (StorageChoice, choose_storage, is_composite, is_stored,
                       runtimes_holding, storage_choice, storage_dtype_of)
from ..torch_private import swap_in_place

__all__ = ["DEFAULT_SKIP_PATTERNS", "layerwise_layers", "mark_storage", "storage_dtype_of",
           "take_over_layerwise_casting"]

DEFAULT_SKIP_PATTERNS = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")
"""diffusers' default ``skip_modules_pattern`` of layerwise casting: module names
(``re.search``) whose weights keep their dtype."""

CAST_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
               nn.ConvTranspose3d, nn.Linear)
"""The layer classes layerwise casting casts (diffusers' supported PyTorch layers)."""



def skip_patterns(root: nn.Module) -> tuple[str, ...]:
    """The skip patterns diffusers' ``enable_layerwise_casting`` uses on ``root`` by
    default: the defaults, the model's ``_keep_in_fp32_modules`` and
    ``_skip_layerwise_casting_patterns``, and peft's adapter layer names."""
    patterns = list(DEFAULT_SKIP_PATTERNS)
    for attr in ("_keep_in_fp32_modules", "_skip_layerwise_casting_patterns"):
        patterns += list(getattr(root, attr, None) or ())
    try:
        from peft.tuners.loha.layer import LoHaLayer
        from peft.tuners.lokr.layer import LoKrLayer
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:
        pass
    else:
        for layer in (LoHaLayer, LoKrLayer, LoraLayer):
            patterns += list(layer.adapter_layer_names)
    return tuple(dict.fromkeys(patterns))


def layerwise_layers(root: nn.Module, patterns: Optional[Sequence[str]] = None
                     ) -> Iterator[tuple[str, nn.Module]]:
    """The layers of ``root`` whose weights layerwise casting stores in low precision, as
    diffusers picks them: walking down from ``root``, a module whose name matches a skip
    pattern is left out with everything under it, and a linear or convolution layer is
    taken whole."""
    patterns = skip_patterns(root) if patterns is None else tuple(patterns)

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        if prefix and any(re.search(p, prefix) for p in patterns):
            return
        if isinstance(module, CAST_LAYERS):
            yield prefix, module
            return
        for name, child in module.named_children():
            yield from walk(child, f"{prefix}.{name}" if prefix else name)

    return walk(root, "")


def _unmarked(root: nn.Module) -> Iterator[torch.Tensor]:
    """The floating-point parameters of ``root``'s layerwise-cast layers not marked yet (a
    quantized weight keeps its own bytes)."""
    for _, layer in layerwise_layers(root):
        for p in layer.parameters(recurse=False):
            if (p.dtype.is_floating_point and storage_choice(p) is None
                    and not is_composite(p)):
                yield p


def mark_storage(root: nn.Module, dtype: torch.dtype) -> int:
    """Mark the floating-point parameters of ``root``'s layerwise-cast layers to be stored
    in ``dtype``; returns how many were marked. Parameters already marked keep their mark
    (a layer diffusers' hook was taken over from keeps the hook's dtype)."""
    count = 0
    for p in list(_unmarked(root)):
        choose_storage(p, StorageChoice(dtype))
        count += 1
    return count


def take_over_layerwise_casting(root: nn.Module) -> int:
    """Replace diffusers' layerwise-casting hooks under ``root`` by dlo's storage dtype (see
    [Note: storing weights in another dtype]); returns the number of layers taken over.
    Call it before the model is compiled: the hooks' ``module.to()`` calls break Dynamo's
    graph. A model without the hooks is left as it is, with a warning: it streams its
    weights in their own dtype. A model whose weights dlo stores already is refused:
    `dlo_fx.offload` and `compile_pipeline` take the casting over themselves."""
    if runtimes_holding(list(root.parameters())):
        hooked = any(_hook_of(m) is not None for m in root.modules())
        raise ValueError(
            f"dlo: take_over_layerwise_casting: the weights of this {type(root).__name__} are "
            "in a dlo host store already (offloaded, loaded or compiled), where diffusers' "
            "casting cannot be taken over; nothing was changed. " + (
                "Call dlo_fx.release(model) first, then dlo_fx.offload(model), which takes "
                "the casting over, then compile it" if hooked else
                "dlo_fx.offload and dlo_fx.compile_pipeline take the casting over "
                "themselves: drop this call (or make it before dlo_fx.offload)"))
    count = take_over_hooks(root)
    if count == 0:
        warnings.warn(
            f"dlo: take_over_layerwise_casting found no layerwise-casting hooks under this "
            f"{type(root).__name__}, so nothing changes: its weights stream in their own "
            "dtype. Call model.enable_layerwise_casting(storage_dtype=...) first, or compile "
            "with options={'storage_dtype': ...}", UserWarning, stacklevel=2)
    return count


def take_over_hooks(root: nn.Module) -> int:
    """`take_over_layerwise_casting` without the warning (`compile_pipeline` runs it on
    every component, most of which have no hooks)."""
    count = 0
    for module in root.modules():
        hook = _hook_of(module)
        if hook is None:
            continue
        registry = module._diffusers_hook
        # The hook refuses to be removed (it would have to cast the fp8 weights back,
        # which it cannot do without loss); dlo keeps the fp8 values, so nothing is lost.
        hook.deinitalize_hook = lambda module: module
        registry.remove_hook("layerwise_casting", recurse=False)
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dtype != hook.storage_dtype or not p.dtype.is_floating_point:
                continue
            with torch.no_grad():
                value = nn.Parameter(p.detach().to(hook.compute_dtype), p.requires_grad)
            vars(value).update(vars(p))
            swap_in_place(p, value)  # the same object, in the compute dtype
            # the fp8 values in the compute dtype; the model's own choice: release keeps it
            choose_storage(p, StorageChoice(hook.storage_dtype, rounded=True, from_hook=True))
        count += 1
    return count


def _hook_of(module: nn.Module) -> Optional[object]:
    """diffusers' layerwise-casting hook on ``module`` itself, or None."""
    registry = getattr(module, "_diffusers_hook", None)
    return registry.get_hook("layerwise_casting") if registry is not None else None


def forget_storage_marks(root: nn.Module) -> int:
    """Remove the storage-dtype marks ``options["storage_dtype"]`` put on ``root``'s
    parameters (`dlo_fx.release`: a later compile takes other options); returns how many.
    Marks that stand for diffusers' layerwise casting taken over (`take_over_hooks`) are
    the model's own and stay. The values stay those the storage dtype holds: they are
    the model's weights now."""
    count = 0
    for p in root.parameters():
        choice = storage_choice(p)
        if choice is not None and not choice.from_hook:
            choose_storage(p, None)
            count += 1
    return count


def check_castable_pairs(pairs: Mapping[tuple[torch.dtype, torch.dtype], str],
                         device: torch.device) -> None:
    """`check_castable` of each ``(stored, compute)`` pair, naming its first holder."""
    for (stored, compute), what in pairs.items():
        check_castable(stored, compute, device, what)


def check_castable(stored: torch.dtype, compute: torch.dtype, device: torch.device,
                   what: str) -> None:
    """ValueError when ``device`` cannot cast ``stored`` weights to ``compute`` and back
    (fp8 on a device without fp8 conversions), before anything is stored."""
    try:
        probe = torch.zeros(2, dtype=compute, device=device)
        probe.to(stored).to(compute)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise ValueError(
            f"dlo: {what} would be stored as {stored} and computed as {compute}, but {device} "
            f"cannot cast between them ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "choose a storage_dtype the device converts (bfloat16 or float16), or compute on "
            "another device") from None


def mark_model(roots: Sequence[nn.Module], dtype: Optional[torch.dtype],
               device: torch.device) -> None:
    """Apply ``options["storage_dtype"]`` to the models being offloaded: mark their
    layerwise-cast layers' parameters (`mark_storage`), check that ``device`` casts each
    marked dtype pair, then give every marked parameter not stored yet its storage dtype's
    values (`round_to_storage`): a layer that never reaches a graph (a frame Dynamo skips
    after a graph break runs eagerly) computes with them too, as the layerwise-cast model
    does, and storing them later is exact."""
    marked: dict[tuple[torch.dtype, torch.dtype], str] = {}
    unrounded = []
    for root in roots:
        if dtype is not None:
            mark_storage(root, dtype)
        for name, p in root.named_parameters():
            stored = storage_dtype_of(p)
            if stored is None or is_stored(p):
                continue
            marked.setdefault((stored, p.dtype), f"parameter {name!r}")
            if not storage_choice(p).rounded and not is_composite(p):
                unrounded.append(p)
    check_castable_pairs(marked, device)
    for p in unrounded:
        round_to_storage(p)


def round_to_storage(param: torch.Tensor) -> None:
    """Give a marked parameter that stays resident (never stored) the values its storage
    dtype holds, in place: the layer computes with ``fp8 -> compute dtype`` values, as the
    layerwise-cast model does, whether or not dlo streams it. Idempotent."""
    stored, choice = storage_dtype_of(param), storage_choice(param)
    if stored is None or is_composite(param) or choice.rounded:
        return
    with torch.no_grad():
        param.copy_(param.to(stored).to(param.dtype))
    choose_storage(param, dataclasses.replace(choice, rounded=True))


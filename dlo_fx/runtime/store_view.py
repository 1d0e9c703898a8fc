"""`store_view`: the frozen `StoreView` of a runtime that planning takes (see planning/view.py).

Built by the backend for each plan (and by the loader for its mode choice) from the
parameters it plans: where each is stored, its bytes as stored, why the runtime keeps it
resident, and whether dlo can lay out its bytes at all (`unstreamable`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Iterable, Optional

import torch

from ..torch_private import dtensor_local, is_traceable_wrapper_subclass
from .device import platform
from .host.layout import leaf_tensors, param_bytes, span_bytes, storage_dtype_of
from .weights.stored import is_stored
from ..planning.view import ParamFacts, StoreView

if TYPE_CHECKING:  # runtime.py sits beside this module, and imports nothing of it
    from .runtime import Runtime


def store_view(runtime: Optional[Runtime], params: Iterable[torch.Tensor] = (), *,
               free_memory: bool = False) -> StoreView:
    """The `StoreView` of ``runtime`` (a `Runtime`, or None: a graph no model owns, planned
    on the CPU) for ``params``. ``free_memory``: measure the device's free memory too (the
    auto device budget's capacity, `dlo_fx.planning.settle.settle_budget`)."""
    facts = {id(p): param_facts(runtime, p) for p in params}
    if runtime is None:
        device = torch.device("cpu")
        free = _free(device) if free_memory else None
        return StoreView(device=device, mode=None, dp=1, num_slots=0,
                         params=MappingProxyType(facts), free_bytes=free)
    return StoreView(
        device=runtime.device, mode=runtime.mode, dp=runtime.group.dp,
        num_slots=runtime.slots.num_slots, params=MappingProxyType(facts),
        slot_bytes=runtime.slots.total_bytes,
        auto_resident_bytes=sum(runtime.shared.auto_resident.values()),
        bandwidths=runtime.probed_bandwidths,
        flops=MappingProxyType(dict(runtime.probed_flops)),
        budget_plans=MappingProxyType(dict(runtime.budget_plans)),
        block_ends=runtime.attachment.block_ends,
        free_bytes=_free(runtime.device) if free_memory else None)


def _free(device: torch.device) -> Optional[int]:
    figures = platform.free_and_total(device)
    return figures[0] if figures is not None else None


def param_facts(runtime: Optional[Runtime], param: torch.Tensor) -> ParamFacts:
    """``param`` as ``runtime`` holds it (stored or not)."""
    why = unstreamable(param)
    kept = runtime.kept_resident.get(param) if runtime is not None else None
    if why is not None:
        return ParamFacts(nbytes=0, kept=kept, unstreamable=why)
    entry = runtime.store.entry(param) if runtime is not None else None
    if entry is None:
        stored_as = storage_dtype_of(param)  # see [Note: a storage dtype] in host/layout.py
        return ParamFacts(nbytes=param_bytes(param, stored_as), stored_as=stored_as, kept=kept)
    stored_as = entry.dtype if entry.compute_dtype is not None else None
    return ParamFacts(nbytes=param_bytes(param, stored_as), stored_as=stored_as,
                      fqn=entry.fqn, block=entry.block, kept=kept)


def check_streamable(param: torch.Tensor, fqn: str) -> None:
    """ValueError naming ``fqn`` where dlo cannot lay out ``param``'s bytes (`unstreamable`)."""
    why = unstreamable(param)
    if why is not None:
        raise ValueError(f"dlo: parameter {fqn!r} {why}")


def unstreamable(param: torch.Tensor) -> Optional[str]:
    """Why dlo cannot lay out ``param``'s bytes (the rest of a sentence that begins
    ``dlo: parameter '<fqn>'``), or None: a tensor subclass with no storage of its own that
    does not flatten into plain tensors (``__tensor_flatten__``). A traceable subclass made of plain tensors (torchao's
    quantized weights) streams as those tensors: see [Note: a quantized weight is its inner
    tensors] in runtime/host/layout.py. A DTensor: its local tensor (see [Note: a
    tensor-parallel parameter streams its local shard])."""
    if is_stored(param):
        return None
    kind = f"{type(param).__module__}.{type(param).__qualname__}"
    local = dtensor_local(param)
    if local is not None:  # its local tensor streams: see runtime/weights/tensor_parallel.py
        return unstreamable(local)
    if not is_traceable_wrapper_subclass(param):
        if _has_storage(param):
            return None
        return (f"is a {kind}, a tensor subclass with no storage of its own that does not "
                "implement __tensor_flatten__/__tensor_unflatten__, so dlo cannot find its "
                "bytes, and nothing was stored. Make the subclass traceable (as torchao's are), "
                "or run the model without dlo")
    try:
        leaves = leaf_tensors(param)
    except Exception as exc:  # a flatten that fails, or names attributes it lacks
        return (f"is a {kind} whose __tensor_flatten__ failed ({type(exc).__name__}: {exc}); "
                "dlo cannot lay out its inner tensors, and nothing was stored")
    bad = [x for x in leaves if is_traceable_wrapper_subclass(x) or not _has_storage(x)]
    if bad:
        return (f"is a {kind} whose inner tensors include a {type(bad[0]).__qualname__} "
                "without storage of its own; dlo streams subclasses made of plain tensors "
                "only, and nothing was stored")
    return None


def _has_storage(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are a storage of its own (a wrapper subclass has a storage
    object of the right size whose data pointer cannot be read)."""
    if t.numel() == 0:
        return True
    try:
        storage = t.untyped_storage()
        storage.data_ptr()
        return storage.nbytes() >= span_bytes(t)
    except (NotImplementedError, RuntimeError, TypeError):
        return False


__all__ = ["check_streamable", "param_facts", "store_view", "unstreamable"]

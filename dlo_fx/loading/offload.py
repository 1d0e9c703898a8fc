"""`dlo_fx.offload`: make a model that lives in memory a streamed model before anything
traces it, the in-memory counterpart of `dlo_fx.load`.

[Note: a streamed model exists before Dynamo traces it]
When Dynamo first sees a model, it is already what dlo runs: its streamed parameters
`StoredWeight`s on the *compute device* (their bytes in the host store), its other
parameters and buffers on that device. Dynamo traces parameters with the devices they have:
a model whose parameters are host tensors, called with device inputs, fails inside Dynamo's
fake-tensor propagation (two devices in one matmul) before any backend is called, and one
called with host inputs computes on the host. FSDP2's ``fully_shard``, diffusers'
``enable_group_offload`` and accelerate's ``cpu_offload`` also prepare the model before
``torch.compile``, and `dlo_fx.load` does for a checkpoint; the backend refuses a model
neither made dlo's ([Note: one way in] in dynamo/backend.py). `offload` does it for a model
in memory (on the host or on the device), in the loader's order: plan the blocks from the
module alone (`loading.plan.split_params`, the rules the loader and the passes share),
store them through `Runtime.store_blocks` (one agreement between the ranks, here),
convert, move the rest, attach. A compile then maps the graph's parameters onto the stored
blocks, as it does for a loaded model.

The compute device is ``options["device"]``, else the accelerator ``torch.accelerator``
reports, else the CPU. ``"meta"`` is a compute device too: the model traces, plans,
dumps and "runs" there (outputs of the right shape, no values), which is how a machine
without the accelerator plans for it; the host store still holds the real bytes, and
`release` gives them back.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..config import DLOConfig, canonical_device
from ..model.storage_dtype import mark_model, take_over_hooks
from ..runtime import (NewBlock, owner_of, platform, refusal as tp_refusal, Runtime,
                       shard_fact, storage_dtype_of, stored_tensor, unstreamable)
from .attach import Planned, attach_model
from .plan import block_rows, model_targets, resident_fact, split_params

log = logging.getLogger(__name__)

__all__ = ["check_hooks", "check_model", "compute_device", "offload", "offload_module"]


def compute_device(config: DLOConfig) -> torch.device:
    """Where a model offloaded with ``config`` computes: ``config.device``, else the
    accelerator, else the CPU (`config.canonical_device` spelling). ValueError naming the
    option where this machine has no such device, before anything is made there."""
    if config.device is not None:
        missing = platform.missing_device(torch.device(config.device))
        if missing is not None:
            there = platform.accelerator()
            raise ValueError(
                f"dlo option 'device'={config.device!r}: {missing}; compute on 'cpu', on "
                "'meta' (plan and trace without values)"
                + (f", on {there.type!r} (its devices: {there.type}:0, ...)" if there else "")
                + ", or leave device unset (the accelerator, else the CPU)")
        return canonical_device(config.device)
    return canonical_device(platform.default_device())


def offload(model: nn.Module, options: Union[Mapping[str, Any], DLOConfig, None] = None, *,
            resident: Sequence[str] = ()) -> nn.Module:
    """Store ``model``'s weights in a dlo host store and make it compute on the device.

    See [Note: a streamed model exists before Dynamo traces it]. The parameters are
    grouped into blocks as `dlo_fx.load` groups them (registration order, the largest
    layer per block unless ``block_bytes`` says otherwise); each streamed parameter
    becomes a `StoredWeight` on the compute device (``options["device"]``, else the
    accelerator, else the CPU); the other parameters and the buffers move to that
    device. diffusers' layerwise casting (``enable_layerwise_casting``) is taken over, as
    `compile_pipeline` does: those layers' weights are stored in the storage dtype and cast
    in the graph, so every call is exact against the layerwise-cast model resident. Then
    ``torch.compile(model, backend="dlo")`` (or ``model.compile(...)``) streams the blocks
    with this runtime, each compile with its own compile options. ``dlo_fx.release(model)`` is the inverse:
    the weights come back where they were.

    Args:
        model: an ``nn.Module`` whose parameters are on one device (the host or the
            compute device), not compiled yet.
        options: the options of the model's runtime (dict or `DLOConfig`); a compile
            option (``compiler``, ``trace``, ``dump_dir``, ...) raises ValueError naming
            ``torch.compile``, where it belongs (see [Note: options belong to a verb]).
        resident: FQNs or module prefixes of parameters to keep on the device instead of
            streaming (as `dlo_fx.load`'s ``resident=``).

    Returns ``model``, in eval mode with ``requires_grad=False`` parameters. Raises
    ValueError, naming the parameter or buffer and the way out, before anything changes
    (see [Note: what offload moves]).
    """
    config = DLOConfig.from_options(options, verb="dlo_fx.offload")
    device = compute_device(config)
    check_model(model, device)
    take_over_hooks(model)  # see [Note: storing weights in another dtype]
    offload_module(model, config, device, resident=resident)
    return model


def offload_module(model: nn.Module, config: DLOConfig, device: torch.device, *,
                   resident: Sequence[str] = ()) -> Runtime:
    """`offload` without its checks: store ``model``'s blocks for a runtime of ``config``
    computing on ``device``, the model in eval mode without grads, and return that
    runtime."""
    home = _home_device(model)

    def plan(runtime: Runtime) -> Planned:
        check_streamable_params(model, device, config.storage_dtype)
        # See [Note: storing weights in another dtype]: marked, checked and rounded at
        # once, before the blocks are sized in their storage dtype
        mark_model([model], config.storage_dtype, device)
        params, _ = model_targets(model, None)
        split = split_params(params, config, resident, "dlo_fx.offload")
        moves = Moves(model, device, {id(t.tensor) for b in split["blocks"] for t in b})

        def store() -> tuple[list[int], list[torch.Tensor]]:
            blocks = [NewBlock([t.tensor for t in b], [t.fqn for t in b])
                      for b in split["blocks"]]
            indices = runtime.store_blocks(
                blocks, [resident_fact(split["resident"]),
                         shard_fact([_held(model, b.params) for b in blocks],
                                    [b.fqns[0] for b in blocks])],
                f"offloading {type(model).__name__}")
            return indices, [target.tensor for target in split["named"]]

        return Planned(model, block_rows(split["blocks"]), split["blocks"], split["ends"],
                       store, len(split["resident"]), home=home, moves=moves.apply)

    return attach_model(config, device, "dlo_fx.offload", plan)[0]


def check_streamable_params(model: nn.Module, device: torch.device,
                            storage_dtype: Optional[torch.dtype] = None) -> None:
    """ValueError naming the first parameter of ``model`` whose bytes dlo cannot lay out
    (`store_view.unstreamable`), or, tensor-parallel, that it cannot stream on ``device``
    (`tensor_parallel.refusal`), or in a ``storage_dtype``: asked before anything is
    marked or laid out."""
    for fqn, p in model.named_parameters():
        why = tp_refusal(p, device) or unstreamable(stored_tensor(p))
        if why is None and stored_tensor(p) is not p and (
                storage_dtype is not None or storage_dtype_of(p) is not None):
            why = ("is a DTensor (tensor-parallel), which dlo does not store in another "
                   "dtype (storage_dtype, or diffusers' layerwise casting) yet; nothing was "
                   "stored. Offload it without storage_dtype")
        if why is not None:
            raise ValueError(f"dlo: parameter {fqn!r} {why}")


def _held(model: nn.Module, stored: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters of ``model`` (as its modules hold them: a DTensor) whose stored
    tensors are ``stored``, in that order."""
    by_id = {id(stored_tensor(p)): p for p in model.parameters()}
    return [by_id.get(id(t), t) for t in stored]


def check_model(model: Any, device: Optional[torch.device] = None) -> None:
    """ValueError, before anything changes, for what `offload` cannot take (to ``device``,
    where given: a buffer it cannot move there; `Moves` checks every member again once
    the plan says which parameters move)."""
    from .. import torch_private

    if not isinstance(model, nn.Module):
        raise TypeError(f"dlo_fx.offload takes a torch module (nn.Module), not a "
                        f"{type(model).__name__}; for a diffusers pipeline use "
                        "dlo_fx.compile_pipeline(pipe)")
    inner = torch_private.compiled_module_of(model)
    if inner is not None:
        raise ValueError(
            f"dlo_fx.offload takes the module, not the torch.compile wrapper of a "
            f"{type(inner).__name__}: offload the module first, then compile it: "
            "dlo_fx.offload(model); torch.compile(model, backend='dlo')")
    backend = torch_private.compile_backend_name(getattr(model, "_compiled_call_impl", None))
    if getattr(model, "_compiled_call_impl", None) is not None and backend != "dlo":
        raise ValueError(
            f"dlo_fx.offload: {type(model).__name__} is already compiled with backend "
            f"{backend!r} (module.compile); its graphs would read the weights as they were "
            "traced. Offload the module first, then compile it with backend='dlo': "
            "dlo_fx.offload(model); model.compile(backend='dlo')")
    loop = _contains_itself(model)
    if loop is not None:
        raise ValueError(
            f"dlo_fx.offload: {type(model).__name__} contains itself: submodule {loop!r} is "
            "a module it is inside of (a module set as an attribute of one of its own "
            "submodules, or of its torch.compile wrapper, which sets it on the module); "
            "torch cannot walk such a model (model.to, state_dict recurse forever): keep the "
            "reference outside the module, e.g. in a dict or with object.__setattr__")
    if next(model.parameters(), None) is None:
        raise ValueError(
            f"dlo_fx.offload: {type(model).__name__} has no parameters, so dlo has nothing to "
            "store (its buffers alone would move to the device, with nothing to give them "
            "back by at release); move it with model.to(device) instead")
    check_hooks(model)
    seen: dict[int, str] = {}
    devices: dict[torch.device, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen[id(p)] = fqn
        runtime = owner_of((p,))
        if runtime is not None and not runtime.closed:
            raise ValueError(
                f"dlo_fx.offload: parameter {fqn!r} of {type(model).__name__} is already "
                "stored by dlo (offloaded, loaded with dlo_fx.load, compiled with "
                "backend='dlo', or shared with such a module); call dlo_fx.release on the "
                "model that holds it first, or offload the model that holds both once")
        if p.is_meta:
            raise ValueError(
                f"dlo_fx.offload: parameter {fqn!r} is on the meta device (it has no weights "
                "to store); build the model with its weights, or load them from a "
                "checkpoint with dlo_fx.load")
        devices.setdefault(canonical_device(p.device), fqn)
    for fqn, b in model.named_buffers(remove_duplicate=False):
        if device is not None and b.is_meta and device.type != "meta":
            raise _no_values("buffer", fqn, device)
    if len(devices) > 1:
        shown = ", ".join(f"{name!r} on {d}" for d, name in devices.items())
        raise ValueError(
            f"dlo_fx.offload: the parameters of {type(model).__name__} are on "
            f"{len(devices)} devices ({shown}); move the model to one device first "
            "(model.to('cpu')), then offload it")


def check_hooks(model: nn.Module) -> None:
    """ValueError, before anything changes, where another offloading holds ``model``'s
    weights: accelerate's hooks (``cpu_offload``, a ``device_map``, a pipeline's
    ``enable_model_cpu_offload``/``enable_sequential_cpu_offload``: sequential offloading
    leaves the parameters on the meta device, its hooks holding the weights) or diffusers'
    group offloading. Their hooks move the weights around each call, which dlo cannot do
    to weights in its host store, and dlo offloads the model itself."""
    for name, sub in model.named_modules():
        where = f"on {name!r}" if name else "on the model"
        if hasattr(sub, "_hf_hook"):
            raise ValueError(
                f"dlo_fx.offload: {type(model).__name__} has accelerate's offload hooks "
                f"({where}: accelerate's cpu_offload or a device_map, or a pipeline's "
                "enable_model_cpu_offload / enable_sequential_cpu_offload), which move its "
                "weights around each call; dlo offloads the model itself. Remove them first "
                "(the weights come back): accelerate.hooks.remove_hook_from_module(model, "
                "recurse=True), or pipe.remove_all_hooks() for a pipeline, then offload it")
        registry = getattr(sub, "_diffusers_hook", None)
        if registry is not None and registry.get_hook("group_offloading") is not None:
            raise ValueError(
                f"dlo_fx.offload: {type(model).__name__} has diffusers' group offloading "
                f"({where}: enable_group_offload), which moves its weights between devices "
                "around each call; dlo offloads the model itself. Build or load the model "
                "again without enable_group_offload, then offload it")


def _contains_itself(model: nn.Module) -> Optional[str]:
    """The name of the first submodule of ``model`` that is a module it sits inside of
    (the module graph has a loop), or None."""
    inside: set[int] = set()

    def walk(module: nn.Module, prefix: str) -> Optional[str]:
        inside.add(id(module))
        for name, child in module._modules.items():
            fqn = f"{prefix}.{name}" if prefix else name
            if child is None:
                continue
            if id(child) in inside:
                return fqn
            found = walk(child, fqn)
            if found is not None:
                return found
        inside.discard(id(module))
        return None

    return walk(model, "")


def _home_device(model: nn.Module) -> torch.device:
    """Where the model's parameters are before it is offloaded: `release` puts them back
    there."""
    p = next(model.parameters(), None)
    return canonical_device(p.device) if p is not None else torch.device("cpu")


# [Note: what offload moves]
# Besides storing the streamed parameters, `offload` moves every other member
# ``model.to(device)`` would move onto the compute device: the resident parameters and every
# buffer, persistent or not (tensors held in plain attributes stay where they are, as
# ``model.to`` leaves them). Each is moved while the plan is made, before the ranks agree
# and before anything is stored (`Moves`): one that cannot move (a buffer on the meta
# device, which has no values to copy) is a ValueError naming it, raised on every rank,
# and the model is left as it was; where they all moved, the copies are put in place after
# the blocks are stored. `release` puts each back where it was (`Moves.apply`'s undo):
# moved back to its own device (its values then are those the model left in it), or, from
# the meta device, whose tensors hold no values, the original tensor itself, which the
# runtime keeps for it. A buffer held by several modules comes back one tensor again.
class Moves:
    """The members of ``model`` that offloading to ``device`` moves (every parameter not in
    ``stored``, the ids of those stored, and every buffer), each already moved: see [Note:
    what offload moves]. ValueError naming the first that cannot move."""

    def __init__(self, model: nn.Module, device: torch.device, stored: set[int]) -> None:
        self.keep = device.type == "meta"
        self.params: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        self.moved: dict[int, torch.Tensor] = {}
        for prefix, module in model.named_modules():
            dot = prefix + "." if prefix else ""
            for name, p in module._parameters.items():
                if p is None or id(stored_tensor(p)) in stored or id(p) in self.moved \
                        or canonical_device(p.device) == device:
                    continue
                self.moved[id(p)] = _moved(p.data, device, "parameter", dot + name)
                self.params.append((p, self.moved[id(p)]))
            for name, b in module._buffers.items():
                if b is None or canonical_device(b.device) == device:
                    continue
                if id(b) not in self.moved:
                    self.moved[id(b)] = _moved(b, device, "buffer", dot + name)
                self.buffers.append((module, name, b))

    def apply(self) -> Callable[[], None]:
        """Put every moved copy in its place; returns the undo (for `release`)."""
        # The undo holds the modules and parameters weakly: the runtime lives as long as a
        # parameter it stores (owners.py), and a strong reference back to the model would
        # keep both alive for ever.
        params = [(weakref.ref(p), p.device, p.data if self.keep else None)
                  for p, _ in self.params]
        buffers = [(weakref.ref(m), name, b.device, b if self.keep else None,
                    self.moved[id(b)]) for m, name, b in self.buffers]
        for p, value in self.params:
            p.data = value
        for module, name, b in self.buffers:
            module._buffers[name] = self.moved[id(b)]
        self.params, self.buffers, self.moved = [], [], {}

        def undo() -> None:
            for ref, home, original in params:
                param = ref()
                if param is not None:
                    param.data = original if original is not None else param.data.to(home)
            back: dict[int, torch.Tensor] = {}  # a buffer shared by modules stays shared
            for ref, name, home, original, put in buffers:
                holder = ref()
                now = holder._buffers.get(name) if holder is not None else None
                if now is None:
                    continue
                if id(now) not in back:
                    back[id(now)] = (original if original is not None and now is put
                                     else now.to(home))
                holder._buffers[name] = back[id(now)]
        return undo


def _moved(t: torch.Tensor, device: torch.device, kind: str, fqn: str) -> torch.Tensor:
    """``t`` on ``device``, or ValueError naming the member ``fqn`` that cannot move."""
    if t.is_meta:
        raise _no_values(kind, fqn, device)
    try:
        return t.to(device)
    except Exception as exc:  # torch's own reason, named
        raise ValueError(
            f"dlo_fx.offload: cannot move {kind} {fqn!r} ({t.device}, {t.dtype}) to {device}: "
            f"{type(exc).__name__}: {exc}; nothing was changed. Move or replace it first, "
            "then offload the model") from exc


def _no_values(kind: str, fqn: str, device: torch.device) -> ValueError:
    return ValueError(
        f"dlo_fx.offload: {kind} {fqn!r} is on the meta device (it has no values to move to "
        f"{device}); nothing was changed. Build the model with its {kind}s' values (or fill "
        "them, e.g. with load_state_dict), or load it from a checkpoint with dlo_fx.load, "
        "then offload it")

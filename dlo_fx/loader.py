"""`dlo_fx.load`: build a DiT without allocating its weights and fill the dlo host store
straight from a safetensors checkpoint.

[Note: loading without a memory spike]
If every rank materialises the checkpoint privately, host memory peaks at dp x model
before a single step runs. `load` never holds a private copy of the model:

1. The module is constructed with its parameters moved to the meta device as they are
   registered (so ``reset_parameters`` initialises nothing), while buffers are built for
   real: a rotary table computed in ``__init__`` keeps its values.
2. Everything is validated before anything is registered: files and headers
   (`dlo_fx.checkpoint`), keys, shapes and dtypes.
3. Parameters are grouped into blocks in registration order with the pass's own rules
   (`partition_blocks.partition`; budget = ``block_bytes`` or the largest natural layer);
   parameters smaller than ``resident_bytes``, or named in ``resident=``, are materialised
   on the device instead.
4. For each block, its tensors are opened as safetensors mmap views (one read-only
   mapping per file, backed by the OS page cache that every rank on the host shares), the
   rank copies only the bytes of its own host shard, and the views and mappings are
   dropped before the next block. A dtype cast or a non-contiguous parameter costs one
   temporary of that tensor, never a whole-model copy.
5. The block's parameters end *hollow* (real shape, dtype, strides and device over a
   zero-byte storage) and the host store is the one `torch.compile(backend="dlo")` finds
   for the same options, so compiling maps the graph's parameters onto the stored blocks.

Peak host memory is then about this rank's shards plus one block of mapped pages.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .backend import guard_module
from .checkpoint import Checkpoint, open_views, resolve_checkpoint
from .config import DLOConfig
from .load_plan import KeyMap, LoadPlan, Target, plan_load
from .runtime.fingerprint import block_fingerprint, check_same_weights
from .runtime.layout import span_as_bytes
from .runtime.runtime import Runtime, runtime_for

log = logging.getLogger(__name__)

__all__ = ["load", "meta_parameters"]


def load(model: Union[type, Callable[[], nn.Module]], checkpoint: Union[str, os.PathLike], *,
         config: Any = None, dtype: Optional[torch.dtype] = None,
         key_map: Optional[KeyMap] = None, strict: bool = True,
         options: Union[Mapping[str, Any], DLOConfig, None] = None,
         resident: Sequence[str] = ()) -> nn.Module:
    """Build ``model`` with hollow parameters whose bytes sit in the dlo host store.

    Args:
        model: an ``nn.Module`` class or a zero-argument factory returning a module. A
            diffusers ``ModelMixin`` class is built with ``from_config`` from ``config``
            or, when ``config`` is None, from the ``config.json`` of the checkpoint folder.
        checkpoint: a ``.safetensors`` file, a folder of them (with or without a
            ``*.safetensors.index.json``), an index file, a local Hugging Face cache repo
            folder, or a hub id already in the local cache. Never downloads.
        config: constructor configuration: a dict (keyword arguments, or a diffusers
            config), or one object passed as the only positional argument.
        dtype: floating-point parameters get this dtype (diffusers'
            ``_keep_in_fp32_modules`` stay float32); each checkpoint tensor is cast while
            it is copied. Buffers keep their own dtype. Without it, a checkpoint dtype
            that differs from the model's is an error.
        key_map: checkpoint key -> model FQN, as a dict (unlisted keys map to themselves)
            or a callable (returning None drops the key).
        strict: unexpected checkpoint keys (and missing persistent buffers) are an error;
            with ``strict=False`` they get one warning, and a missing buffer keeps the
            value its constructor gave it. Missing parameters are always an error.
        options: the dlo options (dict or `DLOConfig`) you will pass to
            ``torch.compile(model, backend="dlo", options=...)``: the blocks go to the
            runtime that compile call uses, on ``options["device"]`` (default CPU).
        resident: FQNs or module prefixes (``"patch_embed"``) of parameters to materialise
            on the device instead of streaming, on top of those smaller than
            ``options["resident_bytes"]``. Needed for parameters that code Dynamo runs
            eagerly reads: when a graph break inside a loop makes Dynamo skip a frame (the
            model's own ``forward``), the layers used there must be real tensors.

    Returns the module in eval mode with ``requires_grad=False`` parameters; calling it
    eagerly raises, telling you to compile it with ``backend="dlo"``.

    Raises ValueError (`dlo_fx.checkpoint.CheckpointError` for the checkpoint's own
    problems) before anything is registered, naming the file, key or parameter at fault.
    """
    start = time.perf_counter()
    cfg = DLOConfig.from_options(options)
    device = torch.device(cfg.device) if cfg.device is not None else torch.device("cpu")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dlo_fx.load: dtype={dtype!r} is not a floating-point torch.dtype")
    runtime = runtime_for(cfg, device)
    error: Optional[BaseException] = None
    plan: Optional[LoadPlan] = None
    try:
        ckpt = resolve_checkpoint(checkpoint)
        module = _construct(model, config, ckpt)
        plan = plan_load(module, ckpt, cfg, dtype=dtype, key_map=key_map, strict=strict,
                         resident=resident)
    except BaseException as exc:
        error = exc
    _agree(runtime, plan, error)
    if plan is None:  # _agree re-raises every planning error
        raise RuntimeError("dlo_fx.load: internal error: no load plan and no error")
    if runtime.mode is None and plan.blocks:  # mode="auto": a collective probe, as at compile
        runtime.decide_mode([sum(t.nbytes for t in block) for block in plan.blocks])
    _commit(plan, runtime, device)  # into runtime.store, which the mode decides
    module.eval()
    guard_module(module)
    log.info("dlo_fx.load: %s from %s: %d blocks (%d bytes of host shards on this rank), "
             "%d resident parameters, in %.2f s", type(module).__name__, ckpt.source,
             len(plan.blocks), plan.host_bytes, len(plan.resident), time.perf_counter() - start)
    return module


# -- building the module ------------------------------------------------------------------
@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Move every parameter to the meta device as it is registered; buffers stay real.

    Constructors that call ``reset_parameters`` after assigning a parameter then
    initialise a meta tensor, which costs nothing. Patches ``nn.Module.register_parameter``
    for the duration (process-wide: do not construct modules on other threads meanwhile).
    A parameter assigned without it (written into ``module._parameters`` directly) stays as
    built; the loader replaces it all the same.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and param.device.type != "meta":
            meta = param.detach().to("meta")
            try:
                param = type(param)(meta, requires_grad=param.requires_grad)
            except TypeError:  # a Parameter subclass with another constructor
                param = nn.Parameter(meta, requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _is_diffusers_class(cls: type) -> bool:
    return hasattr(cls, "from_config") and hasattr(cls, "config_name")


def _construct(model: Any, config: Any, ckpt: Checkpoint) -> nn.Module:
    if isinstance(model, nn.Module):
        raise ValueError(f"dlo_fx.load: model is an instance of {type(model).__name__}; pass "
                         "the class or a zero-argument factory so its weights are never allocated")
    if not callable(model):
        raise ValueError(f"dlo_fx.load: model={model!r} is not an nn.Module class or a factory")
    if isinstance(model, type) and not issubclass(model, nn.Module):
        raise ValueError(f"dlo_fx.load: model class {model.__name__} is not an nn.Module")
    with meta_parameters():
        if isinstance(model, type) and _is_diffusers_class(model):
            if config is None and ckpt.folder is not None:
                path = os.path.join(ckpt.folder, model.config_name)
                if os.path.isfile(path):
                    with open(path) as f:
                        config = json.load(f)
            module = model.from_config(dict(config)) if config is not None else model()
        elif config is None:
            module = model()
        elif isinstance(config, Mapping):
            module = model(**config)
        else:
            module = model(config)
    if not isinstance(module, nn.Module):
        raise ValueError(f"dlo_fx.load: the factory returned {type(module).__name__}, "
                         "not an nn.Module")
    return module


def _agree(runtime: Runtime, plan: Optional[LoadPlan], error: Optional[BaseException]) -> None:
    """In allgather mode (or ``"auto"``, still undecided), every rank of the shard group
    learns whether any rank failed to plan its load, and that all planned the same blocks:
    all raise together, none hangs in a later collective."""
    group = runtime.group
    if runtime.mode == "rank_local" or group.dp == 1:
        if error is not None:
            raise error
        return
    from .runtime.collectives import exchange_json, plan_digest

    mine = (f"{type(error).__name__}: {error}" if error is not None else None,
            plan_digest(plan.rows()) if plan is not None else None)
    every = exchange_json(mine, group, "the load plans")
    if error is not None:
        raise error
    failed = [(group.ranks[i], e) for i, (e, _) in enumerate(every) if e is not None]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"dlo_fx.load failed on global rank {rank} of the "
                         f"{group.describe()} ({message}); no rank loaded anything")
    if len({d for _, d in every}) > 1:
        raise ValueError(f"dlo_fx.load: the ranks of the {group.describe()} planned different "
                         "blocks; load the same checkpoint with the same options on every rank")


# -- reading and registering --------------------------------------------------------------
def _model_layout_bytes(target: Target, view: torch.Tensor) -> torch.Tensor:
    """``view`` (a checkpoint tensor) as flat bytes in the parameter's dtype and strides."""
    p = target.tensor
    if view.dtype == target.dtype and p.is_contiguous():
        return view.reshape(-1).view(torch.uint8)  # the mmap itself: no copy yet
    tmp = torch.empty_strided(tuple(p.shape), tuple(p.stride()), dtype=target.dtype)
    tmp.copy_(view.view(p.shape))  # one tensor cast / re-strided, never the whole model
    return span_as_bytes(tmp)


def _materialised(target: Target, view: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    t = target.tensor
    if view is None:  # a buffer the checkpoint does not hold (or need not)
        return t.to(device)
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=target.dtype, device=device)
    with torch.no_grad():
        out.copy_(view.view(t.shape))
    return out


def _hollow_like(target: Target, device: torch.device) -> nn.Parameter:
    t = target.tensor
    data = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=target.dtype,
                               device=device)  # never written: on CPU no page is touched
    data.untyped_storage().resize_(0)
    return nn.Parameter(data, requires_grad=False)


def _install(target: Target, value: torch.Tensor) -> None:
    for mod, name, _ in target.names:
        if target.kind == "param":
            mod._parameters[name] = value  # type: ignore[assignment]
        else:
            mod._buffers[name] = value


def _commit(plan: LoadPlan, runtime: Runtime, device: torch.device) -> None:
    store = runtime.store
    first = len(store.blocks)
    total = sum(t.info.nbytes for t in plan.params + plan.buffers if t.info is not None)
    count = sum(t.info is not None for t in plan.params + plan.buffers)
    progress = _Progress(total, count, label=f"loading {plan.ckpt.source}",
                         bar=store.rank == 0 and _stderr_is_terminal(),
                         level=logging.INFO if store.rank == 0 else logging.DEBUG)
    values: list[tuple[Target, torch.Tensor]] = []
    fingerprints: list[int] = []
    try:
        small = plan.buffers + plan.resident
        with open_views([t.info for t in small if t.info is not None]) as views:
            for t in small:
                view = views.get(t.info.key) if t.info is not None else None
                value = _materialised(t, view, device)
                if t.kind == "param":
                    value = nn.Parameter(value, requires_grad=False)
                values.append((t, value))
                progress.update(t.info.nbytes if t.info is not None else 0, t.info is not None)
        for block in plan.blocks:
            params = [_hollow_like(t, device) for t in block]
            fqns = [t.fqn for t in block]
            entries, spec = store.layout(params, fqns)
            lo, hi = spec.rank_range(store.rank) if store.dp > 1 else (0, spec.padded_bytes)
            need = [e.nbytes > 0 and e.offset < hi and e.offset + e.nbytes > lo for e in entries]
            with open_views([t.info for t in block if t.info is not None]) as views:
                if runtime.mode == "allgather":  # sampled from the checkpoint's own bytes
                    fingerprints.append(block_fingerprint(entries, [
                        views[t.info.key].reshape(-1).view(torch.uint8) if e.nbytes else None
                        for t, e in zip(block, entries)]))
                sources = [_model_layout_bytes(t, views[t.info.key]) if n else None
                           for t, n in zip(block, need)]
                host = store.blocks[runtime.register_block(params, fqns, sources)]  # this rank's range only
                del sources
            plan.host_bytes += host.shard.numel()
            values += list(zip(block, params))
            progress.update(sum(t.info.nbytes for t in block), len(block))
        check_same_weights(runtime, fingerprints, [b[0].fqn for b in plan.blocks],
                           f"the checkpoint {plan.ckpt.source}")
    except BaseException:
        store.drop_blocks(first)
        raise
    finally:
        progress.close()
    for target, value in values:
        _install(target, value)


# -- progress -----------------------------------------------------------------------------
def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _Progress:
    """A tqdm bar (bytes, with a tensor count) on a terminal; log lines every 10% otherwise."""

    def __init__(self, total_bytes: int, total_tensors: int, *, label: str, bar: bool,
                 level: int = logging.INFO) -> None:
        self.total, self.tensors_total = total_bytes, total_tensors
        self.level = level
        self.done = self.tensors = 0
        self.label = label
        self.start = time.perf_counter()
        self._next_log = 0.1
        self._bar = None
        if bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                             desc="dlo_fx.load", leave=False)

    def update(self, nbytes: int, tensors: int) -> None:
        self.done += nbytes
        self.tensors += int(tensors)
        if self._bar is not None:
            self._bar.update(nbytes)
            self._bar.set_postfix_str(f"{self.tensors}/{self.tensors_total} tensors", refresh=False)
            return
        fraction = self.done / self.total if self.total else 1.0
        if fraction >= self._next_log or self.tensors == self.tensors_total:
            log.log(self.level, "%s: %.0f%% (%d of %d bytes, %d of %d tensors) after %.1f s",
                    self.label, 100 * fraction, self.done, self.total, self.tensors,
                    self.tensors_total, time.perf_counter() - self.start)
            while self._next_log <= fraction:
                self._next_log += 0.1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

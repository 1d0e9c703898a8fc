"""`dlo_fx.load`: build a DiT without allocating its weights and fill the dlo host store
straight from a safetensors checkpoint.

[Note: loading without a memory spike]
`load` never holds a private copy of the model: host memory peaks at about this rank's
shards plus one block of mapped pages, not dp x model. In order:

1. The module is constructed with its parameters moved to the meta device as they are
   registered (so ``reset_parameters`` initialises nothing), while buffers are built for
   real: a rotary table computed in ``__init__`` keeps its values.
2. Everything is validated before anything is registered: files and headers
   (`dlo_fx.loading.checkpoint`), keys, shapes and dtypes.
3. Parameters are grouped into blocks in registration order with the passes' own rules
   (`dlo_fx.planning.blocks`; budget = ``block_bytes`` or the largest layer); parameters
   smaller than ``resident_bytes``, or named in ``resident=``, are materialised on the
   device instead (`dlo_fx.planning.residency`).
4. For each block, the rank reads only the bytes of its own host shard, with ``os.preadv``
   from the files (served by the OS page cache that every rank on the host shares), never
   through a mapping: a file truncated while it is read is an error naming it, not a
   SIGBUS. A dtype cast or a non-contiguous parameter costs one temporary of that tensor,
   never a whole-model copy. In allgather mode each block's sampled fingerprint is read
   the same way, and the ranks agree on it and on everything else that shapes their
   gathers before the load returns (see [Note: one agreement before the first gather]).
5. The block's parameters are `StoredWeight`s (real shape, dtype, strides and device, no
   storage; reads outside a graph are served from the host store: see [Note: a stored
   weight is a tensor]). The host store belongs to the module's own runtime, which
   `torch.compile(backend="dlo")` finds from the parameters (see [Note: the model owns
   its runtime]): compiling maps the graph's parameters onto the stored blocks and
   inherits the options given here.

With ``host_store="mmap"`` step 4 records where each block's bytes are in the files instead
of copying them (see [Note: file-backed host store]); a folder written by ``dlo-fx shard``
is read through its manifest (see [Note: pre-sharded checkpoints]).

[Note: the dtype rule]
The model's dtype wins, as in diffusers' ``from_pretrained``; a checkpoint is never refused
for its floating-point dtype. Without ``dtype=`` every floating-point parameter keeps the
dtype the constructor gave it (float32 for a diffusers or transformers model built from its
config); with ``dtype=`` they get that one, except diffusers' ``_keep_in_fp32_modules``. A
checkpoint tensor of another floating-point dtype is cast while it is copied into the host
store (one temporary of that tensor), and one log line counts the casts by their cause
(the model's dtype, ``dtype=``, or float32 for the modules kept so), so a bfloat16
checkpoint loads without ``dtype=`` (into a float32 model: pass ``dtype=torch.bfloat16`` to
keep half the host memory). An integer or bool tensor of another dtype is an error, since
casting it would change its values.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .checkpoint import load_error, read_tensor
from .discover import resolve_checkpoint
from ..config import DLOConfig
from .offload import compute_device
from .gguf import is_gguf, quantize_module
from .attach import Planned, attach_model
from .plan import KeyMap, LoadPlan, Target, load_facts, map_keys, plan_load
from ..runtime import (carried_attributes, extent_sources, file_fingerprint, NewBlock,
                       parameter_of, Runtime, StorageChoice, choose_storage,
                       stored_parameter)
from .build import construct, materialised, meta_parameters
from .shards import ShardDir, checkpoint_extents
from ..model.storage_dtype import check_castable_pairs

log = logging.getLogger(__name__)

__all__ = ["load", "meta_parameters"]


def load(model: Union[type, Callable[[], nn.Module]], checkpoint: Union[str, os.PathLike], *,
         subfolder: Optional[str] = None, config: Any = None, dtype: Optional[torch.dtype] = None,
         key_map: Optional[KeyMap] = None, strict: bool = True,
         options: Union[Mapping[str, Any], DLOConfig, None] = None,
         resident: Sequence[str] = ()) -> nn.Module:
    """Build ``model`` with parameters whose bytes sit in the dlo host store.

    Follows ``from_pretrained``: ``dlo_fx.load(FluxTransformer2DModel, root,
    subfolder="transformer")`` reads ``root/transformer/config.json`` and its weights.

    Args:
        model: an ``nn.Module`` class or a zero-argument factory returning a module. A
            diffusers ``ModelMixin`` class is built with ``from_config``, a transformers
            ``PreTrainedModel`` class from its ``config_class``; both from ``config`` or,
            when ``config`` is None, from the ``config.json`` beside the weights.
        checkpoint: a ``.safetensors`` file, a folder of them (with or without a
            ``*.safetensors.index.json``), an index file, a local Hugging Face cache repo
            folder, a hub id already in the local cache, or a folder written by
            ``dlo-fx shard`` (its manifest must match the model and options), or a
            ``.gguf`` file (or a folder holding one): its quantized tensors are stored as
            they are, and ``dtype`` is the compute dtype (see `dlo_fx.loading.gguf`). Never
            downloads.
        subfolder: a folder inside ``checkpoint`` holding the weights and config.json: the
            component of a diffusers pipeline folder (``"transformer"``, ``"text_encoder_2"``).
        config: constructor configuration: a dict (keyword arguments, or a diffusers /
            transformers config), a path to a config.json (or its folder), or one object
            passed as the only positional argument.
        dtype: floating-point parameters get this dtype (diffusers'
            ``_keep_in_fp32_modules`` stay float32). Without it the model's own dtype (as
            built) wins. Either way each checkpoint tensor is cast while it is copied, never
            the whole model at once, and one log line counts the casts: see [Note: the dtype
            rule]. Buffers keep their own dtype; non-floating tensors are never cast.
        key_map: checkpoint key -> model FQN, as a dict (unlisted keys map to themselves)
            or a callable (returning None drops the key).
        strict: unexpected checkpoint keys (and missing persistent buffers) are an error;
            with ``strict=False`` they get one warning, and a missing buffer keeps the
            value its constructor gave it. Missing parameters are always an error.
        options: the dlo options (dict or `DLOConfig`) of the module's runtime, on
            ``options["device"]`` (default: the accelerator ``torch.accelerator``
            reports, else the CPU). Every compile of the module uses them; a compile
            option here (``compiler``, ``trace``, ``dump_dir``, ...) raises ValueError
            naming ``torch.compile``, where it belongs.
        resident: FQNs or module prefixes (``"patch_embed"``) of parameters to materialise
            on the device instead of streaming, on top of those smaller than
            ``options["resident_bytes"]``. Needed for parameters that code Dynamo runs
            eagerly reads: when a graph break inside a loop makes Dynamo skip a frame (the
            model's own ``forward``), the layers used there must be real tensors.

    Returns the module in eval mode with ``requires_grad=False`` parameters, its streamed
    ones `StoredWeight`s. Compile it with ``backend="dlo"`` to stream them; an eager call
    is exact too, but copies each block from the host store for every read (it warns once).

    Raises ValueError (`dlo_fx.loading.checkpoint.CheckpointError` for the checkpoint's own
    problems) before anything is registered, naming the file, key or parameter at fault.
    """
    cfg = DLOConfig.from_options(options, verb="dlo_fx.load")
    device = compute_device(cfg)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dlo_fx.load: dtype={dtype!r} is not a floating-point torch.dtype")

    def plan_of(runtime: Runtime) -> Planned:
        nonlocal dtype
        source = os.path.join(checkpoint, subfolder) if subfolder else checkpoint
        shards = ShardDir.open(source)
        ckpt = (shards.checkpoint(os.fspath(source)) if shards is not None
                else resolve_checkpoint(checkpoint, subfolder))
        module = construct(model, config, ckpt)
        if is_gguf(ckpt):  # see [Note: a GGUF file is a checkpoint like any other]
            dtype = quantize_module(module, ckpt, dtype, map_keys(ckpt, key_map))
        plan = plan_load(module, ckpt, cfg, dtype=dtype, key_map=key_map if shards is None
                         else None, strict=strict, resident=resident)
        check_castable_pairs({(t.stored_as, t.dtype): f"parameter {t.fqn!r}"
                              for b in plan.blocks for t in b if t.stored_as is not None}, device)
        if shards is not None:
            shards.check(plan, cfg, dp=runtime.group.dp, mode=runtime.mode,
                         rank=runtime.group.rank, dtype=dtype, resident=resident, key_map=key_map)
        return Planned(module, plan.rows(), plan.blocks, plan.ends,
                       lambda: _commit(plan, runtime, shards), len(plan.resident),
                       source=f" from {ckpt.source}")

    return attach_model(cfg, device, "dlo_fx.load", plan_of)[1].model


# -- reading and registering ------------------------------------------------------------
def _stored_like(target: Target, device: torch.device) -> nn.Parameter:
    t = target.tensor
    p = stored_parameter(t.shape, t.stride(), target.dtype, device, cls=type(t))
    vars(p).update(carried_attributes(t))  # a GGUFParameter's quant_type
    if target.stored_as is not None:  # see [Note: a storage dtype] in runtime/host/layout.py
        choose_storage(p, StorageChoice(target.stored_as))
    return p


def _resident_like(target: Target, value: torch.Tensor) -> nn.Parameter:
    """A resident parameter of ``value``, of the meta parameter's class (diffusers'
    ``GGUFParameter``, whose ``as_tensor`` its layer calls) and attributes."""
    return parameter_of(type(target.tensor), value, False,
                        carried_attributes(target.tensor))


def _install(target: Target, value: torch.Tensor) -> None:
    for mod, name, _ in target.names:
        if target.kind == "param":
            mod._parameters[name] = value  # type: ignore[assignment]
        else:
            mod._buffers[name] = value


def _commit(plan: LoadPlan, runtime: Runtime, shards: Optional[ShardDir] = None
            ) -> tuple[list[int], list[torch.Tensor]]:
    """Read the resident tensors, store the blocks and put every value in place; returns the
    host blocks' indices and the parameters kept resident by name."""
    store, device = runtime.store, runtime.device
    total = sum(t.info.nbytes for t in plan.params + plan.buffers if t.info is not None)
    count = sum(t.info is not None for t in plan.params + plan.buffers)
    progress = _Progress(total, count, label=f"loading {plan.ckpt.source}",
                         bar=store.rank == 0 and _stderr_is_terminal(),
                         level=logging.INFO if store.rank == 0 else logging.DEBUG)
    values: list[tuple[Target, torch.Tensor]] = []
    try:
        # Every read goes through pread, whatever the store: a file truncated while it is
        # read is an error naming it (a mapped page of it raised SIGBUS).
        for t in plan.buffers + plan.resident:
            view = read_tensor(t.info) if t.info is not None else None
            value = materialised(t, view, device)
            if t.kind == "param":
                value = _resident_like(t, value)
            values.append((t, value))
            progress.update(t.info.nbytes if t.info is not None else 0, t.info is not None)
    except BaseException as exc:
        read_failure: Optional[BaseException] = exc
    else:
        read_failure = None

    # Every block's parameters (no storage yet) before the first is read: the store sizes
    # its pinned slabs for all of them ([Note: pinned slabs] in runtime/host/host_slabs.py)
    ahead: list[NewBlock] = []
    try:
        if read_failure is None:
            ahead = [NewBlock([_stored_like(t, device) for t in block], [t.fqn for t in block])
                     for block in plan.blocks]
    except BaseException as exc:  # joins the ranks' agreement with it, as a read failure
        read_failure, ahead = exc, []

    def blocks() -> Iterator[NewBlock]:
        if read_failure is not None:  # joins the ranks' agreement with it
            raise read_failure
        for b, (block, new) in enumerate(zip(plan.blocks, ahead)):
            yield NewBlock(new.params, new.fqns, *_block_source(block, b, shards, store.rank))
            values.extend(zip(block, new.params))  # stored when asked for the next
            progress.update(sum(t.info.nbytes for t in block), len(block))
        if shards is not None:  # every block stored: the files read are those checked
            shards.recheck()

    try:
        indices = runtime.store_blocks(blocks(), load_facts(plan, shards),
                                       f"loading {plan.ckpt.source}", ahead=ahead,
                                       error_of=load_error)
    finally:
        progress.close()
    named = {id(t) for t in plan.named}
    for target, value in values:
        _install(target, value)
    return indices, [value for target, value in values if id(target) in named]


def _block_source(block: Sequence[Target], b: int, shards: Optional[ShardDir], rank: int
                  ) -> tuple[Callable, Callable]:
    """Where block ``b``'s bytes are (`NewBlock.extents`) and their fingerprint
    (`NewBlock.fingerprint`): in a `dlo-fx shard` run's rank file, with the fingerprint it
    recorded, or in the checkpoint, sampled there."""
    if shards is not None:
        return (lambda _, spec: shards.block_extents(b, rank, spec),
                lambda *_: shards.fingerprint(b))
    return (lambda entries, _: checkpoint_extents(block, entries),
            lambda entries, extents: file_fingerprint(entries, extent_sources(entries, extents)))


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

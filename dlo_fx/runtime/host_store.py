"""`HostStore`: every streamed block's bytes in host memory (this rank's shard of them).

With ``host_store="mmap"`` a block's bytes stay in the checkpoint files and are read from
there at every prefetch (`FileShard`; see [Note: file-backed host store] in
`file_store.py`); ``shard`` is then empty.

Parameters handed to the store end *hollow*: real shape, dtype, device and strides over a
zero-byte storage, so Dynamo's guards keep holding while the module holds no weight memory.

[Note: a stored parameter given other data]
The store keeps each stored parameter's storage (zero bytes, or the bytes an eager fetch
put back: `runtime/eager.py` resizes that same storage). ``param.data = other`` gives
the parameter another storage, and the schedule would go on streaming the stored
weights: the model's output would silently differ from what its parameters say.
`HostStore.check_storages` finds that on every scheduled call and every eager fetch and
raises instead. A scheduled call checks after its collective clock, so a refusal on one
rank completes the graph's gathers like any failure inside a graph, and its peers' calls
stay exact (`run_graph` in graph_call.py). Holding the storage also keeps its address
from being reused by a later tensor, so comparing addresses cannot mistake a new storage
for it. A materialised stored parameter (`runtime/eager.py` keeps the compiled root's
own ones materialised) can also be written in place (``p.mul_(2)``, ``nn.init``): its
version counter, noted after each fetch (`note_fetched`), is compared too. A write
through ``p.data`` bumps another counter and is not seen.

[Note: hollowing never frees a storage it did not make]
A parameter's storage need not be its own: parameters that are views of one flat tensor
share it, ``load_state_dict(sd, assign=True)`` leaves the caller's ``sd`` (and any other
model loaded from it) on it, and ``torch.load(..., mmap=True)`` gives storages over the file
that cannot be resized at all. Resizing such a storage to zero bytes freed the other
tensors' memory under them (a resident parameter, the caller's state dict: a segfault or
garbage when they were next read), or failed with "Trying to resize storage that is not
resizable". So `hollow` gives the parameter a new zero-byte storage instead, and the old
one is freed when nothing else holds it. Only storages dlo made are ever resized: the
hollow ones, by `runtime/eager.py`.

[Note: a stored parameter that dies]
The store keys its entries by ``id(parameter)`` and holds no parameter: the model owns
them. A model can drop some while it lives on: ``delete_adapters``, ``unload_lora`` and a
replaced submodule free their parameters, and the next call stores the new ones as new
blocks. Kept, the dead ones' entries grew the host store by every adapter ever loaded, and
CPython gives a new parameter the id of a freed one: the store took it for the dead one
(its entry, its block) and refused the call as ``param.data = ...``. So each stored
parameter carries a finalizer that forgets its entry, storage and version the moment it
dies, before its id can be reused, and a block none of whose parameters lives has its host
bytes freed (a memory store; a file-backed one reads nothing more from it). The block keeps
its index (schedules name blocks by index) and an empty shard; a copy already queued for it
holds the old `HostBlock` and its bytes until it ran.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from .file_store import Extent, FileShard, FileStore, read_extents
from .layout import Entry, ShardSpec, copy_into_shard, plan_offsets, span_as_bytes, span_bytes

log = logging.getLogger(__name__)

_STORE_IDS = itertools.count()


@dataclass
class HostBlock:
    """One block: its layout, shard geometry and this rank's host bytes."""

    index: int
    entries: list[Entry]
    spec: ShardSpec
    shard: torch.Tensor  # uint8, this rank's bytes (the whole padded block when dp == 1)
    source: Optional[FileShard] = None  # host_store="mmap": the bytes are read from files

    @property
    def shard_nbytes(self) -> int:
        """Bytes of this rank's host shard (in files with host_store="mmap")."""
        return self.source.nbytes if self.source is not None else self.shard.numel()

    def copy_to(self, dest: torch.Tensor) -> None:
        """Copy this rank's host shard into ``dest`` (``shard_nbytes`` bytes, any device)."""
        if self.source is not None:
            self.source.read_into(dest)
        else:
            dest.copy_(self.shard, non_blocking=True)

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    @property
    def slot_bytes(self) -> int:
        """Bytes the block needs in a slot once gathered (padded to ``dp`` shards)."""
        return self.spec.padded_bytes

    @property
    def fqns(self) -> list[str]:
        return [e.fqn for e in self.entries]


def is_hollow(t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def hollow_tensor(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """A tensor of this metadata over a new zero-byte storage of its own."""
    data = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype,
                               device=device)  # never written: on CPU no page is touched
    data.untyped_storage().resize_(0)
    return data


def hollow(params: Sequence[torch.Tensor]) -> None:
    """Give each of ``params`` a new zero-byte storage (``param.data = ...``), keeping its
    identity, shape, strides, dtype, device and inference-ness: see [Note: hollowing never
    frees a storage it did not make]."""
    for p in params:
        with torch.inference_mode(p.is_inference()):  # an inference tensor stays one
            p.data = hollow_tensor(p.shape, p.stride(), p.dtype, p.device)


def _forget(store_ref: "weakref.ReferenceType[HostStore]", key: int) -> None:
    store = store_ref()
    if store is not None:
        store.forget(key)


class HostStore:
    """Blocks in registration order; parameters looked up by identity.

    The store never holds the parameters themselves (only their ids): the model owns
    them, and the model's runtime, which owns the store, lives as long as they do.
    """

    def __init__(self, *, alignment: int, rank: int = 0, dp: int = 1,
                 pin: bool = False, files: Optional[FileStore] = None) -> None:
        self.alignment = alignment
        self.files = files  # host_store="mmap"
        self.rank = rank
        self.dp = dp
        self.pin = pin
        self.blocks: list[HostBlock] = []
        self._entries: dict[int, Entry] = {}
        # id(parameter) -> its storage when stored: see [Note: a stored parameter given
        # other data]
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._versions: dict[int, int] = {}  # id(parameter) -> its version when fetched
        # block index -> how many of its parameters live: see [Note: a stored parameter
        # that dies]. The finalizers run on whichever thread frees a parameter.
        self._live: dict[int, int] = {}
        self._forget_lock = threading.RLock()
        self.forgotten = 0  # parameters forgotten so far
        # Entry uids are unique across stores: slot views are cached by uid in slots
        # that runtimes on one device share (see [Note: what a model owns and what a
        # device shares]).
        self._next_uid = next(_STORE_IDS) << 32

    # -- lookup -------------------------------------------------------------------------
    def entry(self, param: torch.Tensor) -> Optional[Entry]:
        return self._entries.get(id(param))

    def entry_by_id(self, key: int) -> Optional[Entry]:
        """The entry of the live parameter whose id is ``key``."""
        return self._entries.get(key)

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self._entries

    @property
    def host_bytes(self) -> int:
        return sum(b.shard.numel() for b in self.blocks)

    # -- building -----------------------------------------------------------------------
    def layout(self, params: Sequence[torch.Tensor], fqns: Sequence[str]) -> tuple[list[Entry], ShardSpec]:
        """Entries and shard geometry a block of ``params`` would get (no copy)."""
        sizes = [span_bytes(p) for p in params]
        offsets, total = plan_offsets(sizes, self.alignment)
        index = len(self.blocks)
        entries = []
        for p, fqn, off, size in zip(params, fqns, offsets, sizes):
            entries.append(Entry(uid=self._next_uid + len(entries), fqn=fqn, block=index,
                                 offset=off, nbytes=size, shape=tuple(p.shape),
                                 stride=tuple(p.stride()), dtype=p.dtype))
        return entries, ShardSpec.of(total, self.dp, self.alignment)

    def add_block(self, params: Sequence[torch.nn.Parameter], fqns: Sequence[str],
                  sources: Optional[Sequence[torch.Tensor]] = None,
                  extents: Optional[Sequence[Extent]] = None) -> HostBlock:
        """Lay ``params`` out as a new block and copy this rank's shard of their bytes.

        ``sources`` are flat uint8 images of each parameter's storage span; by default
        the parameters' own bytes are read. ``extents`` (what the loader passes)
        say instead where the block's bytes are in files: a file-backed store keeps them
        (nothing is copied), a memory store reads them once. The parameters are hollowed
        afterwards.
        """
        for p, fqn in zip(params, fqns):
            if id(p) in self._entries:
                raise RuntimeError(f"parameter {fqn!r} is already in host block "
                                   f"{self._entries[id(p)].block}")
        entries, spec = self.layout(params, fqns)
        size = spec.shard_bytes if self.dp > 1 else spec.padded_bytes
        start, _ = spec.rank_range(self.rank) if self.dp > 1 else (0, 0)
        index, source = len(self.blocks), None
        if self.files is not None:
            if extents is None:
                raise ValueError(
                    f"dlo: host_store='mmap' serves weights from checkpoint files, but "
                    f"{fqns[0]!r} (and {len(fqns) - 1} more) are in process memory; load the "
                    "model with dlo_fx.load(cls, checkpoint, options={..., 'host_store': "
                    "'mmap'}) or use host_store='memory'")
            source = self.files.shard(index, extents, start, start + size)
            shard = torch.empty(0, dtype=torch.uint8)
        elif extents is not None:
            shard = self._allocate(size)
            read_extents(extents, start, shard, f"host block {index}")
        else:
            shard = self._allocate(size)
            if sources is None:
                sources = [span_as_bytes(p) if e.nbytes else None for p, e in zip(params, entries)]
            copy_into_shard(shard, entries, sources, start)
        block = HostBlock(index=index, entries=entries, spec=spec, shard=shard, source=source)
        hollow([p for p in params if p.numel()])
        with self._forget_lock:
            self.blocks.append(block)
            self._live[index] = len(params)
            for p, e in zip(params, entries):
                self._entries[id(p)] = e
                self._storages[id(p)] = p.untyped_storage()
                weakref.finalize(p, _forget, weakref.ref(self), id(p)).atexit = False
        self._next_uid += len(entries)
        return block

    def forget(self, key: int) -> None:
        """The parameter whose id was ``key`` died: see [Note: a stored parameter that
        dies]."""
        with self._forget_lock:
            entry = self._entries.pop(key, None)
            self._storages.pop(key, None)
            self._versions.pop(key, None)
            self.forgotten += 1
            if entry is None or self._live.get(entry.block) is None:
                return
            self._live[entry.block] -= 1
            if self._live[entry.block] == 0:
                del self._live[entry.block]
                block = self.blocks[entry.block]
                if block.source is None and block.shard.numel():
                    self.blocks[entry.block] = dataclasses.replace(
                        block, shard=torch.empty(0, dtype=torch.uint8))

    def has_own_storage(self, param: torch.Tensor) -> bool:
        """``param`` still has the storage it had when stored (hollow or fetched)."""
        kept = self._storages.get(id(param))
        return kept is not None and param.untyped_storage()._cdata == kept._cdata

    def note_fetched(self, params: Iterable[torch.Tensor]) -> None:
        """``params`` were just given their stored bytes (`runtime/eager.py`)."""
        for p in params:
            if not p.is_inference():  # an inference tensor has no version counter
                self._versions[id(p)] = p._version

    def check_storages(self, params: Iterable[torch.Tensor]) -> None:
        """ValueError naming the first stored parameter among ``params`` that was given
        other data or written in place since it was stored or fetched: see [Note: a stored
        parameter given other data]."""
        for p in params:
            if id(p) not in self._storages:
                continue
            version = self._versions.get(id(p))  # None for an inference tensor
            if not self.has_own_storage(p):
                change = "was given other data (param.data = ...)"
            elif version is not None and p._version != version:
                change = "was written in place (param.mul_(...), param.copy_(...), nn.init)"
            else:
                continue
            raise ValueError(
                f"dlo: parameter {self._entries[id(p)].fqn!r} {change} after dlo moved its "
                "weights into the host store, and the compiled model would go on reading the "
                "stored weights. To change weights, call dlo_fx.release(model) first (it puts "
                "the stored weights back, replacing changes made since), change them, then "
                "compile the model again")

    def drop_blocks(self, first: int) -> None:
        """Forget blocks ``first`` onwards (undoing a failed load); their parameters stay
        hollow and must not be used again."""
        with self._forget_lock:
            self._entries = {k: e for k, e in self._entries.items() if e.block < first}
            self._storages = {k: s for k, s in self._storages.items() if k in self._entries}
            self._versions = {k: v for k, v in self._versions.items() if k in self._entries}
            self._live = {k: n for k, n in self._live.items() if k < first}
            del self.blocks[first:]
        if self.files is not None:
            self.files.drop(first)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        with torch.inference_mode(False):  # written by the worker thread
            return self._allocate_pinned_or_not(nbytes)

    def _allocate_pinned_or_not(self, nbytes: int) -> torch.Tensor:
        if self.pin:
            try:
                return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:
                warnings.warn(f"dlo: pinning a {nbytes}-byte host shard failed ({exc}); "
                              "falling back to pageable memory (set pin_memory=False to "
                              "silence this)", RuntimeWarning, stacklevel=3)
                self.pin = False
        return torch.zeros(nbytes, dtype=torch.uint8)

"""`HostStore`: every streamed block's bytes in host memory (this rank's shard of them).

With ``host_store="mmap"`` a block's bytes stay in the checkpoint files and are read from
there at every prefetch (`FileShard`; see [Note: file-backed host store] in
`file_store.py`); ``shard`` is then empty.

A parameter handed to the store stays as it is; once every rank has agreed to its block,
`Runtime.store_blocks` turns it into a `StoredWeight` (`runtime/weights/stored.py`), whose
reads outside a graph are served from this store: see [Note: when a parameter becomes a
StoredWeight] in runtime.py.

[Note: a stored parameter that dies]
An entry lives exactly as long as its parameter. The store keys its entries by
``id(parameter)`` and holds no parameter: the model owns them, and may drop some while it
lives on (``delete_adapters``, ``unload_lora``, a replaced submodule; the next call stores
the new ones as new blocks). A dead parameter's entry kept would grow the host store by
every adapter ever loaded, and CPython gives a new parameter the id of a freed one, which
the store would take for the dead one (its entry, its block) and refuse as
``param.data = ...``. So each stored parameter carries a finalizer that forgets its entry,
storage and version the moment it dies, before its id can be reused, and a block none of
whose parameters lives has its host bytes freed (a memory store; a file-backed one reads
nothing more from it). The block keeps its index (schedules name blocks by index) and an
empty shard; a copy already queued for it holds the old `HostBlock` and its bytes until it
ran.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .file_store import Extent, FileShard, FileStore, read_extents
from .host_slabs import HostSlabs
from .layout import (Entry, ShardSpec, copy_into_shard, lay_out, leaf_entries, leaf_tensors,
                     storage_dtype_of, stored_bytes)

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


def _forget(store_ref: "weakref.ReferenceType[HostStore]", key: int) -> None:
    store = store_ref()
    if store is not None:
        store.forget(key)


def fill_task(store: HostStore, flat: torch.Tensor, block: int) -> Callable[[], None]:
    """The copy of this rank's host shard of ``block`` to its place in ``flat``. It holds
    the host block and the slot slice, never the runtime: a wrap-around prefetch still
    queued when the model is dropped must not keep its whole host store alive."""
    host = store.blocks[block]
    start = host.spec.rank_range(store.rank)[0] if store.dp > 1 else 0
    dst = flat[start : start + host.shard_nbytes]
    return lambda: host.copy_to(dst)


class HostStore:
    """Blocks in registration order; parameters looked up by identity.

    The store never holds the parameters themselves (only their ids): the model owns
    them, and the model's runtime, which owns the store, lives as long as they do.
    """

    def __init__(self, *, alignment: int, rank: int = 0, dp: int = 1,
                 pin: bool = False, files: Optional[FileStore] = None,
                 device: Optional[torch.device] = None) -> None:
        self.alignment = alignment
        self.files: Optional[FileStore] = None  # host_store="mmap"; set by `shard_as`, as
        # are this rank's place (rank of dp), whether shards are pinned, and the slabs
        # that pin them (exactly sized where the platform registers host memory: see
        # [Note: pinned slabs])
        self.blocks: list[HostBlock] = []
        self._entries: dict[int, Entry] = {}
        # block index -> how many of its parameters live: see [Note: a stored parameter
        # that dies]. The finalizers run on whichever thread frees a parameter.
        self._live: dict[int, int] = {}
        self._forget_lock = threading.RLock()
        self.forgotten = 0  # parameters forgotten so far
        # Entry uids are unique across stores: slot views are cached by uid in slots
        # that runtimes on one device share (see [Note: what a model owns and what a
        # device shares]).
        self._next_uid = next(_STORE_IDS) << 32
        self.shard_as(pin=pin, rank=rank, dp=dp, files=files, device=device)

    def shard_as(self, *, pin: bool, rank: int, dp: int, files: Optional[FileStore],
                 device: Optional[torch.device]) -> None:
        """Set the shard geometry (this rank's ``rank`` of ``dp``), whether shards are
        pinned, and the files a file-backed store serves its blocks from: only while no
        block is stored (the runtime's mode decides them, `Runtime.set_mode`). The store
        itself stays: every part of the runtime holds it."""
        if self.blocks:
            raise RuntimeError(f"dlo: internal error: {len(self.blocks)} blocks are stored "
                               "already; their shard geometry cannot change")
        if self.files is not None and self.files is not files:
            self.files.close()
        self.files, self.rank, self.dp, self.pin = files, rank, dp, pin
        self.slabs = HostSlabs(self.alignment, device=device) if pin else None

    def close(self) -> None:
        """Drop every block and entry, free the host bytes and close the files (the
        runtime is released). Nothing is stored afterwards."""
        with self._forget_lock:
            self._entries = {}
            self._live = {}
            self.blocks = []
        self.slabs = None
        if self.files is not None:
            self.files.close()
            self.files = None

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
        # See [Note: a storage dtype] and [Note: a quantized weight is its inner tensors]
        index, cursor, entries = len(self.blocks), 0, []
        for p, fqn in zip(params, fqns):
            entry, cursor = lay_out(p, fqn, cursor, self.alignment,
                                    self._next_uid + len(entries), index, storage_dtype_of(p))
            entries.append(entry)
        return entries, ShardSpec.of(cursor, self.dp, self.alignment)

    @staticmethod
    def sources(params: Sequence[torch.Tensor], entries: Sequence[Entry]) -> list:
        """The flat bytes of each of ``leaf_entries(entries)`` (None for an empty one): a
        parameter's own, a cast copy's where its entry stores another dtype, or its inner
        tensors' (a tensor subclass)."""
        out = []
        for p, e in zip(params, entries):
            for t, leaf in zip(leaf_tensors(p), e.leaves):
                out.append(stored_bytes(t, leaf.dtype) if leaf.nbytes else None)
        return out

    def shard_size(self, spec: ShardSpec) -> int:
        """Bytes of this rank's host shard of a block of geometry ``spec``."""
        return spec.shard_bytes if self.dp > 1 else spec.padded_bytes

    def reserve(self, blocks: Sequence[tuple[Sequence[torch.Tensor], Sequence[str]]]) -> None:
        """Announce the blocks (parameters, names) about to be added, in order, so that a
        pinned memory store registers their shards as a few exactly sized slabs: see
        [Note: pinned slabs]. Nothing for an unpinned or file-backed store."""
        if self.slabs is None or not self.pin or self.files is not None or not blocks:
            return
        self.slabs.reserve(self.shard_size(self.layout(params, fqns)[1])
                           for params, fqns in blocks)

    def add_block(self, params: Sequence[torch.nn.Parameter], fqns: Sequence[str],
                  sources: Optional[Sequence[torch.Tensor]] = None,
                  extents: Optional[Sequence[Extent]] = None) -> HostBlock:
        """Lay ``params`` out as a new block and copy this rank's shard of their bytes.

        ``sources`` are flat uint8 images of each parameter's storage span; by default
        the parameters' own bytes are read. ``extents`` (what the loader passes)
        say instead where the block's bytes are in files: a file-backed store keeps them
        (nothing is copied), a memory store reads them once. The parameters stay as they
        are until `Runtime.store_blocks` turns them (see [Note: when a parameter becomes a
        StoredWeight] in runtime.py).
        """
        for p, fqn in zip(params, fqns):
            if id(p) in self._entries:
                raise RuntimeError(f"parameter {fqn!r} is already in host block "
                                   f"{self._entries[id(p)].block}")
        entries, spec = self.layout(params, fqns)
        size = self.shard_size(spec)
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
                sources = self.sources(params, entries)
            copy_into_shard(shard, leaf_entries(entries), sources, start)
        block = HostBlock(index=index, entries=entries, spec=spec, shard=shard, source=source)
        with self._forget_lock:
            self.blocks.append(block)
            self._live[index] = len(params)
            for p, e in zip(params, entries):
                self._entries[id(p)] = e
                weakref.finalize(p, _forget, weakref.ref(self), id(p)).atexit = False
        self._next_uid += len(entries)
        return block

    def forget(self, key: int) -> None:
        """The parameter whose id was ``key`` died: see [Note: a stored parameter that
        dies]."""
        with self._forget_lock:
            entry = self._entries.pop(key, None)
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

    def drop_blocks(self, first: int) -> None:
        """Forget blocks ``first`` onwards (undoing a failed store, `Runtime.store_blocks`,
        before any of their parameters became a `StoredWeight`)."""
        with self._forget_lock:
            self._entries = {k: e for k, e in self._entries.items() if e.block < first}
            self._live = {k: n for k, n in self._live.items() if k < first}
            del self.blocks[first:]
        if self.slabs is not None:
            self.slabs.trim()  # slabs reserved for the dropped blocks
        if self.files is not None:
            self.files.drop(first)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        with torch.inference_mode(False):  # written by the worker thread
            return self._allocate_pinned_or_not(nbytes)

    def _allocate_pinned_or_not(self, nbytes: int) -> torch.Tensor:
        if self.pin and self.slabs is not None:
            try:
                return self.slabs.take(nbytes)
            except RuntimeError as exc:
                warnings.warn(f"dlo: pinning a {nbytes}-byte host shard failed ({exc}); "
                              "falling back to pageable memory (set pin_memory=False to "
                              "silence this)", RuntimeWarning, stacklevel=3)
                self.pin = False
        return torch.zeros(nbytes, dtype=torch.uint8)

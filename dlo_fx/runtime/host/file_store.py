"""`FileStore`: host shards served from files (``host_store="mmap"``), not process memory.

[Note: file-backed host store]
With ``host_store="mmap"`` the OS page cache is the host store: a block's host shard is a
list of *runs*, byte ranges of the checkpoint files (the safetensors files `dlo_fx.load`
read, or the per-rank files written by ``dlo-fx shard``) and where they go in the rank's
slice of the block. The cache is shared by every rank on the host, evictable, and costs no
anonymous memory, so a model larger than host RAM, or many ranks per node, fits where
``host_store="memory"`` (a private copy of every shard per rank) does not. What must hold:
every read returns the bytes seen at load, or raises naming the file.

* **Reads.** A prefetch reads the runs straight into the slot (CPU) or into one of
  ``num_slots`` pinned staging buffers that the copy stream then copies to the slot
  (devices), in pieces that several threads read at once (see [Note: reading at the disk's
  rate] in file_reads.py). Runs adjacent both in the file and in the
  block are merged, so a block of a pre-sharded file is one read; a block whose tensors are
  not laid out in the file as in the block (alignment padding, another order, several
  files) is read tensor by tensor, and a tensor whose dtype or strides differ from the
  parameter's (a dtype cast, a transposed weight) is read into a reused scratch buffer
  (`_Scratch`) and copied into place. `FileStore.stats` counts and times those copies.
* **Why pread, not the mapping.** Touching a mapped page of a file truncated meanwhile
  raises SIGBUS, which kills the process; a read past the end of a file returns short,
  which is an exception naming the file. So nothing here touches a mapped page.
* **A file that changed.** Every read compares the file's size and mtime with those seen
  at load, before and after the read (a rewrite racing the read): a difference raises
  `FileChangedError` naming the file, the block and the rank, never a wrong output. A
  rewrite that keeps both (``cp -p``, ``tar x``, ``touch -r`` over another checkpoint of
  the same shapes) is caught by sampled bytes: at load, `FileStore.shard` reads
  ``CHECK_SAMPLES`` windows of ``CHECK_WINDOW`` bytes spread evenly over the file bytes of
  each block shard, and every read compares the same bytes of what it read with them (a
  gather of 128 bytes per block read). The limit, exactly: a same-size, same-mtime rewrite
  that changes none of those windows is served. Another checkpoint's weights change
  essentially all of them; a rewrite of a few bytes between two windows is not seen.
* **Extents inside their files.** `FileStore.shard` refuses a run that ends past the end of
  its file as it was opened, naming the file and the block, so a header that promises more
  bytes than the file holds is a load error, not a short read at the first call.
* **Read-ahead** (buffered reads only; a direct read has no cache to fill). A daemon
  thread, woken by every block read, asks the OS for the next ``depth`` blocks' ranges
  (``posix_fadvise(WILLNEED)``, asynchronous) and, when free memory (host or cgroup) is
  below twice the read-ahead window, lets go of the block just read
  (``POSIX_FADV_DONTNEED``): under pressure the pages given up are the ones used longest
  ago in the ring, not the ones about to be read.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch

from ..device import procfs
from ..device import platform
from .file_reads import (FileChangedError, FileReader, Piece, ServedFile, plan_buffered,
                         plan_direct)
from .host_slabs import HostSlabs
from .layout import span_as_bytes

log = logging.getLogger(__name__)

__all__ = ["Convert", "Extent", "FileShard", "FileStore", "read_extents"]


@dataclass(frozen=True)
class Convert:
    """A tensor stored in the file as ``src_dtype``, contiguous, that the block holds in
    ``dtype`` with ``stride``."""

    src_dtype: torch.dtype
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    via: Optional[torch.dtype] = None  # cast to this dtype first (the parameter's own)


@dataclass(frozen=True)
class Extent:
    """Bytes ``[dest, dest + nbytes)`` of a block's flat image, found in ``path`` at
    ``offset`` (``src_nbytes`` bytes there; they differ only when ``convert`` is set)."""

    dest: int
    nbytes: int
    path: str
    offset: int
    src_nbytes: int
    what: str  # a parameter FQN or "block 3", for messages
    convert: Optional[Convert] = None


@dataclass(frozen=True)
class _Run:
    dest: int  # offset inside the rank's shard
    nbytes: int
    path: str
    offset: int
    src_nbytes: int
    what: str
    convert: Optional[Convert] = None
    skip: int = 0  # converted runs: bytes of the converted span before ``dest``
    # Sampled bytes seen at load: positions in the run's file bytes, and their values
    # (see [Note: file-backed host store], a file that changed).
    check_at: Optional[torch.Tensor] = field(default=None, compare=False)
    check_bytes: Optional[torch.Tensor] = field(default=None, compare=False)


CHECK_SAMPLES = 16
CHECK_WINDOW = 8


def _check_sampled(f: ServedFile, r: _Run, got: torch.Tensor, what: str) -> None:
    """Raise when the sampled bytes of run ``r`` in ``got`` (its file bytes as just read)
    differ from those read at load: the file was rewritten keeping its size and mtime."""
    if r.check_at is None or torch.equal(got.index_select(0, r.check_at), r.check_bytes):
        return
    diff = (got.index_select(0, r.check_at) != r.check_bytes).nonzero()[0].item()
    raise FileChangedError(
        f"dlo: {f.path} was rewritten in place keeping its size and mtime (the byte at file "
        f"offset {r.offset + int(r.check_at[diff])} differs from the one read when the model "
        f"was loaded) while host_store='mmap' serves {what} from it; the weights would be "
        "wrong. Restore the file (or never write to a checkpoint being served) and load the "
        "model again")


def _sample_runs(files: dict[str, ServedFile], runs: list[_Run], what: str) -> list[_Run]:
    """``runs`` with their sampled bytes read now (``CHECK_SAMPLES`` windows spread evenly
    over the runs' file bytes), after checking that each run lies inside its file."""
    for r in runs:
        f = files[r.path]
        if r.offset + r.src_nbytes > f.size:
            raise FileChangedError(
                f"dlo: {f.path} holds {f.size} bytes, but {r.what} of {what} is at bytes "
                f"{r.offset} to {r.offset + r.src_nbytes} of it; the file is truncated or its "
                "header is wrong: restore or rewrite it and load the model again")
    total = sum(r.src_nbytes for r in runs)
    if total == 0:
        return runs
    starts = sorted({i * total // CHECK_SAMPLES for i in range(CHECK_SAMPLES)})
    out, base, k = [], 0, 0
    for r in runs:
        at: list[int] = []
        seen = bytearray()
        f = files[r.path]
        while k < len(starts) and starts[k] < base + r.src_nbytes:
            pos = max(starts[k] - base, at[-1] + 1 if at else 0)  # windows never overlap
            n = min(CHECK_WINDOW, r.src_nbytes - pos)
            if n > 0:  # one small read per window
                raw = os.pread(f.fd, n, r.offset + pos)
                if len(raw) < n:
                    f.check(what)
                    raise FileChangedError(
                        f"dlo: {f.path} ended while reading {r.what} of {what}; the file is "
                        "truncated: restore it and load the model again")
                at += range(pos, pos + n)
                seen += raw
            k += 1
        base += r.src_nbytes
        out.append(r if not at else replace(
            r, check_at=torch.tensor(at, dtype=torch.int64),
            check_bytes=torch.frombuffer(seen, dtype=torch.uint8)))
    return out


def _clip(extents: Sequence[Extent], lo: int, hi: int) -> list[_Run]:
    """The parts of ``extents`` inside block bytes ``[lo, hi)``, relative to ``lo``, with
    runs adjacent both in the block and in one file merged into one read."""
    runs: list[_Run] = []
    for e in sorted(extents, key=lambda e: e.dest):
        a, b = max(e.dest, lo), min(e.dest + e.nbytes, hi)
        if a >= b:
            continue
        if e.convert is not None:
            runs.append(_Run(a - lo, b - a, e.path, e.offset, e.src_nbytes, e.what, e.convert,
                             skip=a - e.dest))
            continue
        run = _Run(a - lo, b - a, e.path, e.offset + (a - e.dest), b - a, e.what)
        last = runs[-1] if runs else None
        if (last is not None and last.convert is None and last.path == run.path
                and last.dest + last.nbytes == run.dest and last.offset + last.nbytes == run.offset):
            runs[-1] = _Run(last.dest, last.nbytes + run.nbytes, last.path, last.offset,
                            last.nbytes + run.nbytes, last.what)
        else:
            runs.append(run)
    return runs


class FileShard:
    """This rank's bytes of one block, as runs of file bytes."""

    def __init__(self, store: "FileStore", index: int, nbytes: int, runs: list[_Run]) -> None:
        self.store = store
        self.index = index
        self.nbytes = nbytes
        self.runs = runs
        self.pieces: dict[bool, list[Piece]] = {}  # direct? -> the plain runs' pieces

    @property
    def split(self) -> bool:
        """Whether this block needs more than one read (tensor by tensor)."""
        return len(self.runs) > 1

    def read_into(self, dest: torch.Tensor) -> None:
        self.store.read(self, dest)


def _span_nbytes(c: Convert) -> int:
    span = 1 + sum((n - 1) * st for n, st in zip(c.shape, c.stride)) if all(c.shape) else 0
    return span * torch.empty((), dtype=c.dtype).element_size()


class _Scratch(threading.local):
    """Grow-only scratch bytes for converted tensors, one set per reading thread.

    A temporary per converted tensor per read would come and go on every call; glibc raises
    its mmap threshold after such frees, so they end up as heap the process keeps
    (anonymous memory growing by tens of MB with the converted tensors). Reusing one buffer
    per role bounds it to the largest converted tensor."""

    def __init__(self) -> None:
        self.buffers: list[Optional[torch.Tensor]] = [None, None]

    def take(self, role: int, nbytes: int) -> torch.Tensor:
        buf = self.buffers[role]
        if buf is None or buf.numel() < nbytes:
            with torch.inference_mode(False):
                buf = self.buffers[role] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]


def _plan(runs: Sequence[_Run], direct: bool) -> list[Piece]:
    """Pieces of the runs read as they are (no dtype or stride conversion)."""
    plain = [(r.path, r.offset, r.nbytes, r.dest, r.what) for r in runs if r.convert is None]
    return plan_direct(plain) if direct else plan_buffered(plain)


def _read_runs(files: dict[str, ServedFile], runs: Sequence[_Run], dest: torch.Tensor,
               what: str, scratch: _Scratch, reader: FileReader, direct: bool = False,
               pieces: Optional[list[Piece]] = None) -> int:
    """Read ``runs`` into the CPU uint8 tensor ``dest``; returns the tensors converted."""
    used = {r.path: files[r.path] for r in runs}
    for f in used.values():
        f.check(what)
    reader.read(files, _plan(runs, direct) if pieces is None else pieces, dest, direct, what)
    converted = 0
    for r in runs:
        f = files[r.path]
        if r.convert is None:
            _check_sampled(f, r, dest[r.dest : r.dest + r.nbytes], what)
            continue
        c = r.convert
        with torch.inference_mode(False):
            raw = scratch.take(0, r.src_nbytes)
            whole = _Run(0, r.src_nbytes, r.path, r.offset, r.src_nbytes, r.what)
            reader.read(files, _plan([whole], direct), raw, direct, what)
            _check_sampled(f, r, raw, what)
            src = raw.view(c.src_dtype).view(c.shape)
            if c.via is not None:
                src = src.to(c.via)
            span = dest[r.dest : r.dest + r.nbytes]
            if r.skip == 0 and r.nbytes == _span_nbytes(c):  # the whole tensor: in place
                typed = span.view(c.dtype)
                typed.as_strided(c.shape, c.stride, typed.storage_offset()).copy_(src)
            else:  # part of it (a shard boundary cuts it): through the second scratch
                whole_out = scratch.take(1, _span_nbytes(c)).view(c.dtype)
                out = whole_out.as_strided(c.shape, c.stride, 0)
                out.copy_(src)
                span.copy_(span_as_bytes(out)[r.skip : r.skip + r.nbytes])
        converted += 1
    for f in used.values():  # a rewrite that raced the reads
        f.check(what)
    return converted


_LOAD_READER = FileReader()  # reads at load (host_store="memory", dlo-fx shard): buffered


def read_extents(extents: Sequence[Extent], lo: int, dest: torch.Tensor, what: str) -> None:
    """Read the block bytes ``[lo, lo + dest.numel())`` that ``extents`` hold into ``dest``
    (a CPU uint8 tensor) once, without keeping the files open (``host_store="memory"``)."""
    runs = _clip(extents, lo, lo + dest.numel())
    files = {r.path: ServedFile(r.path) for r in runs}
    try:
        _read_runs(files, runs, dest, what, _Scratch(), _LOAD_READER)
    finally:
        for f in files.values():
            f.close()


class _Staging:
    """``count`` pinned host buffers that device copies go through, used in turn; a buffer
    is refilled only once the copy that last read it has finished (its event). Each is
    sized once for the largest shard, out of pinned slabs ([Note: pinned slabs])."""

    def __init__(self, device: torch.device, count: int, pin: bool) -> None:
        self.device, self.count, self.pin = device, count, pin
        self.slabs: Optional[HostSlabs] = HostSlabs(device=device) if pin else None
        self.buffers: list[Optional[torch.Tensor]] = [None] * count
        self.events: list = [None] * count
        self.turn = 0

    def take(self, nbytes: int, largest: int = 0) -> tuple[int, torch.Tensor]:
        i = self.turn
        self.turn = (i + 1) % self.count
        if self.events[i] is not None:
            self.events[i].synchronize()  # the copy that last read it
            self.events[i] = None
        buf = self.buffers[i]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, largest)
            if self.slabs is not None:
                try:
                    buf = self.slabs.take(size)
                except RuntimeError as exc:
                    log.warning("dlo: pinning a %d-byte staging buffer failed (%s); using "
                                "pageable memory", size, exc)
                    self.slabs = None
            if self.slabs is None:
                buf = platform.host_buffer(size, pin=False)
            self.buffers[i] = buf
        return i, buf[:nbytes]

    def copied(self, i: int) -> None:
        event = platform.new_event(self.device)
        event.record(platform.current_stream(self.device))
        self.events[i] = event


class FileStore:
    """The open files and the file shards of one host store; read-ahead; read statistics."""

    def __init__(self, *, device: torch.device, num_slots: int, rank: int = 0,
                 pin: bool = False, depth: Optional[int] = None,
                 file_reads: str = "auto") -> None:
        self.device = device
        self.rank = rank
        self.file_reads = file_reads
        self.direct: Optional[bool] = None  # decided at the first read: `decide_direct`
        self.reader = FileReader()
        self.files: dict[str, ServedFile] = {}
        self.shards: list[FileShard] = []
        self.staging = _Staging(device, num_slots, pin) if platform.has_streams(device) else None
        self.depth = depth if depth is not None else num_slots + 1
        self.drop_behind: Optional[bool] = None  # None: only under memory pressure
        self.stats = {"block_reads": 0, "reads": 0, "bytes": 0, "seconds": 0.0,
                      "split_block_reads": 0, "tensor_reads": 0, "split_seconds": 0.0,
                      "converted": 0, "advised": 0, "dropped": 0, "direct_block_reads": 0}
        self._lock = threading.Lock()
        self._scratch = _Scratch()
        self._queue: "queue.SimpleQueue[Optional[int]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    # -- building --------------------------------------------------------------------------
    def shard(self, index: int, extents: Sequence[Extent], lo: int, hi: int) -> FileShard:
        """The runs of block bytes ``[lo, hi)`` (this rank's range); opens their files."""
        runs = _clip(extents, lo, hi)
        for r in runs:
            if r.path not in self.files:
                self.files[r.path] = ServedFile(r.path)
        runs = _sample_runs(self.files, runs, f"host block {index} (rank {self.rank})")
        shard = FileShard(self, index, hi - lo, runs)
        self.shards.append(shard)
        return shard

    def drop(self, first: int) -> None:
        """Forget shards of blocks ``first`` onwards (undoing a failed load)."""
        self.shards = [s for s in self.shards if s.index < first]

    # -- serving ---------------------------------------------------------------------------
    def served_bytes(self) -> int:
        """File bytes this store reads per call (every shard once)."""
        return sum(r.src_nbytes for s in self.shards for r in s.runs)

    def decide_direct(self) -> bool:
        """Whether reads bypass the page cache (``O_DIRECT``): ``file_reads="direct"``, or
        ``"auto"`` when the bytes every rank of this host serves (this store's times
        ``LOCAL_WORLD_SIZE``) exceed the memory available to the page cache
        (``MemAvailable``, or what the cgroup's limit leaves). Decided once, at the first
        read, when every block is stored."""
        if self.direct is None:
            if self.file_reads != "auto":
                self.direct = self.file_reads == "direct"
            else:
                room = procfs.available_memory()
                try:
                    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
                except ValueError:
                    local = 1
                self.direct = room is not None and self.served_bytes() * local > room
            log.info("dlo: rank %d reads %.2f GB per call %s", self.rank,
                     self.served_bytes() / 1e9,
                     "with O_DIRECT (around the page cache)" if self.direct
                     else "through the page cache")
        return self.direct

    def read(self, shard: FileShard, dest: torch.Tensor) -> None:
        """Copy ``shard``'s bytes into ``dest`` (``shard.nbytes`` bytes, on any device)."""
        what = f"host block {shard.index} (rank {self.rank})"
        if dest.is_meta:  # a slot of the meta device holds no values: nothing to read
            return
        direct = self.decide_direct()
        pieces = shard.pieces.get(direct)
        if pieces is None:
            pieces = shard.pieces[direct] = _plan(shard.runs, direct)
        start = time.perf_counter()
        if not platform.has_streams(dest.device):
            converted = _read_runs(self.files, shard.runs, dest, what, self._scratch,
                                   self.reader, direct, pieces)
        else:
            i, buf = self.staging.take(shard.nbytes, max(s.nbytes for s in self.shards))
            converted = _read_runs(self.files, shard.runs, buf, what, self._scratch,
                                   self.reader, direct, pieces)
            dest.copy_(buf, non_blocking=True)
            self.staging.copied(i)
        seconds = time.perf_counter() - start
        with self._lock:
            s = self.stats
            s["block_reads"] += 1
            s["reads"] += len(shard.runs)
            s["bytes"] += shard.nbytes
            s["seconds"] += seconds
            s["converted"] += converted
            s["direct_block_reads"] += direct
            if shard.split:
                s["split_block_reads"] += 1
                s["tensor_reads"] += len(shard.runs)
                s["split_seconds"] += seconds
        if not direct:  # a direct read has no page cache to fill
            self._notify(shard.index)

    # -- read-ahead ------------------------------------------------------------------------
    def _notify(self, index: int) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=_read_ahead,
                                            args=(self._queue, weakref.ref(self)),
                                            name="dlo-read-ahead", daemon=True)
            self._thread.start()
        self._queue.put(index)

    def window_bytes(self) -> int:
        return sum(s.nbytes for s in sorted(self.shards, key=lambda s: -s.nbytes)[: self.depth])

    def under_pressure(self) -> bool:
        if self.drop_behind is not None:
            return self.drop_behind
        free = procfs.free_memory()
        return free is not None and free < 2 * self.window_bytes()

    def advise(self, index: int, advice: int) -> None:
        """``posix_fadvise`` over the file ranges of the shard of block ``index``."""
        shard = next((s for s in self.shards if s.index == index), None)
        if shard is None:
            return
        for r in shard.runs:
            f = self.files.get(r.path)
            if f is not None and f.fd >= 0:
                try:
                    os.posix_fadvise(f.fd, r.offset, r.src_nbytes, advice)
                except OSError:  # advisory only (a closed file, a filesystem without it)
                    pass

    def close(self) -> None:
        self._queue.put(None)
        self.reader.close()
        for f in self.files.values():
            f.close()

    def __del__(self) -> None:  # the read-ahead thread holds no reference to the store
        try:
            self._queue.put(None)
        except Exception:
            pass


def _read_ahead(q: "queue.SimpleQueue[Optional[int]]", ref: "weakref.ref[FileStore]") -> None:
    while True:
        index = q.get()
        if index is None:
            return
        while True:  # only the latest block matters
            try:
                nxt = q.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                return
            index = nxt
        store = ref()
        if store is None:
            return
        indices = sorted(s.index for s in store.shards)
        if indices and index in indices:
            pos = indices.index(index)
            ahead = {indices[(pos + k) % len(indices)] for k in range(1, store.depth + 1)}
            for b in sorted(ahead):
                store.advise(b, os.POSIX_FADV_WILLNEED)
            store.stats["advised"] += len(ahead)
            if index not in ahead and store.under_pressure():
                store.advise(index, os.POSIX_FADV_DONTNEED)
                store.stats["dropped"] += 1
        del store

"""`FileReader`: a block's file bytes read by several threads, through the page cache or
around it (``O_DIRECT``), from `ServedFile`s (one open file each, its size and mtime
checked); `FileChangedError` where a file changed under them.

[Note: reading at the disk's rate]
A block read keeps ``threads`` requests of at most ``chunk`` bytes in flight, so it runs at
the disk's rate: one ``preadv`` at a time through the page cache does not (the kernel's
read-ahead keeps one window in flight, every page is copied once more out of the cache, and
a checkpoint larger than host RAM refills and evicts the cache on every call, taking CPU
from compute; docs/benchmarks.md, "Real-size models", measures the rates). Two ways:

* **buffered** (``file_reads="buffered"``, or ``"auto"`` when the served bytes fit in the
  memory available to the page cache): each piece is read straight into its place in the
  destination; the page cache keeps what it can for the next call, and the read-ahead thread
  of `FileStore` asks for the next blocks (``POSIX_FADV_WILLNEED``).
* **direct** (``file_reads="direct"``, or ``"auto"`` when the served bytes do not fit):
  ``O_DIRECT`` needs the file offset, the length and the buffer aligned to the device's
  block size, which safetensors offsets are not. The block's runs (tensors, or the one run
  of a pre-sharded file) are sorted by file offset, widened to ``ALIGN`` bytes and merged
  into *windows* of at most ``chunk`` bytes (runs that sit close in a file become a few
  large reads); a thread reads a window into its own aligned staging buffer and copies each
  run's bytes to their place in the block. Nothing goes through the page cache, so nothing
  is evicted, and there is no read-ahead to ask for.

A file system that refuses ``O_DIRECT`` (its open or its first read fails with ``EINVAL``)
is read through the page cache instead, with a warning naming the file, once per file.
A short read (a file that shrank during the read) raises `FileChangedError` naming the
file, as a buffered read does; the size, mtime and sampled-byte checks still run on every
read (see [Note: file-backed host store] in file_store.py).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

__all__ = ["ALIGN", "CHUNK", "THREADS", "FileChangedError", "FileReader", "Piece", "Segment",
           "ServedFile", "plan_direct", "plan_buffered"]


class FileChangedError(RuntimeError):
    """A file a host shard is served from was truncated, rewritten or removed."""


class ServedFile:
    """One open file and the size, mtime and ctime it had when it was opened. The ctime
    too: a file written in place with its mtime set back (``os.utime``) kept size and
    mtime, and served other weights with no error; no user call sets a ctime back."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise FileChangedError(f"dlo: cannot open {path} to serve weights from it "
                                   f"({exc})") from None
        st = os.fstat(self.fd)
        self.size, self.mtime_ns, self.ctime_ns = st.st_size, st.st_mtime_ns, st.st_ctime_ns
        self.dfd: Optional[int] = None  # O_DIRECT, opened at the first direct read
        self.direct_error: Optional[str] = None  # why O_DIRECT is not used, once it failed
        self._lock = threading.Lock()

    def direct_fd(self) -> Optional[int]:
        """The file opened with ``O_DIRECT``; None where the file system refuses it. The
        reader threads ask for it at once: one opens it, under the lock."""
        with self._lock:
            if self.direct_error is not None or self.fd < 0:
                return None
            if self.dfd is None:
                try:
                    self.dfd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)
                                       | getattr(os, "O_CLOEXEC", 0))
                except OSError as exc:
                    self.direct_error = exc.strerror or str(exc)
                    return None
                if os.fstat(self.dfd).st_ino != os.fstat(self.fd).st_ino:
                    self.direct_error = "the path names another file now"
                    replaced = True
                else:
                    replaced = False
            else:
                replaced = False
        if replaced:
            self.check("its next read")
            raise FileChangedError(f"dlo: {self.path} was replaced by another file while "
                                   "host_store='mmap' serves weights from it; restore it "
                                   "and load the model again")
        return self.dfd

    def no_direct(self, exc: OSError) -> None:
        """Read this file buffered from now on. The O_DIRECT descriptor stays open until
        `close`: another reader thread may be inside a read on it, and a descriptor closed
        under it, its number then reused by the next open, would read another file's
        bytes."""
        with self._lock:
            if self.direct_error is None:
                self.direct_error = exc.strerror or str(exc)

    def check(self, what: str) -> None:
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (self.size, self.mtime_ns,
                                                            self.ctime_ns):
            how = (f"truncated or extended from {self.size} to {st.st_size} bytes"
                   if st.st_size != self.size else "rewritten (its mtime changed)"
                   if st.st_mtime_ns != self.mtime_ns else
                   "rewritten keeping its size and mtime (its ctime changed; a chmod or "
                   "chown changes it too)")
            raise FileChangedError(
                f"dlo: {self.path} was {how} while host_store='mmap' serves {what} from it; "
                "the weights would be wrong. Restore the file (or never write to a "
                "checkpoint being served) and load the model again")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None


ALIGN = 4096
"""``O_DIRECT`` alignment of offsets, lengths and buffers (a page: every Linux block device
accepts it)."""
CHUNK = 8 << 20
"""Largest piece one thread reads at a time (8 MiB)."""
THREADS = 4
"""Reader threads: requests kept in flight."""
GAP = 64 << 10
"""Runs of one file at most this far apart are read as one window (direct reads)."""


@dataclass(frozen=True)
class Segment:
    """``nbytes`` bytes at ``at`` of a piece go to byte ``dest`` of the destination."""

    dest: int
    at: int
    nbytes: int


@dataclass(frozen=True)
class Piece:
    """File bytes ``[offset, offset + span)`` of ``path``; ``need`` of them must be there
    (the rest is alignment past a short file's end); ``segments`` say where they go."""

    path: str
    offset: int
    span: int
    need: int
    segments: tuple[Segment, ...]
    what: str


def _cut(path: str, offset: int, nbytes: int, dest: int, chunk: int):
    """A run's file bytes cut at absolute multiples of ``chunk``: (offset, nbytes, dest)."""
    end = offset + nbytes
    while offset < end:
        stop = min(end, (offset // chunk + 1) * chunk)
        yield offset, stop - offset, dest
        dest += stop - offset
        offset = stop


def plan_buffered(runs: Sequence[tuple[str, int, int, int, str]], chunk: int = CHUNK) -> list[Piece]:
    """Pieces of ``runs`` (path, file offset, nbytes, dest offset, what), each read straight
    into its destination."""
    out = []
    for path, offset, nbytes, dest, what in runs:
        for o, n, d in _cut(path, offset, nbytes, dest, chunk):
            out.append(Piece(path, o, n, n, (Segment(d, 0, n),), what))
    return out


def plan_direct(runs: Sequence[tuple[str, int, int, int, str]], chunk: int = CHUNK,
                gap: int = GAP) -> list[Piece]:
    """Aligned windows of at most ``chunk`` bytes covering ``runs`` (path, file offset,
    nbytes, dest offset, what), in file order, runs at most ``gap`` apart merged."""
    cut = sorted((path, o, n, d, what) for path, offset, nbytes, dest, what in runs
                 for o, n, d in _cut(path, offset, nbytes, dest, chunk))
    out: list[Piece] = []
    cur: Optional[list] = None  # [path, lo, hi, end, segments, what]

    def close() -> None:
        if cur is not None:
            path, lo, hi, end, segs, what = cur
            out.append(Piece(path, lo, hi - lo, end - lo,
                             tuple(Segment(d, o - lo, n) for o, n, d in segs), what))

    for path, o, n, d, what in cut:
        lo, hi = o // ALIGN * ALIGN, -(-(o + n) // ALIGN) * ALIGN
        if (cur is not None and cur[0] == path and lo <= cur[2] + gap
                and max(hi, cur[2]) - cur[1] <= chunk):
            cur[2], cur[3] = max(hi, cur[2]), max(o + n, cur[3])
            cur[4].append((o, n, d))
            continue
        close()
        cur = [path, lo, hi, o + n, [(o, n, d)], what]
    close()
    return out


class _Buffer(threading.local):
    """One page-aligned staging buffer of ``chunk`` bytes per reader thread."""

    chunk = 0
    buf: Optional[mmap.mmap] = None

    def take(self, nbytes: int) -> memoryview:
        if self.buf is None or len(self.buf) < nbytes:
            self.buf = mmap.mmap(-1, max(nbytes, CHUNK))  # anonymous: page aligned
        return memoryview(self.buf)[:nbytes]


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class FileReader:
    """Reader threads shared by one `FileStore`; `read` returns when every piece landed."""

    def __init__(self, threads: int = THREADS, chunk: int = CHUNK) -> None:
        self.threads, self.chunk = threads, chunk
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._local = _Buffer()
        self.fallbacks: list[str] = []  # files read buffered because O_DIRECT failed
        _READERS.add(self)

    def _after_fork(self) -> None:
        """In a child forked from this process: the pool's threads, and a lock one of them
        may have held, are not there (a read waited forever on pieces no thread ran, and a
        dlo_fx.load in a multiprocessing 'fork' child hung); start afresh."""
        self._pool = None
        self._lock = threading.Lock()
        self._local = _Buffer()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.threads,
                                                thread_name_prefix="dlo-read")
            return self._pool

    def read(self, files: dict[str, ServedFile], pieces: Sequence[Piece], dest: torch.Tensor,
             direct: bool, what: str) -> None:
        """Read ``pieces`` of ``files`` into the CPU uint8 tensor ``dest``."""
        if not pieces:
            return
        base = dest.data_ptr()
        task: Callable[[Piece], None]
        if direct:
            def task(p: Piece) -> None:
                self._read_direct(files[p.path], p, base, what)
        else:
            def task(p: Piece) -> None:
                _read_buffered(files[p.path], p, base, what)
        if len(pieces) == 1:
            task(pieces[0])
            return
        futures = [self._executor().submit(task, p) for p in pieces]
        first: Optional[BaseException] = None
        for f in futures:  # every piece ends before the destination is handed on
            exc = f.exception()
            if exc is not None and first is None:
                first = exc
        if first is not None:
            raise first

    def _read_direct(self, f: ServedFile, p: Piece, base: int, what: str) -> None:
        fd = f.direct_fd()
        if fd is None:
            self._warn(f)
            return _read_buffered(f, p, base, what)
        view = self._local.take(p.span)
        got = 0
        while got < p.need:
            try:
                n = os.preadv(fd, [view[got:]], p.offset + got)
            except OSError as exc:
                if exc.errno != errno.EINVAL or got:
                    raise
                self._fall_back(f, exc)
                return _read_buffered(f, p, base, what)
            if n <= 0 or (got + n) % ALIGN and got + n < p.need:
                got += max(n, 0)
                _ended(f, p.offset + got, p.need - got, f"{p.what} of {what}")
            got += n
        src = _address(view)
        for s in p.segments:
            ctypes.memmove(base + s.dest, src + s.at, s.nbytes)

    def _fall_back(self, f: ServedFile, exc: OSError) -> None:
        f.no_direct(exc)
        self._warn(f)

    def _warn(self, f: ServedFile) -> None:
        with self._lock:
            if f.path in self.fallbacks:
                return
            self.fallbacks.append(f.path)
        warnings.warn(f"dlo: {f.path} cannot be read with O_DIRECT ({f.direct_error}); "
                      "reading it through the page cache instead (file_reads='buffered' "
                      "silences this)", RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _ended(f: ServedFile, at: int, missing: int, what: str) -> None:
    f.check(what)  # names a truncation when that is why
    raise FileChangedError(f"dlo: {f.path} ended at byte {at} while reading {what} "
                           f"({missing} bytes missing); the file is truncated: restore it "
                           "and load the model again")


def _read_buffered(f: ServedFile, p: Piece, base: int, what: str) -> None:
    (s,) = p.segments if len(p.segments) == 1 and p.segments[0].at == 0 else (None,)
    if s is not None:  # straight into the destination
        view = (ctypes.c_char * s.nbytes).from_address(base + s.dest)
        mv = memoryview(view).cast("B")
        got = 0
        while got < s.nbytes:
            n = os.preadv(f.fd, [mv[got:]], p.offset + got)
            if n <= 0:
                _ended(f, p.offset + got, s.nbytes - got, f"{p.what} of {what}")
            got += n
        return
    buf = bytearray(p.need)  # a direct window read buffered (after a fallback)
    mv, got = memoryview(buf), 0
    while got < p.need:
        n = os.preadv(f.fd, [mv[got:]], p.offset + got)
        if n <= 0:
            _ended(f, p.offset + got, p.need - got, f"{p.what} of {what}")
        got += n
    src = _address(mv)
    for seg in p.segments:
        ctypes.memmove(base + seg.dest, src + seg.at, seg.nbytes)


_READERS: "weakref.WeakSet[FileReader]" = weakref.WeakSet()


def _reset_readers_after_fork() -> None:
    for reader in list(_READERS):
        reader._after_fork()


os.register_at_fork(after_in_child=_reset_readers_after_fork)

"""Sampled weight fingerprints: ranks that hold different bytes for one block raise.

The plan digest compares shapes only; in allgather mode a rank that loaded another
checkpoint of the same shapes would gather a silent mix of both. So every block also gets
a fingerprint of ``SAMPLES`` windows of ``WINDOW`` bytes spread evenly over its flat layout
(plus its size), taken from the full bytes before sharding, and the ranks compare them
in their one agreement (`ranks/agreement.py`). `dlo_fx.load` reads them from the checkpoint's
files with ``os.pread`` whatever the store (`file_fingerprint`), a compile from the
parameters (`block_fingerprint`). A handful of reads per block: its cost is measured
against load time in docs/benchmarks.md. A fingerprint cannot prove equality: two
checkpoints that differ only between the sampled windows pass.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from typing import Any, Optional, Sequence

import torch

from .file_reads import FileChangedError
from .layout import Entry

SAMPLES = 64
WINDOW = 8


def _windows(entries: Sequence[Entry]) -> tuple[int, list[tuple[int, list[int]]]]:
    """The block's size, and per entry with a sampled position (not all padding) its index
    and the entry-relative starts of its windows (``SAMPLES`` spread over the block)."""
    total = max((e.offset + e.nbytes for e in entries), default=0)
    out: list[tuple[int, list[int]]] = []
    if total:
        positions = sorted({i * total // SAMPLES for i in range(SAMPLES)})
        for i, e in enumerate(entries):
            lo = bisect.bisect_left(positions, e.offset)
            hi = bisect.bisect_left(positions, e.offset + e.nbytes)
            if lo < hi:
                out.append((i, [p - e.offset for p in positions[lo:hi]]))
    return total, out


def block_fingerprint(entries: Sequence[Entry], sources: Sequence[Optional[torch.Tensor]]) -> int:
    """A 62-bit hash of sampled windows of a block (``sources``: each entry's flat bytes).

    The byte indices of every window are made once per block; an entry takes its slice of
    them, so it costs a handful of tensor operations whatever its size."""
    total, windows = _windows(entries)
    h = hashlib.sha256(str(total).encode())
    for i, starts in windows:
        src, e = sources[i], entries[i]
        if src is None:
            h.update(b"?")
            continue
        at = (torch.tensor(starts)[:, None] + torch.arange(WINDOW)).reshape(-1)
        if starts[-1] + WINDOW > e.nbytes:  # the last window runs over
            at.clamp_(max=e.nbytes - 1)
        # One gather per entry; bytes() of a list, never .numpy() (that pins the storage).
        h.update(bytes(src.index_select(0, at.to(src.device)).tolist()))
    return int.from_bytes(h.digest()[:8], "little") >> 2


def extent_sources(entries: Sequence[Entry], extents: Sequence[Any]
                   ) -> list[Optional[tuple[str, int, int]]]:
    """Per entry, where `file_fingerprint` reads it: the ``(path, offset, nbytes)`` of the
    extent that starts at the entry's offset (`loading.shards.checkpoint_extents` makes one per
    tensor), or None."""
    at = {x.dest: (x.path, x.offset, x.src_nbytes) for x in extents}
    return [at.get(e.offset) if e.nbytes else None for e in entries]


def file_fingerprint(entries: Sequence[Entry],
                     sources: Sequence[Optional[tuple[str, int, int]]]) -> int:
    """`block_fingerprint` of bytes in files, read with ``os.pread`` (one read per window,
    no mapping: a file truncated meanwhile is an error naming it, never a SIGBUS).
    ``sources``: per entry, ``(path, offset, nbytes)`` of its bytes in the file (the
    checkpoint tensor as stored, whatever dtype the block casts it to), or None.

    Every store and every rank computes it from the checkpoint the same way, so ranks that
    read another checkpoint of the same shapes differ (`dlo_fx.runtime.ranks.agreement`)."""
    total, windows = _windows(entries)
    h = hashlib.sha256(str(total).encode())
    fds: dict[str, int] = {}
    try:
        for i, starts in windows:
            src, e = sources[i], entries[i]
            if src is None:
                h.update(b"?")
                continue
            path, offset, nbytes = src
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            got = bytearray()
            for start in starts:  # the file's bytes may be fewer (a dtype cast): clipped
                n = max(0, min(WINDOW, nbytes - start))
                chunk = os.pread(fds[path], n, offset + start) if n else b""
                if len(chunk) < n:
                    raise FileChangedError(
                        f"dlo: {path} ended at byte {offset + start + len(chunk)} while reading "
                        f"the weights of {e.fqn!r} (the file is truncated, or was truncated "
                        "while the model loaded); restore the file and load the model again")
                got += chunk
            h.update(bytes(got))
    finally:
        for fd in fds.values():
            os.close(fd)
    return int.from_bytes(h.digest()[:8], "little") >> 2

"""Sampled weight fingerprints: ranks that hold different bytes for one block raise.

The plan digest compares shapes only; in allgather mode a rank that loaded another
checkpoint of the same shapes would gather a silent mix of both. So every block also gets
a fingerprint of ``SAMPLES`` windows of ``WINDOW`` bytes spread evenly over its flat layout
(plus its size), taken from the full bytes before sharding, and the ranks compare them
with one tensor collective (`check_same_weights`). A handful of reads per block: its cost
is measured against load time in docs/benchmarks.md. A fingerprint cannot prove equality:
two checkpoints that differ only between the sampled windows pass.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Any, Optional, Sequence

import torch

from .layout import Entry

SAMPLES = 64
WINDOW = 8


def block_fingerprint(entries: Sequence[Entry], sources: Sequence[Optional[torch.Tensor]]) -> int:
    """A 62-bit hash of sampled windows of a block (``sources``: each entry's flat bytes).

    The byte indices of every window are made once per block; an entry takes its slice of
    them, so it costs a handful of tensor operations whatever its size."""
    total = max((e.offset + e.nbytes for e in entries), default=0)
    h = hashlib.sha256(str(total).encode())
    if total:
        positions = sorted({i * total // SAMPLES for i in range(SAMPLES)})
        every = (torch.tensor(positions)[:, None] + torch.arange(WINDOW)).reshape(-1)
        for e, src in zip(entries, sources):
            lo = bisect.bisect_left(positions, e.offset)
            hi = bisect.bisect_left(positions, e.offset + e.nbytes)
            if lo == hi:
                continue  # every sampled position of this entry is alignment padding
            if src is None:
                h.update(b"?")
                continue
            at = every[lo * WINDOW : hi * WINDOW] - e.offset
            if positions[hi - 1] - e.offset + WINDOW > e.nbytes:  # the last window runs over
                at.clamp_(max=e.nbytes - 1)
            # One gather per entry; bytes() of a list, never .numpy() (that pins the storage).
            h.update(bytes(src.index_select(0, at.to(src.device)).tolist()))
    return int.from_bytes(h.digest()[:8], "little") >> 2


def check_same_weights(runtime: Any, fingerprints: Sequence[int], names: Sequence[str],
                       what: str) -> None:
    """Raise `ValueError` on every rank when the ranks' fingerprints differ, naming the
    first differing block. One exchange of the block count, then one of the fingerprints,
    through the executor's worker (in the order of every other collective)."""
    group = runtime.group
    if group.dp == 1 or runtime.mode != "allgather":
        return
    from .graph_call import CLOCK_WORDS, check_rows, exchange, word

    rows: dict[str, list] = {}
    clock = [word("dlo-fingerprints"), len(fingerprints)] + [3] * (CLOCK_WORDS - 2)

    def task() -> None:  # a clock first: every control exchange has the same size
        check_rows(group, exchange(group, runtime.device, clock, what), what)
        rows["every"] = exchange(group, runtime.device, list(fingerprints) or [0], what)

    runtime.executor.wait(runtime.executor.gather(-1, task, None))
    every = rows["every"]
    mine = every[group.rank]
    for b in range(len(fingerprints)):
        for i, row in enumerate(every):
            if row[b] != mine[b]:
                raise ValueError(
                    f"dlo: the ranks hold different weights for block {b} of {what} (first "
                    f"parameter {names[b]!r}): sampled fingerprint {mine[b]:#x} on global rank "
                    f"{group.ranks[group.rank]} but {row[b]:#x} on global rank "
                    f"{group.ranks[i]}. Every rank of the {group.describe()} must load the "
                    "same checkpoint (same files, same dtype)")

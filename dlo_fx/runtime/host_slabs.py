"""`HostSlabs`: pinned host shards and staging buffers packed into a few large slabs.

[Note: pinned slabs]
``pin_memory()`` goes through PyTorch's caching host allocator, which rounds every request
up to a power of two and keeps the rounding: a 680 MB host shard holds 1 GiB of page-locked
memory, and a store of such shards pins 1.5x what it uses (1.78x to 1.9x measured in
serving stacks). Page-locked memory cannot be swapped or reclaimed, so that slack is lost
to the host. `HostSlabs` asks the platform (`platform.pinned_slab`) for power-of-two slabs
(the size the allocator grants anyway), and carves the shards out of them, first fit, each
at ``alignment``. A new slab is at least as large as everything allocated so far (from
``SLAB_MIN``, at most ``SLAB_MAX``, 2 GiB, unless one request is larger), so a small model pins
little and a large one needs few slabs: what is pinned and not used is the free tail of the
slabs, at most one slab's worth (``SLAB_MAX``) plus what first fit leaves between shards.
`memory_report` prints both sums (``pinned_requested_bytes``, ``pinned_allocated_bytes``).
Nothing is ever given back to a slab: a store's shards live as long as the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import platform

__all__ = ["HostSlabs", "SLAB_MAX", "SLAB_MIN"]

SLAB_MIN = 2 << 20  # 2 MiB
SLAB_MAX = 2 << 30  # 2 GiB


@dataclass
class _Slab:
    buffer: torch.Tensor
    used: int = 0

    @property
    def free(self) -> int:
        return self.buffer.numel() - self.used


class HostSlabs:
    """Page-locked host bytes handed out as views of a few slabs; counts what was asked
    for (``requested``) and what the slabs hold (``allocated``)."""

    def __init__(self, alignment: int = 4096) -> None:
        self.alignment = alignment
        self.slabs: list[_Slab] = []
        self.requested = 0
        self.allocated = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` zeroed, page-locked bytes (a view of a slab). RuntimeError where the
        platform cannot pin them."""
        size = -(-max(nbytes, 1) // self.alignment) * self.alignment
        slab = next((s for s in self.slabs if s.free >= size), None)
        if slab is None:
            want = max(size, min(max(self.allocated, SLAB_MIN), SLAB_MAX))
            slab = _Slab(platform.pinned_slab(want))
            self.slabs.append(slab)
            self.allocated += slab.buffer.numel()
        view = slab.buffer[slab.used : slab.used + nbytes]
        slab.used += size
        self.requested += nbytes
        with torch.inference_mode(False):
            view.zero_()
        return view

    def report(self) -> dict[str, int]:
        return {"requested": self.requested, "allocated": self.allocated,
                "slabs": len(self.slabs)}


def pinned_figures(*slabs: Optional[HostSlabs]) -> tuple[int, int]:
    """(requested, allocated) pinned bytes of ``slabs`` (None ones skipped)."""
    got = [s for s in slabs if s is not None]
    return sum(s.requested for s in got), sum(s.allocated for s in got)

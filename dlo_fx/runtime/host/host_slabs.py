"""`HostSlabs`: pinned host shards and staging buffers packed into a few large slabs.

[Note: pinned slabs]
Page-locked memory cannot be swapped or reclaimed, so every pinned byte that holds nothing
is lost to the host. What must hold, in what `memory_report` prints
(``pinned_requested_bytes``, the bytes shards and staging buffers use;
``pinned_allocated_bytes``, what their slabs hold; `HostSlabs` counts both as it allocates
slabs and takes from them):

- where the platform registers host memory in place (CUDA, ROCm: ``cudaHostRegister``),
  allocated = requested, plus each shard rounded up to ``alignment``, each slab to a page,
  and the free tail of the one small slab being filled (below ``SMALL_SHARD``, at most the
  small shards' own bytes);
- elsewhere (`pin_memory`), at most one slab's worth (``SLAB_MAX``) plus first fit's gaps
  more; the policy can pin up to 2x.

``pin_memory()`` goes through PyTorch's caching host allocator, which rounds every request
up to a power of two and keeps the rounding (a 680 MB host shard holds 1 GiB of
page-locked memory). So slabs are allocated that way only where there is no choice:

- Registered (`platform.registered_slab`, where `platform.can_register`): a slab is an
  anonymous private mapping of exactly the bytes it is to hold (page rounded), page-locked
  in place. A finalizer on its storage unregisters and unmaps it when the last view of it
  dies (the store released by `dlo_fx.release`, or collected), after synchronising the
  device it feeds: a stream waits for a copy queued from it, the host does not (outside
  steady state, once per slab). `Runtime.store_blocks` announces every block of a compile,
  an offload or a load before it stores the first (`HostStore.reserve`; the loader passes
  its blocks ``ahead`` of the generator that reads them), so the store registers their
  shards as a few slabs of exactly their sizes, packed in order up to ``SLAB_MAX`` each;
  takes fill those first. A shard nobody announced gets a slab of its own size. Shards,
  and announced runs of them, below ``SMALL_SHARD`` share small slabs instead, each as
  large as the small slabs before it (the first exactly its shards), so that a model of
  many small blocks stored one by one (a graph Dynamo reuses for every layer) registers a
  few regions rather than thousands.
- Power-of-two (`platform.pinned_slab`, ``pin_memory``: no registration on this platform,
  or a registration refused, which warns, consumes the CUDA error it left so that no later
  kernel launch reports it, and falls back for good): a slab is the power of two the
  allocator grants anyway, carved first fit, each shard at ``alignment``. A new slab is at
  least as large as everything allocated so far (from ``SLAB_MIN``, at most ``SLAB_MAX``
  unless one request is larger), so a small model pins little and a large one needs few
  slabs.

Nothing is ever given back to a slab: a store's shards live as long as the store.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from ..device import platform

__all__ = ["HostSlabs", "SLAB_MAX", "SLAB_MIN", "SMALL_SHARD"]

SLAB_MIN = 2 << 20  # 2 MiB
SLAB_MAX = 2 << 30  # 2 GiB
SMALL_SHARD = 2 << 20  # registered: shards below this share slabs


@dataclass
class _Slab:
    buffer: torch.Tensor
    used: int = 0
    reserved: bool = False  # sized for shards announced by `HostSlabs.reserve`
    small: bool = False  # registered, shared by shards below SMALL_SHARD

    @property
    def free(self) -> int:
        return self.buffer.numel() - self.used


class HostSlabs:
    """Page-locked host bytes handed out as views of a few slabs; counts what was asked
    for (``requested``) and what the slabs hold (``allocated``). ``exact``: register exactly
    sized slabs (True), take power-of-two ones (False), or ask `platform.can_register` at
    the first allocation (None). ``device``: the device the slabs feed, which finishes its
    copies from a registered slab before it is unregistered. See [Note: pinned slabs]."""

    def __init__(self, alignment: int = 4096, exact: Optional[bool] = None,
                 device: Optional[torch.device] = None) -> None:
        self.alignment = alignment
        self.exact = exact
        self.device = device
        self.slabs: list[_Slab] = []
        self.requested = 0
        self.allocated = 0

    def _aligned(self, nbytes: int) -> int:
        return -(-max(nbytes, 1) // self.alignment) * self.alignment

    def registers(self) -> bool:
        """Whether new slabs are registered exactly (deciding it on the first call)."""
        if self.exact is None:
            self.exact = platform.can_register()
        return self.exact

    def _register(self, nbytes: int, **kind: bool) -> Optional[_Slab]:
        """A registered slab of ``nbytes``, or None (the slabs fall back to power-of-two
        ones for good, saying so) where registration fails."""
        try:
            buffer = platform.registered_slab(nbytes, self.device)
        except RuntimeError as exc:
            warnings.warn(
                f"dlo: registering {nbytes} bytes of host memory as page-locked failed ({exc}); "
                "falling back to power-of-two pin_memory slabs, which can pin up to 2x what "
                "the host store uses", RuntimeWarning, stacklevel=4)
            self.exact = False
            return None
        slab = _Slab(buffer, **kind)
        self.slabs.append(slab)
        self.allocated += buffer.numel()
        return slab

    def reserve(self, sizes: Iterable[int]) -> None:
        """Register slabs of exactly the room the takes of ``sizes`` (in that order) need,
        packed in order up to ``SLAB_MAX`` each; nothing where slabs are power-of-two ones
        (they grow as before). See [Note: pinned slabs]."""
        if not self.registers():
            return
        runs: list[int] = []
        for n in sizes:
            if n <= 0:
                continue
            size = self._aligned(n)
            if runs and runs[-1] + size <= SLAB_MAX:
                runs[-1] += size
            else:
                runs.append(size)
        for run in runs:
            if run < SMALL_SHARD:  # with the other small shards, as `take` places them
                if any(s.small and s.free >= run for s in self.slabs):
                    continue
                slab = self._small_slab(run)
            else:
                slab = self._register(run, reserved=True)
            if slab is None:
                return

    def _small_slab(self, size: int) -> Optional[_Slab]:
        """A registered slab for shards below ``SMALL_SHARD``: ``size``, or as large as the
        small slabs so far (at most ``SLAB_MAX``), whichever is larger, so that many small
        shards register a few regions (their count grows as the log of their bytes)."""
        small = sum(s.buffer.numel() for s in self.slabs if s.small)
        return self._register(max(size, min(small, SLAB_MAX)), small=True)

    def _new_slab(self, size: int) -> _Slab:
        if self.registers():
            slab = self._register(size) if size >= SMALL_SHARD else self._small_slab(size)
            if slab is not None:
                return slab
        want = max(size, min(max(self.allocated, SLAB_MIN), SLAB_MAX))
        slab = _Slab(platform.pinned_slab(want))
        self.slabs.append(slab)
        self.allocated += slab.buffer.numel()
        return slab

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` zeroed, page-locked bytes (a view of a slab): first fit in the
        reserved slabs, then in the others, else in a new slab. RuntimeError where the
        platform cannot pin them."""
        size = self._aligned(nbytes)
        slab = next((s for s in self.slabs if s.reserved and s.free >= size), None) or \
            next((s for s in self.slabs if not s.reserved and s.free >= size), None) or \
            self._new_slab(size)
        view = slab.buffer[slab.used : slab.used + nbytes]
        slab.used += size
        self.requested += nbytes
        with torch.inference_mode(False):
            view.zero_()
        return view

    def trim(self) -> None:
        """Let go of the slabs nothing was taken from (a store that failed drops the blocks
        it reserved them for); a registered one is unregistered once nothing views it."""
        unused = [s for s in self.slabs if s.used == 0]
        self.slabs = [s for s in self.slabs if s.used]
        self.allocated -= sum(s.buffer.numel() for s in unused)

    def report(self) -> dict[str, int]:
        return {"requested": self.requested, "allocated": self.allocated,
                "slabs": len(self.slabs)}


def pinned_figures(*slabs: Optional[HostSlabs]) -> tuple[int, int]:
    """(requested, allocated) pinned bytes of ``slabs`` (None ones skipped)."""
    got = [s for s in slabs if s is not None]
    return sum(s.requested for s in got), sum(s.allocated for s in got)

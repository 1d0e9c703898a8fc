"""`Runtime`: the host store, the slots and the executor shared by every graph compiled
with one configuration, and the slot state machine the schedule nodes drive.

[Note: slot reuse and stream ordering]
Graph block ``g`` lives in slot ``g % num_slots``. The schedule guarantees, in program
order, ``swap_slot(g)`` before ``prefetch(g + num_slots)`` (which reuses the slot) and
``prefetch(g)`` before ``wait(g)`` before any read of the slot. On CPU the compute thread
reads synchronously, so once ``swap_slot(g)`` has run no read of the slot is pending; the
copy is handed to one worker thread and ``wait`` blocks on it. Each slot remembers which
store block it holds (``slot_block``): a prefetch of the block a slot already holds is
skipped, which is what makes the wrap-around prefetch of block 0 a warm start and lets a
model of at most ``num_slots`` blocks stop copying after its first call. ``wait`` on a
slot that does not hold its block (another graph used the slot in between) issues the copy
itself, so a stale slot is never read.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Optional, Sequence

import torch

from ..config import DLOConfig
from .executor import CpuExecutor
from .host_store import HostStore
from .slots import SlotPool

log = logging.getLogger(__name__)


class Runtime:
    def __init__(self, config: DLOConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        pin = config.pin_memory and device.type != "cpu"
        self.store = HostStore(alignment=config.alignment, pin=pin)
        self.slots = SlotPool(config.num_slots, device)
        self.executor = CpuExecutor(fault_delay_s=config.fault_delay_s)
        self.slot_block: list[Optional[int]] = [None] * config.num_slots
        self._pending: list = [None] * config.num_slots
        self._resident: dict[int, torch.Tensor] = {}
        self.copies = 0  # number of block copies issued (for tests and reports)

    # -- registration (compile time, or first call of a reused graph) --------------------
    def register_block(self, params: Sequence[torch.nn.Parameter], fqns: Sequence[str]) -> int:
        block = self.store.add_block(params, fqns)
        self._fit_slots(block.slot_bytes)
        return block.index

    def _fit_slots(self, nbytes: int) -> None:
        if nbytes > self.slots.slot_bytes:
            self.drain()
            self.slots.ensure(nbytes)
            self.slot_block = [None] * self.slots.num_slots

    def resolve(self, params: Sequence[torch.nn.Parameter], fqns: Sequence[str]) -> int:
        """Host block a graph block is bound to for this call.

        Parameters never seen are registered as a new block (a graph Dynamo reuses for
        the next layer passes that layer's parameters). Otherwise the host block holding
        most of ``params`` wins; a parameter held elsewhere (a table shared by every
        layer and passed in as an argument) is read from a resident copy by ``view``.
        """
        entries = [self.store.entry(p) for p in params]
        if None in entries:
            fresh = [(p, f) for p, f, e in zip(params, fqns, entries) if e is None]
            return self.register_block([p for p, _ in fresh], [f for _, f in fresh])
        first = entries[0].block
        if all(e.block == first for e in entries):
            return first
        counts: dict[int, int] = {}
        for e in entries:
            counts[e.block] = counts.get(e.block, 0) + e.nbytes
        return max(counts, key=counts.__getitem__)

    def resident_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """A device copy of a stored (hollow) parameter that a graph keeps resident."""
        tensor = self._resident.get(id(param))
        if tensor is None:
            entry = self.store.entry(param)
            block = self.store.blocks[entry.block]
            flat = torch.empty(block.slot_bytes, dtype=torch.uint8, device=self.device)
            flat[: block.shard.numel()].copy_(block.shard)
            tensor = self._resident[id(param)] = entry.view_of(flat).clone()
        return tensor

    @property
    def resident_copy_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._resident.values())

    # -- the schedule -------------------------------------------------------------------
    def prefetch(self, block: int, slot: int) -> None:
        if self.slot_block[slot] == block:
            return
        self.slot_block[slot] = block
        host = self.store.blocks[block].shard
        dst = self.slots.buffers[slot][: host.numel()]
        self._pending[slot] = self.executor.submit(lambda: dst.copy_(host))
        self.copies += 1

    def wait(self, block: int, slot: int) -> None:
        if self.slot_block[slot] != block:
            self.prefetch(block, slot)
        pending = self._pending[slot]
        if pending is not None:
            self.executor.wait(pending)
            self._pending[slot] = None

    def swap(self, slot: int) -> None:
        """The block in ``slot`` has been read for the last time in this graph."""

    def view(self, slot: int, block: int, param: torch.Tensor) -> torch.Tensor:
        entry = self.store.entry(param)
        if entry.block != block:  # held by another host block: see `resolve`
            return self.resident_tensor(param)
        return self.slots.view(slot, entry)

    def drain(self) -> None:
        for slot, pending in enumerate(self._pending):
            self.executor.wait(pending)
            self._pending[slot] = None


# -- one runtime per configuration ------------------------------------------------------
_RUNTIMES: dict[tuple, Runtime] = {}
_LOCK = threading.Lock()


def runtime_for(config: DLOConfig, device: torch.device) -> Runtime:
    key = config.key() + (str(device),)
    with _LOCK:
        runtime = _RUNTIMES.get(key)
        if runtime is None:
            runtime = _RUNTIMES[key] = Runtime(config, device)
        return runtime


def reset_runtimes() -> None:
    """Drop every runtime (their host stores and slots). Called by ``torch._dynamo.reset()``."""
    with _LOCK:
        runtimes = list(_RUNTIMES.values())
        _RUNTIMES.clear()
    for rt in runtimes:
        rt.drain()
        rt.executor.shutdown()


def runtimes_holding(params: Sequence[torch.Tensor]) -> list[Runtime]:
    """Runtimes whose host store holds any of ``params``."""
    with _LOCK:
        found = list(_RUNTIMES.values())
    return [rt for rt in found if any(p in rt.store for p in params)]

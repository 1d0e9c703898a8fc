"""`SlotMachine`: the slot state machine the schedule nodes drive (prefetch, allgather,
wait, swap_slot, and the views of a slot), one part of a `Runtime` (runtime.py).

[Note: slot reuse and stream ordering]
No read of a slot sees bytes other than its block's, and no copy overwrites a slot still
being read. Graph block ``g`` lives in slot ``g % num_slots``. The schedule guarantees, in
program order, ``swap_slot(g)`` before ``prefetch(g + num_slots)`` (which reuses the slot)
and ``prefetch(g)`` before ``wait(g)`` before any read of the slot. On CPU the compute
thread reads synchronously, so once ``swap_slot(g)`` has run no read of the slot is
pending; the copy is handed to one worker thread and ``wait`` blocks on it. Each slot
remembers which store block it holds (``slot_block``): a prefetch of the block a slot
already holds is skipped, which is what makes the wrap-around prefetch of block 0 a warm
start and lets a model of at most ``num_slots`` blocks stop copying after its first call.
``wait`` on a slot that does not hold its block (another graph used the slot in between)
issues the copy itself, so a stale slot is never read. A prefetch issues its copy after
the slot's last task (``_pending``, kept until a ``wait`` on it succeeds): the wrap-around
prefetch and gather of a slot that the next graph refills is never waited on, and a gather
landing later would overwrite an inline copy (wrong outputs in allgather mode with graph
breaks).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from .ranks.collectives import ShardGroup, gather_in_place, shard_read
from .device.shared_slots import SharedSlots, SlotBlocks
from .device.executor import FaultDelay
from .host.host_store import HostStore
from .interrupts import deferred
from .lifecycle import Lifecycle
from .device.trace import Tracer
from .weights.weight_reads import WeightReads


class SlotMachine:
    """Which of the host blocks of ``store`` each of the device's ``shared`` slots holds
    for one runtime (``token`` tells it from the others on the slots), and the copies and
    gathers (over ``group`` where the store is sharded) that fill them. A parameter of
    another host block is read through ``reads``; a failed copy or gather fails ``life``.
    ``tracer``, when set, records the slots' timeline; ``fault_delay`` is a test option."""

    def __init__(self, store: HostStore, shared: SharedSlots, group: ShardGroup,
                 tracer: Optional[Tracer], fault_delay: FaultDelay, token: int,
                 life: Lifecycle, reads: WeightReads) -> None:
        self.store = store
        self.shared = shared
        self.slots = shared.pool
        self.executor = shared.executor
        self.group = group
        self.tracer = tracer
        self.fault_delay = fault_delay
        self.token = token
        self.life = life
        self.reads = reads
        num_slots = self.slots.num_slots
        self._pending: list = shared.pending  # shared with the models on the slots
        self._gathered: list[bool] = [True] * num_slots
        self._ready_ns: list[int] = [0] * num_slots  # when each slot's wait returned
        self.copies = 0  # number of block copies issued (for tests and reports)

    def trace(self) -> Tracer:
        """The slots' timeline, recorded from now on if it was not yet."""
        if self.tracer is None:
            self.tracer = Tracer()
        return self.tracer

    @property
    def slot_block(self) -> SlotBlocks:
        """Host block of this runtime each slot holds (``None``: nothing of this
        runtime's, or another runtime's block since)."""
        return SlotBlocks(self.shared, self.token)

    @slot_block.setter
    def slot_block(self, value: Sequence[Optional[int]]) -> None:
        if any(v is not None for v in value):
            raise ValueError("slot_block can only be reset to None")
        self.shared.forget()  # buffers replaced, or a failed copy: trust no slot

    def fit_slots(self, nbytes: int) -> None:
        """Grow the slots to hold a block of ``nbytes`` (compile or load time only).

        Under the device lock: the slots are shared with the other models on the device,
        and `dlo_fx.load` stores its blocks without holding it. A load on one thread
        replaced the buffers while another thread's graph ran between the wait for a slot
        and its views of it, which then read the new, unwritten buffer: a wrong output
        with no error."""
        if nbytes <= self.slots.slot_bytes:
            return
        with self.life.lock:
            if nbytes > self.slots.slot_bytes:  # another thread may have grown them
                self.drain()
                self.executor.sync()  # no copy or gather may still touch the old slots
                self.slots.ensure(nbytes)
                self.slot_block = [None] * self.slots.num_slots

    def resolve(self, params: Sequence[torch.nn.Parameter], fqns: Sequence[str]) -> int:
        """Host block a graph block is bound to for this call.

        Every parameter is stored already (a graph Dynamo reuses for the next layer passes
        that layer's parameters, stored when the model was): the host block holding most of
        ``params`` wins; a parameter held elsewhere (a table shared by every layer and
        passed in as an argument) is read from a resident copy by `view`. Nothing is
        stored at call time: a parameter this runtime does not store raises.
        """
        entries = [self.store.entry(p) for p in params]
        if None in entries:
            fqn = fqns[entries.index(None)]
            raise RuntimeError(
                f"dlo: parameter {fqn!r} reaches a streamed graph but is not stored with the "
                "model it is called with (a parameter set on the model after it was "
                "offloaded, outside any compile); call dlo_fx.release(model), then offload "
                "and compile it again")
        first = entries[0].block
        if all(e.block == first for e in entries):
            return first
        counts: dict[int, int] = {}
        for e in entries:
            counts[e.block] = counts.get(e.block, 0) + e.nbytes
        return max(counts, key=counts.__getitem__)

    def prefetch(self, block: int, slot: int) -> None:
        """H2D of this rank's shard of ``block`` into its slice of ``slot``."""
        with deferred():  # see [Note: interrupts and slot state]
            if self.slot_block[slot] == block:
                return  # already there, or on its way (the wrap-around prefetch)
            self.slot_block[slot] = None  # unknown until the copy is issued and recorded
            flat = self.slots.buffers[slot]
            task = shard_read(self.store, self.group, flat, block)  # see collectives.py
            if self.tracer is not None:
                task = self.tracer.timed("prefetch", block, slot, task)
            # Behind the slot's last task, which nobody may have waited on (see the Note).
            handle = self.executor.copy(slot, task, self.store.blocks[block].shard_nbytes,
                                        self._pending[slot], self.fault_delay.next())
            self._pending[slot] = handle
            self._gathered[slot] = self.store.dp == 1  # a sharded store: allgather mode
            self.slot_block[slot] = block
            self.copies += 1

    def allgather(self, block: int, slot: int) -> None:
        """Complete ``block`` in ``slot`` from every rank's slice, in place. Queued behind
        its copy on the same worker, so every rank issues its gathers in one order."""
        with deferred():
            if self._gathered[slot] or self.slot_block[slot] != block:
                return
            flat = self.slots.buffers[slot]
            spec = self.store.blocks[block].spec
            what = f"host block {block} into slot {slot}"
            group = self.group  # the task holds no runtime (see `fill_task`)
            task = lambda: gather_in_place(flat, spec.shard_bytes, group, what)  # noqa: E731
            if self.tracer is not None:
                task = self.tracer.timed("allgather", block, slot, task)
            self._pending[slot] = self.executor.gather(slot, task, self._pending[slot])
            self._gathered[slot] = True

    def wait(self, block: int, slot: int) -> None:
        """Block until ``slot`` holds ``block``, complete. Ctrl-C interrupts the wait and
        leaves the copy pending: the next wait on the slot waits for it again."""
        self.life.check_open()
        if self.slot_block[slot] != block:
            self.prefetch(block, slot)
        if not self._gathered[slot]:
            self.allgather(block, slot)
        pending = self._pending[slot]
        tracer = self.tracer
        start = time.perf_counter_ns() if tracer is not None else 0
        if pending is not None:
            try:
                self.executor.wait(pending)
            except BaseException as exc:
                if self.executor.failed(pending):
                    # Fail closed: after a failed collective the group is unusable, and
                    # a slot may hold half a block. Nothing reads a slot of this runtime
                    # again. (An interrupted wait is no failure: the copy still runs.)
                    self.life.fail(exc)
                    self.slot_block = [None] * self.slots.num_slots
                    # The failure is this model's only ([Note: a failure stays with its model])
                    self.shared.drop_failed(slot, pending)
                raise
            if self._pending[slot] is pending:
                self._pending[slot] = None
        if tracer is not None:
            end = time.perf_counter_ns()
            tracer.add("wait", block, slot, start, end)
            self._ready_ns[slot] = end

    def swap(self, slot: int) -> None:
        """The block in ``slot`` has been read for the last time in this graph."""
        self.executor.release(slot)
        if self.tracer is not None:
            self.tracer.add("compute", self.slot_block[slot], slot, self._ready_ns[slot],
                            time.perf_counter_ns())

    def view(self, slot: int, block: int, param: torch.Tensor,
             cast: Optional[torch.dtype] = None) -> torch.Tensor:
        """``param`` as a view of ``slot``, in the dtype it is stored in when the graph
        casts it (``cast``: the graph's node after the slot view does), else in its own
        (see [Note: a storage dtype] in host/layout.py)."""
        entry = self.store.entry(param)
        if entry.block != block:  # held by another host block: see `resolve`
            return self.reads.resident_tensor(param)
        view = self.slots.view(slot, entry, param.requires_grad)
        if entry.compute_dtype is not None and cast is None:
            # a graph scheduled for a model of the class stored in its own dtype
            return view.to(entry.compute_dtype)
        return view

    def view_reads(self, block: int, param: torch.Tensor) -> None:
        """What `view` reads outside the slot, without the view (a graph completing its
        schedule after a failure): the block of a parameter another host block holds."""
        entry = self.store.entry(param)
        if entry.block != block:
            self.reads.fetch_resident(param)

    def drain(self, *, raise_errors: bool = True) -> None:
        for slot, pending in enumerate(self._pending):
            try:
                self.executor.wait(pending)
            except BaseException as exc:
                if isinstance(exc, Exception) and self.executor.failed(pending):
                    # the failure of the model that issued it, raised by its own wait
                    self.shared.drop_failed(slot, pending)
                    continue
                if raise_errors:
                    raise  # the handle stays: an interrupted drain can be waited on again
            if self._pending[slot] is pending:
                self._pending[slot] = None

    def close(self) -> None:
        """The runtime is released: wait for its copies (not in a forked child, where the
        parent's never finish) and forget the slots it filled."""
        if self.life.in_process():
            self.drain(raise_errors=False)
        blocks = self.slot_block
        for slot in range(len(blocks)):
            if blocks[slot] is not None:
                blocks[slot] = None

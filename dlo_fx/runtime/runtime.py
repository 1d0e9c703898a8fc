"""`Runtime`: one model's host store, mode and resident copies, the slots and executor it
shares with the other models on its device, and the slot state machine the schedule
nodes drive. A runtime is found from the parameters it stores (`owner_of`), never from
options; see [Note: the model owns its runtime].

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
itself, so a stale slot is never read. A prefetch issues its copy after the slot's last
task (``_pending``, kept until a ``wait`` on it succeeds): the wrap-around prefetch and
gather of a slot that the next graph refills is never waited on, and an inline copy must
not be overwritten by that gather landing later (the cause of wrong outputs in allgather
mode with graph breaks; docs/architecture.md).

[Note: a forked process]
``os.fork`` (multiprocessing's default start method on Linux) copies a runtime into the
child without what runs it: the executor's worker thread, a copy the parent had in
flight, the device streams and the process group stay with the parent, and a thread of
the parent may have held the slots' lock. A call in the child waited forever on a copy
no thread runs. So a runtime runs only in the process that made it: `Runtime.lock`, which
every graph call, eager fetch, compile and release takes, compares the pid (a syscall
per graph call) and raises in any other. `device_slots` gives a forked child its
own slots, so a model loaded or compiled in the child runs there.

[Note: a graph compiled for another model of the class]
Dynamo reuses one graph for every model of a class whose calls pass its guards, and the
guards see a parameter's shape, not its storage. A model built in memory and one from
``dlo_fx.load`` differ in what is stored: the built one's small parameters stay resident
and its graph reads them itself; the loaded one's are `StoredWeight`s and its graph reads
them through ``resident`` ops; a released model stores nothing until its next call. So
each read adapts to the runtime the call is bound to: `direct_reads` gives a graph the
resident device copy of each `StoredWeight` it reads itself (a graph without a schedule
too: `backend.unscheduled_call`), and `resident_tensor` reads a parameter this runtime
does not store as it is.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from typing import Callable, Iterable, Optional, Sequence

import torch

from ..config import DLOConfig, same_device
from torch.utils.weak import WeakIdKeyDictionary

from .agreement import agree_on_settings
from .collectives import ShardGroup, gather_in_place, resolve_shard_group
from . import platform
from .device_slots import SlotBlocks, device_slots
from .file_store import FileStore
from .host_store import HostStore
from .fingerprint import block_fingerprint, check_same_weights
from .graph_call import EAGER, HOST_READ, ClockMismatch, check_rows, exchange, note_fetch
from .interrupts import deferred, install as install_interrupt_handler
from .layout import Entry, leaf_entries
from .stored import is_stored
from .trace import Tracer

log = logging.getLogger(__name__)

_EAGER_WORD = int.from_bytes(b"dlo-eager", "little") & (2**62 - 1)


class Runtime:
    def __init__(self, config: DLOConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        # See [Note: what a model owns and what a device shares].
        self.shared = device_slots(device, config.num_slots, config.fault_delay_s)
        self.pid = os.getpid()  # see [Note: a forked process]
        agree_on_settings(config, device)  # before the group these settings pick is made
        self.group: ShardGroup = self.shared.shard_group(config.shard_group,
                                                         config.collective_timeout_s,
                                                         resolve_shard_group)
        self.mode: Optional[str] = None  # decided before the first block is stored
        self.mode_reason = ""
        self.store = HostStore(alignment=config.alignment)  # replaced by `set_mode`
        if self.group.dp == 1:
            self.set_mode("rank_local", "one rank in the shard group: nothing to gather")
        elif config.mode in (None, "allgather", "rank_local"):
            self.set_mode(config.mode or "allgather", f"mode={config.mode!r} option")
        self.slots = self.shared.pool
        self.executor = self.shared.executor
        self._token = next(_TOKENS)
        _LIVE.add(self)
        self.closed = False
        self._host_cache: Optional[tuple[int, torch.Tensor]] = None  # last gathered block
        self._pending: list = self.shared.pending  # shared with the models on the slots
        self._gathered: list[bool] = [True] * config.num_slots
        # id(parameter) -> (its entry, its resident copy); the entry tells a dead
        # parameter's copy from a new one's of the same id (host_store.py)
        self._resident: dict[int, tuple[Entry, torch.Tensor]] = {}
        self._pruned_at = 0  # store.forgotten when _resident was last pruned
        self._resident_flat: Optional[tuple[int, torch.Tensor]] = None  # last block copied
        self._eager_flat: Optional[tuple[int, torch.Tensor]] = None  # last eager read's block
        self.budget_plans: dict[tuple[str, ...], object] = {}  # per graph: dlo_fx.planning.budget
        self.probed_bandwidths: Optional[tuple[float, float]] = None  # (H2D, gather) GB/s
        self.probed_flops: dict[torch.dtype, float] = {}  # matmul FLOP/s per dtype
        # Parameters a committed graph reads straight from the module (resident, not in
        # the host store): no later graph may stream (and so store) them.
        # By id: a WeakSet would compare tensors with ``==``.
        self.read_directly: "weakref.WeakValueDictionary[int, torch.Tensor]" = \
            weakref.WeakValueDictionary()
        # Parameters named in ``dlo_fx.load(..., resident=)``: resident in every graph too
        # (code Dynamo runs eagerly reads them, as does a model whose blocks alone are
        # compiled).
        self.named_resident: "weakref.WeakValueDictionary[int, torch.Tensor]" = \
            weakref.WeakValueDictionary()
        # The modules the model's graphs compiled, and whether their parameters no graph
        # reached were counted (backend.warn_unreached)
        self.watched: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self.reach_checked = False
        self.copies = 0  # number of block copies issued (for tests and reports)
        self.broken: Optional[str] = None  # set when a copy or gather failed
        self.tracer: Optional[Tracer] = Tracer() if config.trace else None
        self._ready_ns: list[int] = [0] * config.num_slots  # when each slot's wait returned
        install_interrupt_handler()

    @property
    def lock(self) -> threading.RLock:
        """Held around every graph call on these slots (the slot state machine and the
        collective order; see [Note: one call at a time] in graph_call.py), eager fetch,
        compile commit and release. Raises in a forked process (`check_process`)."""
        self.check_process()
        return self.shared.lock

    def check_process(self) -> None:
        """Raise unless this is the process that made the runtime ([Note: a forked process])."""
        if self.pid != os.getpid():
            raise RuntimeError(
                f"dlo: this model's weights are stored by process {self.pid}, and this process "
                f"({os.getpid()}) was forked from it (os.fork, or multiprocessing's 'fork' "
                "start method): the copy thread, device streams and process group that run "
                "them stay in that process. Load or compile the model in the process that "
                "calls it; multiprocessing's 'spawn' or 'forkserver' start method starts a "
                "fresh one")

    # -- the mode and the store it implies ---------------------------------------------
    def set_mode(self, mode: str, reason: str) -> None:
        """Settle the mode (and so the store's shard geometry): before any block is stored.
        ``mode="auto"`` is decided by the caller (`passes.choose_mode`, the loader)."""
        if mode not in ("allgather", "rank_local"):
            raise ValueError(f"dlo: mode {mode!r} is not 'allgather' or 'rank_local'")
        if self.store.blocks:
            raise RuntimeError(f"dlo: the mode is {self.mode!r} and blocks are stored; it "
                               f"cannot become {mode!r}")
        sharded = mode == "allgather"
        self.mode, self.mode_reason = mode, reason
        pin = self.config.pin_memory and platform.can_pin(self.device)
        rank = self.group.rank if sharded else 0
        files = (FileStore(device=self.device, num_slots=self.config.num_slots, rank=rank, pin=pin,
                           file_reads=self.config.file_reads)
                 if self.config.host_store == "mmap" else None)
        self.store = HostStore(alignment=self.config.alignment, pin=pin, rank=rank,
                               dp=self.group.dp if sharded else 1, files=files)
        log.info("dlo: %s mode over the %s (%s)", mode, self.group.describe(), reason)

    @property
    def slot_block(self) -> SlotBlocks:
        """Host block of this runtime each slot holds (``None``: nothing of this
        runtime's, or another runtime's block since)."""
        return SlotBlocks(self.shared, self._token)

    @slot_block.setter
    def slot_block(self, value: Sequence[Optional[int]]) -> None:
        if any(v is not None for v in value):
            raise ValueError("slot_block can only be reset to None")
        self.shared.forget()  # buffers replaced, or a failed copy: trust no slot

    # -- registration (compile time, or first call of a reused graph) --------------------
    def register_block(self, params: Sequence[torch.nn.Parameter], fqns: Sequence[str],
                       sources: Optional[Sequence[torch.Tensor]] = None,
                       extents: Optional[Sequence] = None, defer: bool = False) -> int:
        """Store ``params`` as a new host block (this rank's shard of it); they become
        `StoredWeight`s (with ``defer``, at the next graph call: `HostStore.convert_pending`).
        ``sources`` are flat uint8 images of each parameter's storage span; by default the
        parameters' own bytes are read. ``extents``: where they are in files (the loader's
        blocks, `HostStore.add_block`)."""
        if self.mode is None:
            raise RuntimeError("dlo: internal error: a block is stored before the mode is "
                               "decided (passes.choose_mode or the loader decides it)")
        if self.closed:
            raise RuntimeError("dlo: this runtime was released; compile the model again")
        block = self.store.add_block(params, fqns, sources, extents, defer)
        claim(params, self)
        self.fit_slots(block.slot_bytes)
        return block.index

    def fit_slots(self, nbytes: int) -> None:
        """Grow the slots to hold a block of ``nbytes`` (compile or load time only).

        Under the device lock: the slots are shared with the other models on the device,
        and `dlo_fx.load` stores its blocks without holding it. A load on one thread
        replaced the buffers while another thread's graph ran between the wait for a slot
        and its views of it, which then read the new, unwritten buffer: a wrong output
        with no error."""
        if nbytes <= self.slots.slot_bytes:
            return
        with self.lock:
            if nbytes > self.slots.slot_bytes:  # another thread may have grown them
                self.drain()
                self.executor.sync()  # no copy or gather may still touch the old slots
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
            new_params, new_fqns = [p for p, _ in fresh], [f for _, f in fresh]
            if self.mode == "allgather":
                layout, _ = self.store.layout(new_params, new_fqns)
                fingerprint = block_fingerprint(leaf_entries(layout),
                                                self.store.sources(new_params, layout))
                check_same_weights(self, [fingerprint], new_fqns[:1],
                                   f"the layer of {new_fqns[0]!r}")
            return self.register_block(new_params, new_fqns)
        first = entries[0].block
        if all(e.block == first for e in entries):
            return first
        counts: dict[int, int] = {}
        for e in entries:
            counts[e.block] = counts.get(e.block, 0) + e.nbytes
        return max(counts, key=counts.__getitem__)

    def resident_tensor(self, param: torch.Tensor, clock: bool = False) -> torch.Tensor:
        """A device copy of a stored parameter that a graph keeps resident; a
        parameter this runtime does not store is read as it is (see [Note: a graph
        compiled for another model of the class]). ``clock``: as `fetch_block`'s."""
        entry = self.store.entry(param)
        kept = self._resident.get(id(param))
        if kept is not None and kept[0] is entry:
            tensor = kept[1]
        else:  # never copied, or copied for a dead parameter of the same id
            if entry is None:
                return read_unstored(param, self.device)
            cached = self._resident_flat
            if cached is None or cached[0] != entry.block:
                # The parameters of a block kept resident (device_budget) are asked for one
                # after another: the block is copied (and gathered) once for all of them.
                self._resident_flat = None
                what = f"host block {entry.block} (resident copy of {entry.fqn!r})"
                cached = self._resident_flat = (
                    entry.block, self.fetch_block(entry.block, what, clock, record=False))
            flat = cached[1]
            # A leaf with the parameter's requires_grad: see [Note: slot views keep requires_grad]
            tensor = entry.value_of(flat).clone().requires_grad_(param.requires_grad)
            self._resident[id(param)] = (entry, tensor)
        return tensor

    def direct_reads(self, args: Sequence, positions: Sequence[int],
                     clock: bool = False) -> Sequence:
        """``args`` with each parameter at ``positions`` (the placeholders a graph reads
        itself, not through a schedule op) that is a `StoredWeight` replaced by its
        resident device copy. See [Note: a graph compiled for another model of the class]."""
        out = None
        for i in positions:
            p = args[i]
            if is_stored(p):
                if out is None:
                    out = list(args)
                out[i] = self.resident_tensor(p, clock)  # raises where not stored here
        return args if out is None else out

    def fetch_block(self, block: int, what: str, clock: bool = False,
                    record: bool = True, kind: int = EAGER) -> torch.Tensor:
        """The whole of host block ``block`` in a fresh device buffer (gathered in
        allgather mode). Through the executor, behind every gather already queued:
        collectives keep one issue order on every rank. With ``clock``, the ranks first
        exchange clock words in the same task (see [Note: the collective clock]; ``kind``
        is their last word), and a forward being recorded notes the fetch unless
        ``record`` is false (a resident copy, made once: a replay must not gather it
        again; a read outside any forward)."""
        host = self.store.blocks[block]
        with torch.inference_mode(False):  # written by the worker thread
            flat = torch.empty(host.slot_bytes, dtype=torch.uint8, device=self.device)
        group, device = self.group, self.device
        if clock and record:
            note_fetch(self, block, what)  # for gather-only forwards (graph_call.py)

        def fill_and_gather() -> None:
            if self.store.dp > 1:
                if clock:
                    words = [_EAGER_WORD, block, len(host.entries), kind]
                    check_rows(group, exchange(group, device, words, what), what)
            self._fill_task(flat, block)()
            if self.store.dp > 1:
                gather_in_place(flat, host.spec.shard_bytes, group, what)

        with deferred():
            handle = self.executor.gather(-1, fill_and_gather, None)
        try:
            self.executor.wait(handle)
        except ClockMismatch:
            raise
        except BaseException as exc:
            if self.executor.failed(handle):
                self.broken = f"{type(exc).__name__}: {exc}"
            raise
        return flat

    def eager_block(self, block: int, fqn: str) -> torch.Tensor:
        """The whole of host block ``block`` on the device, for a read of a stored weight
        outside a graph (`runtime/stored.py`; ``fqn`` names the weight read). Clocked and
        gathered in allgather mode like any eager fetch; in rank-local mode the last block
        read is kept until the next graph call (no collective makes the ranks agree on
        what a cache holds, so with several ranks gathering none is kept)."""
        with self.lock:
            self.check_open()
            cached = self._eager_flat
            if cached is not None and cached[0] == block:
                return cached[1]
            flat = self.fetch_block(block, f"host block {block} (an eager read of {fqn!r})",
                                    clock=True)
            if self.store.dp == 1:
                self._eager_flat = (block, flat)
            return flat

    def drop_block_copy(self) -> None:
        """Free the block copies resident parameters and eager reads were cut from (after
        each call), and the resident copies of parameters that died since the last call."""
        self._resident_flat = None
        self._eager_flat = None
        if self._pruned_at != self.store.forgotten:
            self._pruned_at = self.store.forgotten
            self._resident = {k: v for k, v in self._resident.items()
                              if self.store.entry_by_id(k) is v[0]}

    @property
    def resident_copy_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for _, t in self._resident.values())

    # -- the schedule -------------------------------------------------------------------
    def _fill_task(self, flat: torch.Tensor, block: int) -> Callable[[], None]:
        """The copy of this rank's host shard of ``block`` to its place in ``flat``. It holds
        the host block and the slot slice, never the runtime: a wrap-around prefetch still
        queued when the model is dropped must not keep its whole host store alive."""
        host = self.store.blocks[block]
        start = host.spec.rank_range(self.store.rank)[0] if self.store.dp > 1 else 0
        dst = flat[start : start + host.shard_nbytes]
        return lambda: host.copy_to(dst)

    def prefetch(self, block: int, slot: int) -> None:
        """H2D of this rank's shard of ``block`` into its slice of ``slot``."""
        with deferred():  # see [Note: interrupts and slot state]
            if self.slot_block[slot] == block:
                return  # already there, or on its way (the wrap-around prefetch)
            self.slot_block[slot] = None  # unknown until the copy is issued and recorded
            flat = self.slots.buffers[slot]
            task = self._fill_task(flat, block)
            if self.tracer is not None:
                task = self.tracer.timed("prefetch", block, slot, task)
            # Behind the slot's last task, which nobody may have waited on (see the Note).
            handle = self.executor.copy(slot, task, self.store.blocks[block].shard_nbytes,
                                        self._pending[slot])
            self._pending[slot] = handle
            self._gathered[slot] = self.mode != "allgather"
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
            group = self.group  # the task holds no runtime (see `_fill_task`)
            task = lambda: gather_in_place(flat, spec.shard_bytes, group, what)  # noqa: E731
            if self.tracer is not None:
                task = self.tracer.timed("allgather", block, slot, task)
            self._pending[slot] = self.executor.gather(slot, task, self._pending[slot])
            self._gathered[slot] = True

    def check_open(self) -> None:
        """Raise when the runtime cannot run a graph. Called under `lock`, which has
        checked the process."""
        if self.broken is not None:
            raise RuntimeError(f"dlo: this runtime failed earlier and is closed ({self.broken}); "
                               "start a fresh process group and recompile")
        if self.closed:  # a graph bound it before another thread's dlo_fx.release took the lock
            raise RuntimeError("dlo: this model's weights were released (dlo_fx.release) on "
                               "another thread while this call started; call it again")

    def wait(self, block: int, slot: int) -> None:
        """Block until ``slot`` holds ``block``, complete. Ctrl-C interrupts the wait and
        leaves the copy pending: the next wait on the slot waits for it again."""
        self.check_open()
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
                    self.broken = f"{type(exc).__name__}: {exc}"
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
        (see [Note: a storage dtype] in layout.py)."""
        entry = self.store.entry(param)
        if entry.block != block:  # held by another host block: see `resolve`
            return self.resident_tensor(param)
        view = self.slots.view(slot, entry, param.requires_grad)
        if entry.compute_dtype is not None and cast is None:
            # a graph scheduled for a model of the class stored in its own dtype
            return view.to(entry.compute_dtype)
        return view

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


    # -- the weights outside the graph ----------------------------------------------------
    def host_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """A new host (CPU) tensor with the stored weights of ``param``. In allgather mode
        this gathers the block from every rank: every rank of the shard group must ask
        for the same parameters in the same order (``state_dict``, `release` do). The
        ranks exchange clock words first: a rank that asks alone (``state_dict()`` on rank
        0 only) or for another block raises `ClockMismatch` on every rank instead of
        pairing its gather with another collective (gloo aborted the processes) or with
        another block (the state dict would have held another block's bytes)."""
        entry = self.store.entry(param)
        if entry is None:
            raise ValueError(f"dlo: a parameter of shape {tuple(param.shape)} is not in this "
                             "model's host store")
        block = self.store.blocks[entry.block]
        if self.store.dp == 1:
            if block.source is None:
                return entry.value_of(block.shard).clone()
            with torch.inference_mode(False):
                flat = torch.empty(block.shard_nbytes, dtype=torch.uint8)
            block.copy_to(flat)  # host_store="mmap": read from the file
            return entry.value_of(flat).clone()
        cached = self._host_cache
        if cached is None or cached[0] != entry.block:
            what = (f"host block {entry.block} (weights of {entry.fqn!r} read outside the graph; "
                    "state_dict() and release() gather them from every rank, so every rank "
                    "calls them together)")
            flat = self.fetch_block(entry.block, what, clock=True, record=False, kind=HOST_READ)
            cached = self._host_cache = (entry.block, flat.cpu())
        return entry.value_of(cached[1]).clone()

    def close(self) -> None:
        """Free the host store and resident copies, forget the slots this runtime filled
        and let go of its parameters. The runtime cannot run anything afterwards."""
        if self.closed:
            return
        self.closed = True
        if self.pid == os.getpid():  # a forked child: the parent's copies never finish here
            self.drain(raise_errors=False)
        for slot in range(len(self.slot_block)):
            if self.slot_block[slot] is not None:
                self.slot_block[slot] = None
        unclaim(self)
        if self.store.files is not None:
            self.store.files.close()
        self.store = HostStore(alignment=self.config.alignment)
        self._resident.clear()
        self._resident_flat = None
        self._eager_flat = None
        self._host_cache = None


# -- who owns which parameters ----------------------------------------------------------
# [Note: the model owns its runtime]
# A runtime is found from the parameters it stores: `_OWNERS` maps each parameter (by
# identity, weakly) to its runtime, and that entry is the only lasting strong reference
# to the runtime (graphs hold theirs weakly between calls, the store keeps parameter ids
# only). So the runtime, its host store and, with the last runtime on the device, the
# slots and the executor's thread go when the model's parameters are collected, and
# `torch._dynamo.reset()` has nothing to free. Options are the runtime's: a model loaded
# with options compiles with none and inherits them; a compile whose options differ is
# refused before anything changes (`DLOConfig.differing`).
_OWNERS = WeakIdKeyDictionary()
_LIVE: "weakref.WeakSet[Runtime]" = weakref.WeakSet()
_TOKENS = itertools.count()
_LOCK = threading.Lock()


def read_unstored(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``param``, which no runtime the graph runs with stores, as the graph may read it:
    ValueError where it has no storage or lives on another device than ``device``."""
    what = f"a parameter of shape {tuple(param.shape)} ({param.dtype})"
    if is_stored(param):
        raise ValueError(
            f"dlo: {what} that this graph reads is stored by dlo but not in the host store "
            "of the model the graph is called with (a graph that mixes the parameters of "
            "models stored by dlo separately, or a model whose weights were dropped); "
            "compile each model on its own")
    if not same_device(param.device, device):
        raise ValueError(
            f"dlo: {what} that this graph keeps resident is on {param.device} but dlo "
            f"computes on {device}; load the model with dlo_fx.load(...) so resident "
            "parameters are placed on the device")
    return param


def owner_of(params: Iterable[torch.Tensor]) -> Optional[Runtime]:
    """The runtime that stores (or has claimed) the first of ``params`` any runtime holds."""
    for p in params:
        runtime = _OWNERS.get(p)
        if runtime is not None:
            return runtime
    return None


def claim(params: Iterable[torch.Tensor], runtime: Runtime) -> None:
    """Make ``runtime`` the owner of ``params`` (those it stores, or will: a model's
    parameters are claimed as a whole when its first graph is compiled)."""
    with _LOCK:
        for p in params:
            if _OWNERS.get(p) is None:
                _OWNERS[p] = runtime


def unclaim(runtime: Runtime) -> None:
    with _LOCK:
        for p in [p for p, rt in _OWNERS.items() if rt is runtime]:
            del _OWNERS[p]


def owned_by(runtimes: Sequence[Runtime]) -> list[torch.Tensor]:
    """Every parameter ``runtimes`` own: one model's, or several models' sharing
    parameters (they share a runtime)."""
    with _LOCK:
        return [p for p, rt in _OWNERS.items() if any(rt is r for r in runtimes)]


def runtimes_holding(params: Sequence[torch.Tensor]) -> list[Runtime]:
    """The runtimes that own any of ``params`` (one per model, usually)."""
    found: list[Runtime] = []
    for p in params:
        runtime = _OWNERS.get(p)
        if runtime is not None and all(runtime is not r for r in found):
            found.append(runtime)
    return found


def live_runtimes() -> list[Runtime]:
    """Every runtime neither closed nor collected (tests and memory checks)."""
    with _LOCK:
        return [rt for rt in _LIVE if not rt.closed]


def reset_runtimes() -> None:
    """Close every live runtime (tests: no host store outlives its test). The models they
    stored keep no weights and are unusable."""
    for rt in live_runtimes():
        rt.close()

"""`WeightReads`: reads of stored weights outside the slot schedule, one part of a
`Runtime` (runtime.py): the resident copies a graph reads itself, a whole block fetched
for an eager read, and the weights gathered to the host (``state_dict()``, `release`).

[Note: a graph compiled for another model of the class]
A graph reads each weight the way the runtime it is bound to for this call stores it.
Dynamo reuses one graph for every model of a class whose calls pass its guards, and the
guards see a parameter's shape, not its storage. A model built in memory and one from
``dlo_fx.load`` differ in what is stored: the built one's small parameters stay resident
and its graph reads them itself; the loaded one's are `StoredWeight`s and its graph reads
them through ``resident`` ops; a released model stores nothing until its next call. So
each read adapts to the bound runtime: `direct_reads` gives a graph the resident device
copy of each `StoredWeight` it reads itself (a graph without a schedule too:
`backend.unscheduled_call`), and `resident_tensor` reads a parameter this runtime does not
store as it is.

[Note: a block copy that does not fit on one rank]
With several ranks gathering, a block's device copy outside the schedule (a resident copy,
an eager read) is allocated before its gather, and the allocation may fail on one rank
only (the device budget's resident blocks, activations of different sizes). A rank that
raised there would leave its peers waiting in the gather until the collective timeout
closes the runtime. So the ranks first exchange clock words saying whether each one
allocated (`fetch_block`, in the gather's own worker task), and where one did not, none
gathers and every rank raises ``torch.OutOfMemoryError`` naming the ranks short of memory:
they stay in step, the failed graph completes its schedule on every rank alike, and the
next call is exact. A failure after the gather (cutting a parameter's copy out of the
block) is the rank's alone, and so is a graph that completes its schedule without
computing (`fetch_resident`): the rank keeps the block's copy (`_keep_block`) and cuts the
parameter's copy from it later, where its peers read theirs, so it never gathers alone.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from ...config import same_device
from ..ranks.collectives import ShardGroup, gather_in_place, shard_read
from ..device.executor import Executor
from ..ranks.clock import COPY, EAGER, HOST_READ, ClockMismatch, check_rows, exchange
from ..ranks.forward_log import note_step
from ..host.host_store import HostStore
from ..interrupts import deferred
from ..host.layout import Entry
from ..lifecycle import Lifecycle
from .stored import is_stored

_EAGER_WORD = int.from_bytes(b"dlo-eager", "little") & (2**62 - 1)
_COPY_WORD = int.from_bytes(b"dlo-copy", "little") & (2**62 - 1)


class WeightReads:
    """The stored weights read outside the schedule, and the copies kept for them: of the
    blocks of ``store`` (this rank's shards, gathered over ``group`` where the store is
    sharded), made on ``device`` through ``executor`` (behind every queued gather). A
    failed gather fails ``life``."""

    def __init__(self, store: HostStore, device: torch.device, group: ShardGroup,
                 executor: Executor, life: Lifecycle) -> None:
        self.store = store
        self.device = device
        self.group = group
        self.executor = executor
        self.life = life
        self._host_cache: Optional[tuple[int, torch.Tensor]] = None  # last gathered block
        # id(parameter) -> (its entry, its resident copy); the entry tells a dead
        # parameter's copy from a new one's of the same id (host/host_store.py)
        self._resident: dict[int, tuple[Entry, torch.Tensor]] = {}
        self._pruned_at = 0  # store.forgotten when _resident was last pruned
        self._resident_flat: Optional[tuple[int, torch.Tensor]] = None  # last block copied
        self._eager_flat: Optional[tuple[int, torch.Tensor]] = None  # last eager read's block
        # host block -> (its HostBlock, its device copy): see `_keep_block`
        self._kept_blocks: dict[int, tuple[object, torch.Tensor]] = {}

    def resident_tensor(self, param: torch.Tensor, clock: bool = False) -> torch.Tensor:
        """A device copy of a stored parameter that a graph keeps resident; a
        parameter this runtime does not store is read as it is (see [Note: a graph
        compiled for another model of the class]). ``clock``: as `fetch_block`'s."""
        entry = self.store.entry(param)
        kept = self._resident.get(id(param))
        if kept is not None and kept[0] is entry:
            return kept[1]
        # never copied, or copied for a dead parameter of the same id
        if entry is None:
            return read_unstored(param, self.device)
        flat = self._resident_block(entry, clock)
        try:
            # A leaf with the parameter's requires_grad: see [Note: slot views keep requires_grad]
            tensor = entry.value_of(flat).clone().requires_grad_(param.requires_grad)
        except torch.OutOfMemoryError:
            self._keep_block(entry.block, flat)
            raise
        self._resident[id(param)] = (entry, tensor)
        return tensor

    def fetch_resident(self, param: torch.Tensor) -> None:
        """The collectives of `resident_tensor` without its copy, for a graph completing
        its schedule after a failure: the block is fetched where the peers fetch it, and
        kept, so the parameter's copy is cut from it later without gathering alone (see
        [Note: a block copy that does not fit on one rank])."""
        if self.store.dp == 1:
            return  # no collective to keep in step
        entry = self.store.entry(param)
        kept = self._resident.get(id(param))
        if entry is None or (kept is not None and kept[0] is entry):
            return
        self._keep_block(entry.block, self._resident_block(entry, False))

    def _resident_block(self, entry: Entry, clock: bool) -> torch.Tensor:
        """The device copy of ``entry``'s block that resident copies are cut from: the
        parameters of a block kept resident (device_budget) are asked for one after
        another, and the block is copied (and gathered) once for all of them."""
        kept = self._kept_blocks.get(entry.block)
        if kept is not None and kept[0] is self.store.blocks[entry.block]:
            return kept[1]
        cached = self._resident_flat
        if cached is None or cached[0] != entry.block:
            self._resident_flat = None
            what = f"host block {entry.block} (resident copy of {entry.fqn!r})"
            cached = self._resident_flat = (
                entry.block, self.fetch_block(entry.block, what, clock, record=False))
        return cached[1]

    def _keep_block(self, block: int, flat: torch.Tensor) -> None:
        """Keep ``block``'s device copy past the call where this rank could not cut every
        copy from it that its peers did, so this rank never gathers it alone later."""
        if self.store.dp > 1:
            self._kept_blocks[block] = (self.store.blocks[block], flat)

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
        exchange clock words in the same task (``kind`` is their last word; see
        [Note: the collective clock of a shard group] in ranks/clock.py), and a forward being recorded notes the fetch unless
        ``record`` is false (a resident copy, made once: a replay must not gather it
        again; a read outside any forward)."""
        host = self.store.blocks[block]
        group, device, store = self.group, self.device, self.store
        sharded = store.dp > 1
        failure: Optional[BaseException] = None
        try:
            with torch.inference_mode(False):  # written by the worker thread
                flat = torch.empty(host.slot_bytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as exc:
            if not sharded:
                raise
            flat, failure = None, exc  # the peers learn it before anyone gathers
        if clock and record:
            # for gather-only forwards (see [Note: gather-only forwards] in ranks/forward_log.py)
            note_step(functools.partial(self._fetch_gather_only, block, what))
        short: list[int] = []

        def fill_and_gather() -> None:
            if sharded:  # see [Note: a block copy that does not fit on one rank]
                words = [_EAGER_WORD if clock else _COPY_WORD, block, int(flat is not None),
                         kind if clock else COPY]
                rows = exchange(group, device, words, what)
                check_rows(group, rows, what, free=2)
                short.extend(group.ranks[i] for i, row in enumerate(rows) if not row[2])
                if short:
                    return
            shard_read(store, group, flat, block)()  # see collectives.py
            if sharded:
                gather_in_place(flat, host.spec.shard_bytes, group, what)

        with deferred():
            handle = self.executor.gather(-1, fill_and_gather, None)
        try:
            self.executor.wait(handle)
        except ClockMismatch:
            raise
        except BaseException as exc:
            if self.executor.failed(handle):
                self.life.fail(exc)
            raise
        if short:
            mine = f" ({str(failure).strip().splitlines()[0]})" if failure is not None else ""
            raise torch.OutOfMemoryError(
                f"dlo: {what}: the device copy of host block {block} ({host.slot_bytes:,} B) "
                f"does not fit on global rank(s) {short}{mine}; no rank gathered it, so the "
                f"ranks of the {group.describe()} stay in step")
        return flat

    def _fetch_gather_only(self, block: int, what: str) -> None:
        """A noted eager fetch issued again, its bytes dropped (nothing with one rank)."""
        if self.store.dp > 1:
            self.fetch_block(block, what, clock=True)

    def eager_block(self, block: int, fqn: str) -> torch.Tensor:
        """The whole of host block ``block`` on the device, for a read of a stored weight
        outside a graph (`runtime/weights/stored.py`; ``fqn`` names the weight read). Clocked and
        gathered in allgather mode like any eager fetch; in rank-local mode the last block
        read is kept until the next graph call (no collective makes the ranks agree on
        what a cache holds, so with several ranks gathering none is kept)."""
        life = self.life
        with life.lock:
            life.check_open()
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

    def drop_resident(self, params: Sequence[torch.Tensor]) -> int:
        """Free the resident device copies of ``params`` (blocks the auto device budget
        moved back to streaming); returns the bytes freed. A later read makes them again."""
        freed = 0
        for p in params:
            kept = self._resident.pop(id(p), None)
            if kept is not None:
                freed += kept[1].untyped_storage().nbytes()
            entry = self.store.entry(p)
            kept = self._kept_blocks.pop(entry.block, None) if entry is not None else None
            if kept is not None:
                freed += kept[1].untyped_storage().nbytes()
        self._resident_flat = None
        return freed

    @property
    def resident_copy_bytes(self) -> int:
        return (sum(t.untyped_storage().nbytes() for _, t in self._resident.values())
                + sum(f.untyped_storage().nbytes() for _, f in self._kept_blocks.values()))

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

    def clear(self) -> None:
        """Forget every copy (the runtime is closed)."""
        self._resident.clear()
        self._kept_blocks.clear()
        self._resident_flat = None
        self._eager_flat = None
        self._host_cache = None


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

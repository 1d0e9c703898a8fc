"""`Runtime`: one model's host store, mode and configuration, the slots and executor it
shares with the other models on its device (`device/shared_slots.py`), and its lock. Its two
halves are mixed in: the slot state machine the schedule nodes drive (`SlotMachine`,
device/slot_machine.py) and the reads of stored weights outside the schedule (`WeightReads`,
weights/weight_reads.py). A runtime is found from the parameters it stores (`owners.owner_of`),
never from options; see [Note: the model owns its runtime] in weights/owners.py. Every block a
model stores comes in through `Runtime.store_blocks`.

[Note: storing blocks]
Every block enters the host store through one path (`Runtime.store_blocks`), whoever asks
(the loader, `dlo_fx.offload`, a compile meeting parameters the model gained after it was
stored), and it is all or nothing on every rank. Its steps,
in order: lay the parameters out, take the block's sampled fingerprint (of the parameters'
bytes, or of the checkpoint's where the loader reads files), add it to the host store
(which copies or reads this rank's shard), have the ranks agree on everything that shapes
their gathers and on the fingerprints (`agreement.agree`), and only then claim the
parameters for the runtime (`owners.claim`) and turn them into `StoredWeight`s. A failure
anywhere -- a truncated file, a failed pinning, the ranks disagreeing -- drops the blocks
this call added, claims nothing, and raises on every rank: storing comes before agreeing,
so a rank whose store failed joins the agreement with its error and its peers raise with it
instead of waiting out the timeout. A parameter that was real stays real, so a compile that
fails leaves the model as it was. With one rank, or in rank-local mode, nothing is
exchanged and no fingerprint is taken.

[Note: a forked process]
A runtime runs only in the process that made it. ``os.fork`` (multiprocessing's default
start method on Linux) copies a runtime into the child without what runs it: the
executor's worker thread, a copy the parent had in flight, the device streams and the
process group stay with the parent, and a thread of the parent may have held the slots'
lock, so a call in the child would wait forever on a copy no thread runs. `Runtime.lock`,
which every graph call, eager fetch, compile and release takes, compares the pid (a syscall
per graph call) and raises in any other process. `shared_slots` gives a forked child its
own slots, so a model loaded or compiled in the child runs there.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..config import DLOConfig, canonical_device
from .device import platform
from .ranks.agreement import (Fact, agree, agree_on_settings, layout_digest, runtime_facts,
                              weights_fact)
from .ranks.collectives import ShardGroup, resolve_shard_group
from .device.shared_slots import shared_slots
from .device.executor import FaultDelay
from .host.fingerprint import block_fingerprint
from .host.file_store import FileStore
from .host.host_store import HostStore
from .interrupts import install as install_interrupt_handler
from .host.layout import Entry, ShardSpec, leaf_entries
from .weights.owners import claim, register, unclaim
from .device.slot_machine import SlotMachine
from .graph.trace import Tracer
from .view import KEPT_RESIDENT, NAMED_RESIDENT, READ_DIRECTLY  # noqa: F401 (re-exported)
from .weights.weight_reads import WeightReads

log = logging.getLogger(__name__)

#: Why a parameter is in `Runtime.kept_resident`: `KEPT_RESIDENT` (view.py).

_TOKENS = itertools.count()  # tells the runtimes sharing slots apart (`SlotBlocks`)


@dataclass(frozen=True)
class NewBlock:
    """A block to store. By default its bytes are the parameters' own. The loader gives
    ``extents`` (where the block's bytes are in files, from its layout) and ``fingerprint``
    (of those bytes, or the one a `dlo-fx shard` run recorded)."""

    params: Sequence[torch.nn.Parameter]
    fqns: Sequence[str]
    extents: Optional[Callable[[list[Entry], ShardSpec], Sequence]] = None
    fingerprint: Optional[Callable[[list[Entry], Optional[Sequence]], int]] = None


class Runtime(SlotMachine, WeightReads):
    def __init__(self, config: DLOConfig, device: torch.device) -> None:
        self.config = config
        self.device = device = canonical_device(device)  # see `config.canonical_device`
        self.fault_delay = FaultDelay(device, config.fault_delay_s)  # a test option
        # See [Note: what a model owns and what a device shares].
        self.shared = shared_slots(device, config.num_slots)
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
        register(self)
        self.closed = False
        self.broken: Optional[str] = None  # set when a copy or gather failed
        self.tracer: Optional[Tracer] = Tracer() if config.trace else None
        self._init_slot_state(config.num_slots)
        self._init_reads()
        self.budget_plans: dict[tuple[str, ...], object] = {}  # per graph: dlo_fx.planning.budget
        self.probed_bandwidths: Optional[tuple[float, float]] = None  # (H2D, gather) GB/s
        self.probed_flops: dict[torch.dtype, float] = {}  # matmul FLOP/s per dtype
        # device_budget="auto" (dlo_fx.dynamo.auto_budget), per graph's parameters (the key
        # of budget_plans): the memory record (capacity, peaks per shape, OOM floor) and the
        # blocks resident now (their positions; their bytes are on the device's
        # SharedSlots, beside other models')
        self.device_memory: dict[tuple[str, ...], object] = {}
        self.auto_resident: dict[tuple[str, ...], frozenset] = {}  # bytes: shared.auto_resident
        # The auto budget with several ranks gathering: one budget agreed at the first
        # compile (dlo_fx.dynamo.probes.probe_runtime), kept for every later one
        self.agreed_auto_budget: Optional[int] = None
        # Where the device has no allocator statistics (the CPU, the meta device): the
        # activation peak of a call, from the shapes of its tensor inputs, for tests and
        # planning with a declared device_memory. None: 0 (nothing measured on the device)
        self.activation_peak_of: Optional[Callable[[tuple], int]] = None
        # Parameters resident in every later graph, and why (`KEPT_RESIDENT`): one a
        # committed graph reads straight from the module, not from the host store (no later
        # graph may stream, and so store, it), or one named in ``dlo_fx.load(...,
        # resident=)`` (code Dynamo runs eagerly reads it, as does a model whose blocks alone
        # are compiled). Keyed by identity, weakly: the model owns its parameters.
        self.kept_resident: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
        # Where `dlo_fx.offload` found the model's parameters, and how to put back what it
        # moved to the compute device: `dlo_fx.release` returns the weights there.
        self.home: Optional[torch.device] = None
        # The model the backend offloaded at its first graph (dynamo/first_trace.py),
        # weakly, until a graph of it compiles: a failed compile gives its weights back
        self.offloaded_by_trace: Optional[weakref.ReferenceType] = None
        # Why each host block the loader or `offload` planned ends where it does (the
        # blocks.md dump's "ends because"), by host block index
        self.block_ends: dict[int, str] = {}
        self.undo_moves: list[Callable[[], None]] = []
        install_interrupt_handler()

    @property
    def token(self) -> int:
        """Tells this runtime apart from the others sharing its slots."""
        return self._token

    @property
    def lock(self) -> threading.RLock:
        """Held around every graph call on these slots (the slot state machine and the
        collective order; see [Note: one call at a time] in graph/graph_call.py), eager fetch,
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

    def check_open(self) -> None:
        """Raise when the runtime cannot run a graph. Called under `lock`, which has
        checked the process."""
        if self.broken is not None:
            raise RuntimeError(f"dlo: this runtime failed earlier and is closed ({self.broken}); "
                               "start a fresh process group and recompile")
        if self.closed:  # a graph bound it before another thread's dlo_fx.release took the lock
            raise RuntimeError("dlo: this model's weights were released (dlo_fx.release) on "
                               "another thread while this call started; call it again")

    # -- the mode and the store it implies ---------------------------------------------
    def set_mode(self, mode: str, reason: str) -> None:
        """Settle the mode (and so the store's shard geometry): before any block is stored.
        ``mode="auto"`` is decided by the caller (`planning.modes.choose_mode`, called by the
        compile's probes and by the loader)."""
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
                               dp=self.group.dp if sharded else 1, files=files,
                               device=self.device)
        log.info("dlo: %s mode over the %s (%s)", mode, self.group.describe(), reason)

    # -- storing blocks (compile, load, first call of a reused graph) -----------------------
    def store_blocks(self, blocks: Iterable[NewBlock], facts: Sequence[Fact], what: str,
                     *, ahead: Optional[Sequence[NewBlock]] = None,
                     error_of: Callable[[BaseException], BaseException] = lambda e: e) -> list[int]:
        """Store ``blocks`` (see [Note: storing blocks]) and return their host block indices.

        ``facts``: what else the ranks must share (the compile's block plan, the loader's
        shard run), compared in the same exchange as the runtime's facts, the new blocks'
        layouts and fingerprints. Once they agree, the parameters become `StoredWeight`s
        ([Note: when a parameter becomes a StoredWeight]).
        ``blocks`` may be a generator: each is stored before the next is asked for (the
        loader reads block by block); ``ahead`` then announces them (their parameters
        and names), so that a pinned store sizes its slabs for all of them at once ([Note:
        pinned slabs] in host/host_slabs.py). ``error_of`` turns a failure into the error raised
        (the loader's, naming a file that changed)."""
        store = self.store
        first = len(store.blocks)
        check = self.mode == "allgather" and self.group.dp > 1
        indices: list[int] = []
        names: list[str] = []
        fingerprints: list[int] = []
        added: list[NewBlock] = []

        def all_facts() -> list[Fact]:
            layouts = [layout_digest(store.blocks[i].entries, store.blocks[i].spec.padded_bytes)
                       for i in indices]
            return [*runtime_facts(self), *facts,
                    Fact("layouts", layouts, "Every rank must store the same model with the same "
                         "options and dtype", blocks=list(names)),
                    weights_fact(fingerprints, names)]

        if ahead is None and isinstance(blocks, Sequence):
            ahead = blocks
        try:
            store.reserve([(b.params, b.fqns) for b in ahead or ()])
            for block in blocks:
                entries, spec = store.layout(block.params, block.fqns)
                extents = block.extents(entries, spec) if block.extents is not None else None
                if check:
                    fingerprints.append(
                        block.fingerprint(entries, extents) if block.fingerprint is not None
                        else block_fingerprint(leaf_entries(entries),
                                               store.sources(block.params, entries)))
                indices.append(self.register_block(block.params, block.fqns, extents=extents))
                names.append(block.fqns[0])
                added.append(block)
        except BaseException as exc:
            store.drop_blocks(first)
            indices.clear()  # a rank that failed tells its error, not its blocks
            names.clear()
            fingerprints.clear()
            failure = error_of(exc)
            if failure is not exc:
                failure.__suppress_context__ = True
            agree(self, all_facts(), what, failure)  # raises ``failure`` here, naming this rank elsewhere
            raise  # not reached
        try:
            agree(self, all_facts(), what)
        except BaseException:
            store.drop_blocks(first)
            raise
        params = [p for b in added for p in b.params]
        claim(params, self)  # only now: a failed store leaves no owner on any rank
        store.convert(params, self.device)
        return indices

    def register_block(self, params: Sequence[torch.nn.Parameter], fqns: Sequence[str],
                       extents: Optional[Sequence] = None) -> int:
        """Add ``params`` to the host store as a new block (this rank's shard of it); they
        stay as they are until `HostStore.convert`. Only `store_blocks`
        calls this: see [Note: storing blocks]. ``extents``: where the block's bytes are
        in files (the loader's blocks, `HostStore.add_block`)."""
        if self.mode is None:
            raise RuntimeError("dlo: internal error: a block is stored before the mode is "
                               "decided (planning.modes.choose_mode decides it, for the "
                               "compile and the loader alike)")
        if self.closed:
            raise RuntimeError("dlo: this runtime was released; compile the model again")
        block = self.store.add_block(params, fqns, extents=extents)
        self.fit_slots(block.slot_bytes)
        return block.index

    def resolve(self, params: Sequence[torch.nn.Parameter], fqns: Sequence[str]) -> int:
        """Host block a graph block is bound to for this call.

        Every parameter is stored already (a graph Dynamo reuses for the next layer passes
        that layer's parameters, stored when the model was): the host block holding most of
        ``params`` wins; a parameter held elsewhere (a table shared by every layer and
        passed in as an argument) is read from a resident copy by ``view``. Nothing is
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
        for key in [k for k in self.shared.auto_resident if k[0] == self._token]:
            del self.shared.auto_resident[key]  # its resident copies go with it
        if self.store.files is not None:
            self.store.files.close()
        self.store = HostStore(alignment=self.config.alignment)
        self._drop_reads()

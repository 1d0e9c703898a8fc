"""`Runtime`: one model's configuration and mode, and the parts it is made of, each
holding the others it uses by reference and each testable alone:

- ``store``, the host store (`HostStore`, host/host_store.py): one for the runtime's life,
  its shard geometry set by the mode (`set_mode`), emptied when the runtime is released;
- ``life``, its lifecycle (`Lifecycle`, lifecycle.py): the process that made it, the lock
  of the device's slots, and whether it failed or was released;
- ``group``, the shard group its gathers run over (ranks/collectives.py), and ``shared``,
  the slots and executor it shares with the other models on its device
  (`device/shared_slots.py`);
- ``reads``, the reads of stored weights outside the schedule (`WeightReads`,
  weights/weight_reads.py), over the store, group and executor;
- ``machine``, the slot state machine the schedule nodes drive (`SlotMachine`,
  slot_machine.py), over the store, slots and group, reading a parameter of
  another block through ``reads``.

A runtime is found from the parameters it stores (`owners.owner_of`), never from options;
see [Note: the model owns its runtime] in weights/owners.py. Every block a model stores
comes in through `Runtime.store_blocks`.

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

[Note: when a parameter becomes a StoredWeight]
A parameter handed to the store becomes a `StoredWeight` (weights/stored.py): the same
Python object, with its shape, strides, dtype and device and no storage, whose reads
outside a graph are served from the host store and whose writes are refused (see [Note: a
stored weight is a tensor] there). It becomes one once every rank has agreed to the block
that holds it (`store_blocks` calls `_become_stored` after the agreement), never later: the
model Dynamo traces, and every guard it builds, already has the `StoredWeight`s (see
[Note: a streamed model exists before Dynamo traces it] in loading/offload.py). A block
laid out and then refused (a rank failed) leaves its parameters as they were. A parameter
converted in place keeps the memory it had until then only as long as something else
holds it (its old tensor is let go).
"""

from __future__ import annotations

import itertools
import logging
import threading
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..config import DLOConfig
from ..planning.budget import BudgetPlan
from ..planning.device_memory import DeviceMemory
from .device import platform
from .ranks.agreement import (Fact, agree, agree_on_settings, layout_digest, runtime_facts,
                              weights_fact)
from .ranks.collectives import ShardGroup, weight_group
from .device.shared_slots import shared_slots
from .device.executor import FaultDelay, fault_delay_s
from .host.fingerprint import block_fingerprint
from .host.file_store import FileStore
from .host.host_store import HostStore
from .interrupts import install as install_interrupt_handler
from .host.layout import Entry, ShardSpec, leaf_entries
from .lifecycle import Lifecycle
from .weights.owners import claim, register, unclaim
from .weights.stored import become_stored, check_restorable, is_stored
from .slot_machine import SlotMachine
from .device.trace import Tracer
from ..planning.view import KEPT_RESIDENT, NAMED_RESIDENT, READ_DIRECTLY  # noqa: F401 (re-exported)
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


@dataclass(frozen=True)
class Attachment:
    """What the one attach sequence (loading/attach.py) recorded on the runtime it made,
    once: the facts `dlo_fx.release` and the dumps read back."""

    home: Optional[torch.device] = None
    """Where `dlo_fx.offload` found the model's parameters: `release` returns them there."""
    block_ends: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    """Why each host block the loader or `offload` planned ends where it does (the
    blocks.md dump's "ends because"), by host block index."""
    undo_moves: Optional[Callable[[], None]] = None
    """Puts back what `dlo_fx.offload` moved to the compute device (`release` calls it)."""


class Runtime:
    def __init__(self, config: DLOConfig, device: torch.device) -> None:
        self.config = config
        self.device = device  # canonical, as `loading.offload.compute_device` resolves it
        # See [Note: what a model owns and what a device shares].
        self.shared = shared_slots(device, config.num_slots)
        fault_delay = FaultDelay(fault_delay_s(), self.shared.executor)  # a test hook
        self.life = Lifecycle(self.shared.lock)  # see [Note: a forked process] in lifecycle.py
        agree_on_settings(config, device)  # before the group these settings pick is made
        self.group: ShardGroup = weight_group(self.shared.key, config.shard_group,
                                              config.collective_timeout_s)
        self.mode: Optional[str] = None  # decided before the first block is stored
        self.mode_reason = ""
        self.store = HostStore(alignment=config.alignment)  # sharded by `set_mode`
        if self.group.dp == 1:
            self.set_mode("rank_local", "one rank in the shard group: nothing to gather")
        elif config.mode in (None, "allgather", "rank_local"):
            self.set_mode(config.mode or "allgather", f"mode={config.mode!r} option")
        self.slots = self.shared.pool
        self.executor = self.shared.executor
        self.token = next(_TOKENS)  # tells this runtime apart from the others on its slots
        self.reads = WeightReads(self.store, device, self.group, self.executor, self.life)
        self.machine = SlotMachine(self.store, self.shared, self.group,
                                   None,
                                   fault_delay, self.token, self.life, self.reads)
        register(self)
        self.budget_plans: dict[tuple[str, ...], BudgetPlan] = {}  # per graph's parameters
        self.probed_bandwidths: Optional[tuple[float, float]] = None  # (H2D, gather) GB/s
        self.probed_flops: dict[torch.dtype, float] = {}  # matmul FLOP/s per dtype
        # device_budget="auto" (dlo_fx.dynamo.auto_budget), per graph's parameters (the key
        # of budget_plans): the memory record (capacity, peaks per shape, OOM floor) and the
        # blocks resident now (their positions; their bytes are on the device's
        # SharedSlots, beside other models')
        self.device_memory: dict[tuple[str, ...], DeviceMemory] = {}
        self.auto_resident: dict[tuple[str, ...], frozenset] = {}  # bytes: shared.auto_resident
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
        # What the one attach sequence recorded (`attached`): set once
        self.attachment = Attachment()
        # Why device_budget="auto" streams every block for now, or None: a pipeline's first
        # run, measured whole before any block goes resident (dynamo/pipelines.py)
        self.hold_resident: Optional[str] = None
        install_interrupt_handler()

    def attached(self, attachment: Attachment, named_resident: Iterable[torch.Tensor]) -> None:
        """Record what the attach sequence made of this runtime, and keep the parameters
        named ``resident=`` resident in every graph (the sequence makes its own runtime,
        so this runs once per runtime)."""
        self.attachment = attachment
        for tensor in named_resident:  # no graph streams (and so stores) them either
            self.keep_resident(tensor, NAMED_RESIDENT)

    def keep_resident(self, param: torch.Tensor, why: str) -> None:
        """Keep ``param`` resident in every later graph, for the first reason given
        (`KEPT_RESIDENT`)."""
        self.kept_resident.setdefault(param, why)

    @property
    def gathers(self) -> bool:
        """Whether this runtime's graphs issue collectives: allgather mode over several
        ranks (its store is then sharded)."""
        return self.mode == "allgather" and self.group.dp > 1

    # -- the lifecycle, read through (`Lifecycle`, lifecycle.py) --------------------------
    @property
    def lock(self) -> threading.RLock:
        """`Lifecycle.lock`: the device's slots' lock; raises in a forked process."""
        return self.life.lock

    @property
    def broken(self) -> Optional[str]:
        """Why the runtime failed (a copy or a collective), or None."""
        return self.life.broken

    @property
    def closed(self) -> bool:
        """Whether the runtime was released."""
        return self.life.closed

    def check_process(self) -> None:
        self.life.check_process()

    def check_open(self) -> None:
        self.life.check_open()

    @property
    def tracer(self) -> Optional[Tracer]:
        """The slots' timeline, recorded with ``trace=True`` (`SlotMachine.tracer`)."""
        return self.machine.tracer

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
        # Only with several ranks (the caller decides "rank_local" for one): so the store
        # is sharded (dp > 1) exactly in allgather mode, which is what `SlotMachine` and
        # `WeightReads`, holding the store, go by.
        sharded = mode == "allgather"
        self.mode, self.mode_reason = mode, reason
        pin = self.config.pin_memory and platform.can_pin(self.device)
        rank = self.group.rank if sharded else 0
        files = (FileStore(device=self.device, num_slots=self.config.num_slots, rank=rank, pin=pin,
                           file_reads=self.config.file_reads)
                 if self.config.host_store == "mmap" else None)
        self.store.shard_as(pin=pin, rank=rank, dp=self.group.dp if sharded else 1,
                            files=files, device=self.device)
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
        check = self.gathers
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
                for p, fqn in zip(block.params, block.fqns):
                    check_restorable(p, fqn)
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
        _become_stored(params, store, self.device)
        return indices

    def register_block(self, params: Sequence[torch.nn.Parameter], fqns: Sequence[str],
                       extents: Optional[Sequence] = None) -> int:
        """Add ``params`` to the host store as a new block (this rank's shard of it); they
        stay as they are until `store_blocks` turns them (`_become_stored`). Only
        `store_blocks` calls this: see [Note: storing blocks]. ``extents``: where the
        block's bytes are in files (the loader's blocks, `HostStore.add_block`)."""
        if self.mode is None:
            raise RuntimeError("dlo: internal error: a block is stored before the mode is "
                               "decided (planning.modes.choose_mode decides it, for the "
                               "compile and the loader alike)")
        if self.life.closed:
            raise RuntimeError("dlo: this runtime was released; compile the model again")
        block = self.store.add_block(params, fqns, extents=extents)
        self.machine.fit_slots(block.slot_bytes)
        return block.index

    def close(self) -> None:
        """Free the host store and resident copies, forget the slots this runtime filled
        and let go of its parameters. The runtime cannot run anything afterwards."""
        if not self.life.close():
            return  # released already
        self.machine.close()
        unclaim(self)
        for key in [k for k in self.shared.auto_resident if k[0] == self.token]:
            del self.shared.auto_resident[key]  # its resident copies go with it
        self.store.close()
        self.reads.clear()


def _become_stored(params: Sequence[torch.Tensor], store: HostStore,
                   device: torch.device) -> None:
    """Turn the parameters of ``params`` that ``store`` holds into `StoredWeight`s on
    ``device``: see [Note: when a parameter becomes a StoredWeight]. The caller holds the
    runtime's lock."""
    kept = []
    for p in params:
        entry = store.entry(p)
        if p.numel() and not is_stored(p) and entry is not None:
            try:
                become_stored(p, device)
            except RuntimeError:  # something outside Python holds its tensor
                kept.append(entry.fqn)
    if kept:
        warnings.warn(
            f"dlo: {len(kept)} stored parameters (first {kept[0]!r}) stay real tensors: "
            "something outside Python holds their tensors (an autograd graph through "
            "them, a view of them), so their memory is not given back. The model's "
            "graphs stream them all the same", RuntimeWarning, stacklevel=2)

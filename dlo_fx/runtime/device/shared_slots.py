"""The device's slots: `SlotPool`, ``num_slots`` device buffers each the size of the
largest gathered block, and `SharedSlots`, what the models on one device share: the pool,
the executor that fills it, and which model's block each slot holds.

Slots are allocated once per size: a block larger than any seen grows every slot, which
happens while a graph is compiled or a block is first registered, never in steady state.

[Note: slot views keep requires_grad]
A slot view makes every kernel choose what it chose for the parameter it stands in for,
so it keeps the parameter's ``requires_grad``. One choice reads ``requires_grad`` even
under ``torch.no_grad()``: ``aten::matmul`` folds a batched input into one ``mm`` when
either operand requires grad, and otherwise, when the input's leading dimensions cannot be
flattened without a copy (a transposed activation, as ``F.linear`` gets after Sana's
linear attention), runs a ``bmm`` against the expanded weight; the two sum in a different
order and differ in the last bit. So a view of a parameter that requires grad is a leaf
that requires grad too (grad mode is off whenever a streamed parameter requires grad: the
backend refuses it otherwise), and views are cached per (slot, parameter, flag).

[Note: what a model owns and what a device shares]
Host blocks are never shared between models; slot memory is, and a model never reads
another model's bytes from a shared slot. A model's `Runtime` owns its host store, its
mode and its resident copies. A pipeline's text encoder and transformer run one after the
other, so they can stream through the same ``num_slots`` buffers, the largest device cost
dlo adds; the weight-gather group is made once per device setting and default process
group, and kept (`weight_group` in ranks/collectives.py). Every runtime on one device with
the same ``num_slots`` gets the same `SharedSlots`, held weakly here and strongly by the
runtimes: when the last of them is gone, the slots are freed and the executor's worker
thread stops.

Sharing the buffers means sharing what they hold. ``holder[slot]`` is the
``(runtime token, host block)`` whose bytes the slot holds or is receiving; a runtime
reads it through `SlotMachine.slot_block`, which shows ``None`` for a slot another runtime
filled since, so its next ``wait`` copies its own block again. One executor per device
keeps one issue order for copies and gathers, and (on a device) orders a slot's next copy
after the last read of whichever model used it. The last task issued into each slot
(``pending``) is shared too, so a copy for one model is ordered after another model's
never-waited gather into that slot, and every graph of every model using the slots runs
under one ``lock``: calls from several threads are serialised graph by graph.

[Note: a failure stays with its model]
A copy or gather that fails (a file truncated under a model served from it, a rank that
died) fails its own model only. That runtime's ``wait`` raises, marks it broken (it raises
on every later call) and drops the failed task from ``pending``, with the slot's holder.
Every other model on the slots goes on: a copy issued after a failed task only orders
after it (``executor.settle``), and a drain (a compile, slots growing for a load) drops a
failed task it meets instead of raising it, so a model that was never waited on copies its
block again at its next ``wait`` and raises its own error there. A slot that kept the
failed task would raise the first model's error in every model that used it, on every
call, even in an unrelated model compiled later.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Optional, Protocol

import torch

from .executor import make_executor


class LaidOut(Protocol):
    """Where a parameter lies in a block's flat bytes (`host.layout.Entry` is one)."""

    @property
    def uid(self) -> int: ...  # tells the parameters of a store apart

    def view_of(self, flat: torch.Tensor) -> torch.Tensor: ...


class SlotPool:
    """``num_slots`` device buffers, each the size of the largest gathered block, and the
    views of them handed to the graph."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.device = device
        self.slot_bytes = 0
        self.buffers: list[torch.Tensor] = []
        self._views: list[dict[tuple[int, bool], torch.Tensor]] = [{} for _ in range(num_slots)]

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def ensure(self, nbytes: int) -> bool:
        """Grow every slot to at least ``nbytes``; True when the buffers were replaced."""
        if nbytes <= self.slot_bytes:
            return False
        self.buffers = []  # free the old slots before allocating the new ones
        # Normal tensors even when the first call runs under inference_mode: the copy
        # worker thread (not in inference mode) writes into them.
        with torch.inference_mode(False):
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                            for _ in range(self.num_slots)]
        self.slot_bytes = nbytes
        self._views = [{} for _ in range(self.num_slots)]
        return True

    def view(self, slot: int, entry: LaidOut, requires_grad: bool = False) -> torch.Tensor:
        """The parameter described by ``entry`` as a view of ``slot`` (cached), with the
        parameter's ``requires_grad`` (see [Note: slot views keep requires_grad])."""
        cache = self._views[slot]
        key = (entry.uid, requires_grad)
        view = cache.get(key)
        if view is None:
            view = entry.view_of(self.buffers[slot])
            if requires_grad:
                view = view.detach().requires_grad_(True)
            cache[key] = view
        return view


class SharedSlots:
    """The slots, executor and slot state of the runtimes on one device with one
    ``num_slots``: see [Note: what a model owns and what a device shares]."""

    def __init__(self, device: torch.device, num_slots: int) -> None:
        self.key = _key(device, num_slots)
        # A forked child makes its own: see [Note: a forked process] in lifecycle.py
        self.pid = os.getpid()
        self.device = device
        self.pool = SlotPool(num_slots, device)
        self.executor = make_executor(device, num_slots)
        self.holder: list[Optional[tuple[int, int]]] = [None] * num_slots
        # The last task issued into each slot, by whichever runtime: the next copy into
        # the slot is ordered after it (see [Note: slot reuse and stream ordering]).
        self.pending: list[Any] = [None] * num_slots
        # Held around every graph call of every runtime using these slots
        # (see [Note: one call at a time] in graph/graph_call.py).
        self.lock = threading.RLock()
        # device_budget="auto": the bytes each graph of each runtime on this device keeps
        # resident now, by (runtime token, graph's parameters): every model's budget
        # leaves out what the others keep (dlo_fx.dynamo.auto_budget)
        self.auto_resident: dict[tuple, int] = {}
        weakref.finalize(self, _shutdown, self.executor)

    def forget(self) -> None:
        """No slot holds a known block any more (buffers replaced, or a failed copy)."""
        self.holder = [None] * self.pool.num_slots

    def drop_failed(self, slot: int, handle: Any) -> None:
        """The task ``handle`` into ``slot`` failed: it is no longer the slot's last task,
        and the slot holds no known block. See [Note: a failure stays with its model]."""
        if self.pending[slot] is handle:
            self.pending[slot] = None
        self.holder[slot] = None


def _shutdown(executor) -> None:
    """Stop ``executor`` once its queued work is done. Runs when the last runtime using
    the slots is collected, which may happen on the worker thread itself: never join it."""
    pool = getattr(executor, "_pool", None)
    if pool is not None:
        executor._pool = None
        pool.shutdown(wait=False)
    elif not hasattr(executor, "_pool"):
        executor.shutdown()  # a device executor: wait for the streams before slots go


class SlotBlocks:
    """One runtime's view of ``SharedSlots.holder``: the host block each slot holds for
    it, ``None`` where the slot holds nothing of this runtime's."""

    __slots__ = ("_shared", "_token")

    def __init__(self, shared: SharedSlots, token: int) -> None:
        self._shared, self._token = shared, token

    def __getitem__(self, slot: int) -> Optional[int]:
        held = self._shared.holder[slot]
        return held[1] if held is not None and held[0] == self._token else None

    def __setitem__(self, slot: int, block: Optional[int]) -> None:
        self._shared.holder[slot] = None if block is None else (self._token, block)

    def __len__(self) -> int:
        return len(self._shared.holder)

    def __iter__(self):
        return (self[s] for s in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, SlotBlocks)) else NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


_SHARED: "weakref.WeakValueDictionary[tuple, SharedSlots]" = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def _key(device: torch.device, num_slots: int) -> tuple:
    return (device.type, device.index or 0, num_slots)


def shared_slots(device: torch.device, num_slots: int) -> SharedSlots:
    """The `SharedSlots` every runtime on ``device`` with ``num_slots`` shares."""
    key = _key(device, num_slots)
    with _LOCK:
        shared = _SHARED.get(key)
        if shared is None or shared.pid != os.getpid():  # the parent's thread is not here
            shared = _SHARED[key] = SharedSlots(device, num_slots)
        return shared

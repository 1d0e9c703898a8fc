"""`SlotPool`: ``num_slots`` device buffers, each the size of the largest gathered block.

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
"""

from __future__ import annotations

from typing import Protocol

import torch


class LaidOut(Protocol):
    """Where a parameter lies in a block's flat bytes (`host.layout.Entry` is one)."""

    @property
    def uid(self) -> int: ...  # tells the parameters of a store apart

    def view_of(self, flat: torch.Tensor) -> torch.Tensor: ...


class SlotPool:
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

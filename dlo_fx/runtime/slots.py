"""`SlotPool`: ``num_slots`` device buffers, each the size of the largest gathered block.

Slots are allocated once per size: a block larger than any seen grows every slot, which
happens while a graph is compiled or a block is first registered, never in steady state.
"""

from __future__ import annotations

import torch

from .layout import Entry


class SlotPool:
    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.device = device
        self.slot_bytes = 0
        self.buffers: list[torch.Tensor] = []
        self._views: list[dict[int, torch.Tensor]] = [{} for _ in range(num_slots)]

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

    def view(self, slot: int, entry: Entry) -> torch.Tensor:
        """The parameter described by ``entry`` as a view of ``slot`` (cached)."""
        cache = self._views[slot]
        view = cache.get(entry.uid)
        if view is None:
            view = cache[entry.uid] = entry.view_of(self.buffers[slot])
        return view

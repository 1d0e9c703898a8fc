"""Which parameters stay on the device (resident) and which stream: the one decision.

`decide_residency` is called by the `resident_set` pass (graph parameters, with their use
intervals) and by `dlo_fx.load` (model parameters, no intervals yet). It also fixes the
block budget, since "used far apart" is measured in budgets.

A parameter is resident, for the first reason that applies, when it is:

- ``empty``: no bytes to stream;
- named in ``resident=`` at load time (in every graph of the loaded model too);
- ``read directly by an earlier graph``: another graph of the model (a graph break, a
  second resolution) kept it resident without storing it, and its compiled code reads the
  module's tensor: streaming it here would make that tensor a `StoredWeight` under the
  earlier graph, which would then copy its block on every call;
- ``unused by this graph``;
- ``smaller than resident_bytes``;
- ``returned by the graph``: a view of it escapes through the output, so it must outlive
  its slot;
- ``used far apart``: more than one budget of other parameters is first used between its
  first and last use (a modulation table every layer reads, a tied embedding); streaming
  it would pin a slot across the blocks in between;
- ``read while num_slots later blocks are live``: once the blocks are formed, a
  parameter of block ``g`` still read after block ``g + num_slots`` (which reuses ``g``'s
  slot) is first read. Taking it out changes the blocks, so this repeats until no
  parameter is late;
- ``device_budget``: in a block the device budget keeps resident (`dlo_fx.planning.budget`): once
  the blocks are settled, what the budget leaves after the slots and the parameters above
  is filled with whole blocks, then the slot check runs once more.

Only the first four apply at load time; the graph decides the rest for what it reads.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Optional, Sequence

from .blocks import Layering, Unit, default_budget, layering

__all__ = ["Candidate", "Residency", "decide_residency"]


@dataclass(eq=False)
class Candidate:
    """A parameter as the residency decision sees it."""

    name: str
    nbytes: int
    first: Optional[int] = None  # first use in graph order; -1 unused; None: not known (load)
    last: Optional[int] = None
    escapes: bool = False  # a view of it is returned by the graph
    named: bool = False  # named in ``resident=`` at load time
    pinned: Optional[str] = None  # resident for a reason decided elsewhere (an earlier graph)


@dataclass
class Residency:
    """``reasons[i]``: why candidate ``i`` is resident, or None when it streams."""

    reasons: list[Optional[str]]
    budget: int
    layers: Layering  # how names map to layers (the budget's and the blocks')

    def streamed_in_use_order(self, cands: Sequence[Candidate]) -> list[int]:
        """Indices of the streamed candidates, in the order blocks are formed."""
        return _in_use_order(cands, [i for i, r in enumerate(self.reasons) if r is None])


# Given the indices of the streamed candidates (in use order), the budget and the layering,
# the blocks they form (lists of indices).
BlocksOf = Callable[[list[int], int, Layering], list[list[int]]]
# Given the blocks and the reasons so far, the blocks kept resident by the device budget.
ChooseBlocks = Callable[[list[list[int]], list[Optional[str]]], dict[int, str]]


def decide_residency(cands: Sequence[Candidate], *, resident_bytes: int,
                     block_bytes: Optional[int], num_slots: int,
                     blocks_of: Optional[BlocksOf] = None,
                     choose_blocks: Optional[ChooseBlocks] = None) -> Residency:
    """Decide every candidate's residency and the block budget (see the module docstring).

    ``blocks_of`` forms the blocks of a streamed set (the graph's: they may follow the
    host blocks of stored parameters); without it the slot check is skipped.
    ``choose_blocks`` (the device budget, `dlo_fx.planning.budget`) is given the settled blocks
    and the reasons so far and names the blocks that stay resident, with why.
    """
    reasons: list[Optional[str]] = [_static_reason(c, resident_bytes) for c in cands]
    live = [i for i, r in enumerate(reasons) if r is None]
    units = [Unit(cands[i].name, cands[i].nbytes) for i in _in_use_order(cands, live)]
    layers = layering(units)
    budget = block_bytes or default_budget(units, layers)
    for i in _far_apart(cands, live, budget):
        reasons[i] = "used far apart"
    if blocks_of is not None:
        blocks = _settle_late(cands, reasons, budget, layers, num_slots, blocks_of)
        if choose_blocks is not None:
            for g, why in choose_blocks(blocks, reasons).items():
                for i in blocks[g]:
                    reasons[i] = why
            # Fewer streamed blocks: a parameter may now be read too late (rare and small).
            _settle_late(cands, reasons, budget, layers, num_slots, blocks_of)
    return Residency(reasons, budget, layers)


def _settle_late(cands: Sequence[Candidate], reasons: list[Optional[str]], budget: int,
                 layers: Layering, num_slots: int, blocks_of: BlocksOf) -> list[list[int]]:
    """Make resident every parameter read while ``num_slots`` later blocks are live,
    until none is; returns the blocks of the final streamed set."""
    while True:
        streamed = _in_use_order(cands, [i for i, r in enumerate(reasons) if r is None])
        blocks = blocks_of(streamed, budget, layers)
        first = [min(cands[i].first for i in b) for b in blocks]
        late = [i for g in range(len(blocks) - num_slots) for i in blocks[g]
                if cands[i].last >= first[g + num_slots]]
        if not late:
            return blocks
        for i in late:
            reasons[i] = f"read while {num_slots} later blocks are live (num_slots={num_slots})"


def _static_reason(c: Candidate, resident_bytes: int) -> Optional[str]:
    if c.nbytes == 0:
        return "empty"
    if c.named:
        return "named in resident="
    if c.pinned is not None and (c.first is None or c.first >= 0):
        return c.pinned
    if c.first is not None and c.first < 0:
        return "unused by this graph"
    if c.nbytes < resident_bytes:
        return f"smaller than resident_bytes={resident_bytes}"
    if c.escapes:
        return "returned by the graph"
    return None


def _in_use_order(cands: Sequence[Candidate], idx: list[int]) -> list[int]:
    """Graph order (first, then last use) when known; the given order otherwise."""
    if any(cands[i].first is None for i in idx):
        return list(idx)
    return sorted(idx, key=lambda i: (cands[i].first, cands[i].last))


def _far_apart(cands: Sequence[Candidate], idx: list[int], budget: int) -> list[int]:
    """Candidates with more than ``budget`` bytes first used inside their use interval."""
    if any(cands[i].first is None for i in idx):
        return []
    ordered = _in_use_order(cands, idx)
    firsts = [cands[i].first for i in ordered]
    prefix = [0, *accumulate(cands[i].nbytes for i in ordered)]
    far = []
    for i in ordered:
        lo = bisect.bisect_right(firsts, cands[i].first)
        hi = bisect.bisect_right(firsts, cands[i].last)
        if prefix[hi] - prefix[lo] > budget:
            far.append(i)
    return far

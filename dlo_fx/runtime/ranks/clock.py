"""The collective clock: small words the ranks of a shard group exchange before a graph,
an eager fetch, a read to the host or a compile, so every rank issues the same
collectives in the same order, or every rank raises `ClockMismatch` before any of them.

[Note: the collective clock of a shard group]
In allgather mode every rank issues the same gathers in the same order, whatever fails.
Each way to break that has its guard:

- a call that raises (or is interrupted) part-way through a graph: the rank completes the
  rest of that graph's schedule without computing (`graph_call.complete`: the remaining
  prefetch, allgather, wait and swap nodes, run in order with their real arguments; they
  are idempotent on the slot state, so an interrupted node simply runs again), then
  raises. Its slot state and its collective count end exactly as the other ranks' do.
- a call that raises between graphs, or a graph another rank never reaches: before the
  first schedule node of a graph, the ranks exchange a small clock word (`CLOCK_WORDS`
  int64: the graph's key, its block count, the host block its first block is bound to)
  through the same worker as the gathers (`Clock`). Different words raise `RuntimeError`
  on every rank before any gather of that graph, so a gather never pairs with a different
  block (a silent mix of weights) or a different size (an abort inside gloo). Both ranks
  leave their state as it was; the next call starts in step.
- reads of a stored weight outside a graph (`runtime/weights/stored.py`: `WeightReads.eager_block`)
  exchange clock words the same way, in the same worker task as their gather, and so do
  reads of the stored weights to the host (``state_dict()``, `release`:
  `WeightReads.host_tensor`) and a compile before it compares plans and weight fingerprints
  (`graph_call.compile_clock`). The last word says which kind of step each rank is at, and
  a mismatch names them.

- a call of a graph under ``device_budget="auto"``: the ranks agree on its resident blocks
  first (``PLAN`` words; see [Note: the auto budget of ranks gathering] in
  dlo_fx/dynamo/auto_budget.py), and a block copied outside the schedule (a resident copy,
  an eager read) is preceded by words saying whether each rank could allocate it (see
  [Note: a block copy that does not fit on one rank] in weights/weight_reads.py): a rank
  short of memory makes every rank raise instead of leaving the others in the gather.
- a read of this rank's host shard that fails (a file changed while served): the rank
  issues no collective on the group again and raises; the others raise when their gather
  times out (see [Note: a read that fails before a gather] in collectives.py).

A collective that fails (a rank died, the timeout passed) closes the runtime: the group is
unusable afterwards.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import torch

from .collectives import ShardGroup, all_gather_single
from ..interrupts import deferred
from ..device.platform import exchange_device

CLOCK_WORDS = 4


class ClockMismatch(RuntimeError):
    """The ranks of a shard group reached different graphs (raised on every rank)."""


def word(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def exchange(group: ShardGroup, device: torch.device, words: Sequence[int],
             what: str) -> list[list[int]]:
    """Every rank's clock words (run on the executor's worker, in the gathers' order)."""
    device = exchange_device(group.pg)  # the CPU for gloo, the accelerator otherwise
    group.check_in_step(f"exchanging the collective clock before {what}")
    mine = torch.tensor(list(words), dtype=torch.int64, device=device)
    every = torch.empty(group.dp * len(words), dtype=torch.int64, device=device)
    try:
        all_gather_single(every, mine, group=group.pg)
    except Exception as exc:
        raise RuntimeError(f"dlo: exchanging the collective clock before {what} over the "
                           f"{group.describe()} failed on global rank "
                           f"{group.ranks[group.rank]}: {exc}") from exc
    return every.cpu().view(group.dp, -1).tolist()


# The last clock word: what a rank is about to do.
GRAPH, EAGER, COMPILE, HOST_READ, PLAN, COPY = range(6)
_KINDS = {GRAPH: "calls a graph", EAGER: "fetches weights eagerly",
          COMPILE: "compiles a graph", HOST_READ: "reads weights outside a graph (state_dict, release)",
          PLAN: "agrees on a graph's resident blocks (device_budget='auto')",
          COPY: "copies a block a graph keeps resident"}


def _kinds_hint(group: ShardGroup, rows: list[list[int]]) -> str:
    """What the ranks do, when they do different kinds of things (the last clock word)."""
    kinds = [row[-1] for row in rows]
    if len(set(kinds)) == 1:
        return ""
    doing = "; ".join(f"global rank {group.ranks[i]} {_KINDS.get(k, 'runs')}"
                      for i, k in enumerate(kinds))
    hint = f" ({doing})"
    if EAGER in kinds:
        hint += (". A rank fetches eagerly where Dynamo runs no compiled code for a module "
                 "that reads streamed weights; for instance, where a graph break made Dynamo "
                 "compile a module's forward as a frame of its own, a new input shape on "
                 "one rank alone makes that rank recompile it (call every rank with the "
                 "same shapes, or use mode='rank_local')")
    return hint


def check_rows(group: ShardGroup, rows: list[list[int]], what: str,
               free: Optional[int] = None) -> None:
    """Raise `ClockMismatch` (on every rank: all see all rows) when the words differ
    (but for word ``free``, which each rank may set to its own value)."""
    def fixed(row: list[int]) -> list[int]:
        return [w for k, w in enumerate(row) if k != free]

    mine = fixed(rows[group.rank])
    for i, row in enumerate(rows):
        if fixed(row) != mine:
            raise ClockMismatch(
                f"dlo: the ranks of the {group.describe()} are out of step: global rank "
                f"{group.ranks[group.rank]} is about to run {what} (clock {rows[group.rank]}) "
                f"but global rank {group.ranks[i]} runs clock {row} (words: the step's key, its "
                "block count or block, the first host block or what the rank offers, kind)"
                f"{_kinds_hint(group, rows)}. A call failed or was interrupted on "
                "one rank only between two graphs, or the ranks run different code, or call "
                "the model from several threads in different orders, or the model branches "
                "on its data (a step cache such as diffusers' FirstBlockCache skipping blocks "
                "on one rank only: "
                "mode='rank_local' lets each rank run its own graphs). Every rank raises "
                "here before gathering anything; the next call starts in step")


class Clock:
    """One exchange of clock words over ``group``, issued through ``executor`` (behind
    every gather already queued)."""

    def __init__(self, executor: Any, group: ShardGroup, device: torch.device,
                 words: Sequence[int], what: str) -> None:
        self.executor, self.group, self.what = executor, group, what
        self.rows: Optional[list[list[int]]] = None

        def task() -> None:
            self.rows = exchange(group, device, words, what)

        with deferred():  # issued and recorded together
            self.handle = executor.gather(-1, task, None)

    def failed(self) -> bool:
        """Whether the exchange itself failed (the group is unusable)."""
        return self.executor.failed(self.handle)

    def check(self, free: Optional[int] = None) -> list[list[int]]:
        """Wait for the exchange; raise `ClockMismatch` when the ranks' words differ (but
        for word ``free``); every rank's words."""
        self.executor.wait(self.handle)
        if self.rows is None:  # a device executor: the exchange ran on the comm stream
            raise RuntimeError("dlo: internal error: clock words missing after the exchange")
        check_rows(self.group, self.rows, self.what, free)
        return self.rows

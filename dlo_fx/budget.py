"""The device budget: which whole blocks stay on the device, planned from the cost model.

`plan_resident_blocks` takes numbers only (block bytes, copy seconds per block, compute
seconds per block, the slot count and the bytes left for resident blocks) and returns
the blocks to keep resident with the predicted time per call. It knows nothing of graphs,
runtimes or devices: the `resident_set` pass measures the bandwidths, builds the numbers
and hands the choice to `dlo_fx.residency.decide_residency`, the one residency decision.

[Note: resident blocks spread through the stack]
A streamed block costs its copy (H2D, plus the AllGather of the other ranks' shards in
allgather mode); a resident block costs nothing per call but its bytes stay on the device.
The predicted time per call is a small simulation of the schedule `insert_schedule`
writes: streamed block ``j`` (numbered among the streamed blocks) is copied into slot
``j % num_slots`` once the previous copy is done and once streamed block ``j - num_slots``
has been read for the last time; a block computes once the previous block computed and,
when streamed, once its copy is done. Blocks are chosen greedily: the block whose
residency lowers the predicted time most, among those that still fit. When the copies
dominate, every choice saves the same copy; the tie goes to the block farthest (in
blocks) from the ones already chosen and from the ends of the stack, so resident blocks
are spread through the stack and each one's compute runs while the next streamed block
copies, rather than the first k blocks (which the wrap-around prefetch already warms).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["BudgetPlan", "minimum_bytes", "plan_resident_blocks", "predict_call_s",
           "copy_seconds"]


@dataclass
class BudgetPlan:
    """What the device budget decided for one graph."""

    device_budget: int  # bytes the weights may use on the device
    minimum: int  # slots for the largest block + always-resident parameters
    capacity: int  # bytes left for resident blocks
    resident: list[int] = field(default_factory=list)  # block positions, ascending
    reasons: dict[int, str] = field(default_factory=dict)
    block_bytes: list[int] = field(default_factory=list)
    predicted_s: float = 0.0  # predicted time per call with these resident blocks
    streamed_s: float = 0.0  # predicted time per call with every block streamed
    h2d_gbps: float = 0.0
    gather_gbps: float = 0.0
    labels: list[str] = field(default_factory=list)  # first..last FQN of each block
    measured_s: Optional[float] = None  # last measured call (set by the backend)

    @property
    def resident_bytes(self) -> int:
        return sum(self.block_bytes[i] for i in self.resident)

    @property
    def streamed_bytes(self) -> int:
        return sum(self.block_bytes) - self.resident_bytes


def minimum_bytes(block_bytes: Sequence[int], num_slots: int, always_resident: int) -> int:
    """The smallest device budget: ``num_slots`` slots of the largest block, plus the
    parameters that are resident whatever the budget."""
    return num_slots * max(block_bytes, default=0) + always_resident


def copy_seconds(nbytes: int, *, dp: int, allgather: bool, h2d_gbps: float,
                 gather_gbps: float) -> float:
    """Seconds to bring one block to the device: its H2D (this rank's shard in allgather
    mode) followed by the AllGather of the other ranks' shards."""
    if not allgather or dp <= 1:
        return nbytes / (h2d_gbps * 1e9)
    shard = nbytes / dp
    return shard / (h2d_gbps * 1e9) + shard * (dp - 1) / (gather_gbps * 1e9)


def predict_call_s(copy_s: Sequence[float], compute_s: Sequence[float],
                   resident: Sequence[int] | set[int], num_slots: int) -> float:
    """Predicted seconds of one call (see [Note: resident blocks spread through the
    stack])."""
    resident = set(resident)
    copy_end: list[float] = []  # per streamed block
    compute_end_streamed: list[float] = []  # per streamed block
    clock = 0.0  # end of the last compute
    copy_clock = 0.0  # end of the last copy
    for i, (c, w) in enumerate(zip(copy_s, compute_s)):
        if i in resident:
            clock += w
            continue
        j = len(copy_end)
        free = compute_end_streamed[j - num_slots] if j >= num_slots else 0.0
        copy_clock = max(copy_clock, free) + c
        copy_end.append(copy_clock)
        clock = max(clock, copy_clock) + w
        compute_end_streamed.append(clock)
    return clock


def plan_resident_blocks(block_bytes: Sequence[int], copy_s: Sequence[float],
                         compute_s: Sequence[float], *, num_slots: int, capacity: int,
                         plan: BudgetPlan) -> BudgetPlan:
    """Fill ``capacity`` bytes with resident blocks chosen to minimise the predicted time
    per call; fills and returns ``plan``."""
    n = len(block_bytes)
    plan.block_bytes = list(block_bytes)
    plan.streamed_s = predict_call_s(copy_s, compute_s, (), num_slots)
    chosen: list[int] = []
    left = capacity
    best_s = plan.streamed_s
    while True:
        fits = [i for i in range(n) if i not in chosen and block_bytes[i] <= left]
        if not fits:
            break
        scored = []
        for i in fits:
            t = predict_call_s(copy_s, compute_s, {*chosen, i}, num_slots)
            gap = min([i + 1, n - i, *(abs(i - c) for c in chosen)])
            scored.append((round(t, 12), -gap, i))
        t, _, i = min(scored)
        chosen.append(i)
        left -= block_bytes[i]
        plan.reasons[i] = (
            f"device_budget: predicted {best_s * 1e3:.3f} -> {t * 1e3:.3f} ms per call "
            f"({block_bytes[i]:,} B of {capacity:,} B for resident blocks)")
        best_s = t
    plan.resident = sorted(chosen)
    plan.predicted_s = best_s
    return plan

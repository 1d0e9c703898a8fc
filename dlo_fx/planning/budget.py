"""The device budget: which whole blocks stay on the device, planned from the cost model.

`plan_resident_blocks` takes numbers only (block bytes, copy seconds per block, compute
seconds per block, the slot count and the bytes left for resident blocks) and returns
the blocks to keep resident with the predicted time per call. It knows nothing of graphs,
runtimes or devices: the `resident_set` pass measures the bandwidths and the matmul rate,
builds the numbers (copy: bytes over the H2D and AllGather bandwidths; compute: the FLOPs
of the nodes a block spans, `dlo_fx.planning.flops`, over the matmul rate) and hands the choice to
`dlo_fx.planning.residency.decide_residency`, the one residency decision.

[Note: resident blocks spread through the stack]
The blocks kept resident are those that lower the predicted time of a steady call most;
among equal choices, those farthest from each other and from the ends of the stack.
A streamed block costs its copy (H2D, plus the AllGather of the other ranks' shards in
allgather mode); a resident block costs nothing per call but its bytes stay on the device.
The predicted time per call is the schedule simulator's (`dlo_fx.planning.simulate`,
see [Note: the schedule simulator]) on the schedule `insert_schedule` writes, one
compute per block (`block_program`): streamed block ``j`` (numbered among the streamed blocks) is copied into slot
``j % num_slots`` once the previous copy is done and once streamed block ``j - num_slots``
has been read for the last time; a block computes once the previous block computed and,
when streamed, once its copy is done. The call predicted is a steady one of a denoising
loop, as the timeline draws it: the first ``num_slots`` streamed blocks were copied by the
previous call's wrap-around prefetch (issued once their slot was free for the last time,
so such a copy may still run when the call starts), and with at most ``num_slots``
streamed blocks nothing is copied at all. A block's copy is its H2D and AllGather on one
lane (the CPU executor's one worker runs both; a device overlaps one block's gather with
the next block's H2D, which the dump's timeline draws), so a plan errs toward slower
copies. Blocks are chosen greedily: the block whose
residency lowers the predicted time most, among those that still fit. Compute decides
which: a block whose copy the previous blocks' compute hides saves nothing, one whose
copy stalls compute saves its stall. When every choice saves the same (the copies
dominate, or compute hides them all), the tie goes to the block farthest (in blocks) from
the ones already chosen and from the ends of the stack, so resident blocks are spread
through the stack and each one's compute runs while the next streamed block copies.

[Note: a copy lane of its own]
The simulator overlaps a block's copy with the compute of the blocks before it: a device's
copy engine and DMA run beside its kernels. A CPU computing on every core has no such lane:
its copy thread's memcpy takes its time from the matmuls, and a call costs its compute plus
every streamed block's copy (the 2-core figure 2 of docs/benchmarks.md: measured resident +
copy, 1.53x the overlapped prediction). `dlo_fx.plan` takes it as the hardware's
``copies_overlap`` (False for a CPU whose intra-op threads take every core:
`cpu_copies_overlap`); the compile's own planner keeps the overlapped model (its devices
are accelerators; the CPU is its test device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from .simulate import block_program, simulate_call

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
    fqns: list[list[str]] = field(default_factory=list)  # parameters of each block
    copy_s: list[float] = field(default_factory=list)  # predicted copy of each block
    compute_s: list[float] = field(default_factory=list)  # predicted compute of each block
    flops: list[int] = field(default_factory=list)  # FLOPs of the nodes each block spans
    flops_per_s: dict[str, float] = field(default_factory=dict)  # measured, per dtype
    # device_budget="auto": how the weights budget was found (dlo_fx.planning.device_memory)
    budget_lines: list[str] = field(default_factory=list)
    # where the rates come from: "measured" (the backend's probes), or a hardware target's
    # figures (`dlo_fx.plan`, which measures nothing)
    figures: str = "measured"
    # whether a copy runs beside compute (see [Note: a copy lane of its own])
    copies_overlap: bool = True

    @property
    def streamed_copy_s(self) -> float:
        """Seconds of copies per call: the streamed blocks' (busy time of the copy lane)."""
        return sum(c for i, c in enumerate(self.copy_s) if i not in self.resident)

    @property
    def compute_total_s(self) -> float:
        """Seconds of compute per call, every block (resident or streamed)."""
        return sum(self.compute_s)

    def describe_rates(self) -> str:
        """The figures the plan used (measured, or a hardware target's), for reports."""
        rates = ", ".join(f"{d} {_flops(r)}" for d, r in self.flops_per_s.items())
        return (f"H2D {self.h2d_gbps:.2f} GB/s, AllGather {self.gather_gbps:.2f} GB/s, "
                f"matmul {rates or f'not {self.figures} (compute taken as 0)'}")

    @property
    def resident_bytes(self) -> int:
        return sum(self.block_bytes[i] for i in self.resident)

    @property
    def streamed_bytes(self) -> int:
        return sum(self.block_bytes) - self.resident_bytes


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.3g} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.3g} GFLOP/s"


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
                   resident: Sequence[int] | set[int], num_slots: int, *,
                   steady: bool = True, overlap: bool = True) -> float:
    """Predicted seconds of one call: a steady call of a loop, or with ``steady=False``
    the first call, whose copies all start with it (see [Note: resident blocks spread
    through the stack]); simulated by `dlo_fx.planning.simulate`. With ``overlap=False``
    the copies have no lane beside compute (see [Note: a copy lane of its own]): every
    streamed block's copy adds to the call."""
    resident = set(resident)
    streamed = [i for i in range(len(copy_s)) if i not in resident]
    if steady and len(streamed) <= num_slots:
        return sum(compute_s)  # every streamed block stays in its slot: no copy
    if not overlap:
        return sum(compute_s) + sum(copy_s[i] for i in streamed)
    program = block_program(compute_s, streamed, num_slots)
    no_gather = [0.0] * len(copy_s)  # one copy lane: see [Note: the schedule simulator]
    first = simulate_call(program, copy_s, no_gather)
    if not steady:
        return first.compute_end
    return simulate_call(program, copy_s, no_gather, first.next_state).compute_end


def plan_resident_blocks(block_bytes: Sequence[int], copy_s: Sequence[float],
                         compute_s: Sequence[float], *, num_slots: int, capacity: int,
                         plan: BudgetPlan) -> BudgetPlan:
    """Fill ``capacity`` bytes with resident blocks chosen to minimise the predicted time
    per call; fills and returns ``plan``.

    Greedy, then the best of its prefixes (the longest among equals): a resident block
    can lengthen a steady call (the block that becomes one of the first ``num_slots``
    streamed ones may have a copy nothing hides), so filling the budget is not always
    faster."""
    n = len(block_bytes)
    plan.block_bytes = list(block_bytes)
    overlap = plan.copies_overlap
    plan.streamed_s = predict_call_s(copy_s, compute_s, (), num_slots, overlap=overlap)
    chosen: list[int] = []
    steps: list[tuple[float, str]] = []  # predicted time and reason after each choice
    left = capacity
    last_s = plan.streamed_s
    while True:
        fits = [i for i in range(n) if i not in chosen and block_bytes[i] <= left]
        if not fits:
            break
        scored = []
        for i in fits:
            t = predict_call_s(copy_s, compute_s, {*chosen, i}, num_slots, overlap=overlap)
            gap = min([i + 1, n - i, *(abs(i - c) for c in chosen)])
            scored.append((round(t, 12), -gap, i, t))
        _, _, i, t = min(scored)
        chosen.append(i)
        left -= block_bytes[i]
        steps.append((t, f"device_budget: predicted {last_s * 1e3:.3f} -> {t * 1e3:.3f} ms "
                         f"per call ({block_bytes[i]:,} B of {capacity:,} B for resident "
                         "blocks)"))
        last_s = t
    times = [round(t, 12) for t in (plan.streamed_s, *(t for t, _ in steps))]
    keep = min(range(len(times)), key=lambda k: (times[k], -k))
    plan.reasons = {i: why for i, (_, why) in zip(chosen[:keep], steps[:keep])}
    plan.resident = sorted(chosen[:keep])
    plan.predicted_s = plan.streamed_s if keep == 0 else steps[keep - 1][0]
    return plan

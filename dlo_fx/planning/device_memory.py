"""The auto device budget's arithmetic: how many bytes a graph's weights may keep on the
device, from the device's capacity and the activation peaks measured per input shape.

Numbers only, like the rest of `dlo_fx.planning`: no graph, no runtime, no device. The
backend (`dlo_fx.dynamo.auto_budget`) measures and hands the figures in; the resident
blocks are then chosen by `dlo_fx.planning.budget` within what this module leaves.

[Note: the auto device budget]
``device_budget="auto"`` keeps whole blocks resident within what the device really has:
*the planned bytes (weights budget + activation peak) never exceed capacity - margin*.
For one graph (one set of parameters) and one input shape:

    weights budget = capacity - activation peak - margin - resident bytes of the other
                     graphs on the device

- ``capacity``: ``device_memory`` where declared (the planner then works on the CPU and
  the meta device too), else the device's free memory when the graph was compiled plus
  what the slots and the auto budget's resident blocks held then (they are the weights'
  own).
- ``activation peak``: the device's peak during the call minus what was allocated before
  it and minus the resident copies made during it (activations and workspace only),
  recorded per input shape (`ActivationPeaks`). The first call of the first shape streams
  every block (the plan that needs least) and measures; every later call is planned.
  A shape never measured is predicted from the largest shape measured, per element of
  the call's tensor inputs, rounded up (attention's workspace grows faster than the
  element count only where it materialises scores; SDPA's fused kernels do not), so the
  first call at a 4x larger resolution re-plans *before* it runs. Its own peak replaces
  the prediction afterwards. ``activation_reserve_bytes`` replaces every peak.
- work between calls: what the rest of the process allocates between two calls of the
  graph while its resident blocks stay on the device (a pipeline's VAE decode and text
  encoders, the other graphs of a model cut by graph breaks, the user's own code). The
  graph reads the allocator's counters at the end of each call and at the start of the
  next, without resetting them: the peak reached in between minus what was allocated when
  the call ended (``DeviceMemory.between``, the largest seen) stands in for the activation
  peak wherever it is larger, so the next plan leaves it room. An allocation that failed
  in between (the allocator's count of out-of-memory errors grew) is handled as one of the
  graph's own: its resident blocks go back to streaming under the OOM floor, with a
  warning, since the error was raised to code dlo does not run. A pipeline compiled with
  `compile_pipeline` streams every block through its first run, so that the work after
  its last step (the VAE decode) is measured before any block goes resident.
- ``margin`` = max(1 GiB, 10% of the peak): what the measurement cannot see still fits:
  the caching allocator's fragmentation and rounding (blocks of 2 MiB, a few hundred MiB
  on a large model), cuBLAS/cuDNN workspaces created lazily (tens of MiB per stream), the
  CUDA context's own growth, and run-to-run variation of the peak itself (a different
  attention kernel at another sequence length). 1 GiB covers the fixed part; 10% covers
  the part that grows with the activations.
- resident bytes of the other graphs on the device (a graph break in the model, another
  model or pipeline component on the same device: `SharedSlots.auto_resident`): they stay
  on the device while this graph runs.
- OOM floor: when a call runs out of device memory anyway, every block the graph kept
  resident goes back to streaming, and its weights budget never again exceeds the budget
  that failed minus the bytes moved (`DeviceMemory.after_oom`): a budget that failed
  once is not tried again at any shape.

Several ranks gathering (allgather mode, dp > 1) plan each call the same way and then run
the plan of the smallest weights budget any of them offers (see [Note: the auto budget of
ranks gathering] in dlo_fx/dynamo/auto_budget.py). A call of an explicit
``device_budget`` that runs out of memory raises `DeviceMemoryError` and changes nothing
(`auto_budget.fixed_residency`).

A graph Dynamo reuses for other parameters (the next layer's, after a graph break in the
blocks; another model of the class) is planned for each set of parameters on its own:
one memory record and one resident set per runtime and parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .budget import BudgetPlan, plan_resident_blocks

__all__ = ["GIB", "ActivationPeaks", "AutoBudget", "DeviceMemory", "margin_bytes",
           "replan", "weights_budget"]

GIB = 1 << 30
MARGIN_FLOOR = GIB
"""The margin's fixed part (see [Note: the auto device budget])."""
MARGIN_PERCENT = 10
"""The margin's part that grows with the activation peak."""

ShapeKey = tuple  # the shapes (and dtypes) of a call's tensor inputs


def margin_bytes(activation_peak: int) -> int:
    """max(1 GiB, 10% of the peak, rounded up): see [Note: the auto device budget]."""
    return max(MARGIN_FLOOR, -(-activation_peak * MARGIN_PERCENT // 100))


def weights_budget(capacity: int, activation_peak: int, other_resident: int = 0,
                   floor: Optional[int] = None) -> int:
    """Bytes the weights of one graph may keep on the device (never below 0)."""
    budget = capacity - activation_peak - margin_bytes(activation_peak) - other_resident
    if floor is not None:
        budget = min(budget, floor)
    return max(budget, 0)


@dataclass
class ActivationPeaks:
    """Activation peaks measured per input shape, and the prediction for a new shape."""

    measured: dict = field(default_factory=dict)  # ShapeKey -> (elements, peak bytes)
    # how a recorded peak was found: "measured" on a device with an allocator; on the meta
    # device, which has none, it is given (a hook) or 0, and never called measured
    found_as: str = "measured"

    def record(self, key: ShapeKey, elements: int, peak: int) -> None:
        self.measured[key] = (int(elements), max(int(peak), 0))

    def predict(self, key: ShapeKey, elements: int) -> Optional[tuple[int, str]]:
        """(peak bytes, how it was found) for ``key``: measured, or scaled per element
        from the largest shape measured (rounded up); None when nothing was measured."""
        if key in self.measured:
            return self.measured[key][1], self.found_as
        if not self.measured:
            return None
        ref_elements, ref_peak = max(self.measured.values())
        if ref_elements <= 0:
            return ref_peak, "as the largest measured shape"
        peak = -(-ref_peak * int(elements) // ref_elements)
        return peak, (f"predicted per element from {ref_elements:,} elements "
                      f"({ref_peak:,} B)")


@dataclass(frozen=True)
class AutoBudget:
    """One planned weights budget and the figures it came from, for reports."""

    capacity: int
    activation_peak: int
    peak_source: str  # "measured", "predicted ...", "activation_reserve_bytes"
    margin: int
    other_resident: int
    floor: Optional[int]
    weights: int

    def lines(self) -> list[str]:
        floor = "" if self.floor is None else f", OOM floor {self.floor:,} B"
        return [f"device capacity {self.capacity:,} B - activation peak "
                f"{self.activation_peak:,} B ({self.peak_source}) - margin {self.margin:,} B"
                f" - {self.other_resident:,} B resident for the other graphs on the device"
                f"{floor} = weights budget {self.weights:,} B"]


@dataclass
class DeviceMemory:
    """The auto budget's record for one graph's parameters: the capacity, the peaks per
    shape, the OOM floor. Kept by the runtime per parameter set, so a recompile for a new
    resolution predicts from the shapes measured before it."""

    capacity: int
    reserve: Optional[int] = None  # activation_reserve_bytes: replaces every peak
    peaks: ActivationPeaks = field(default_factory=ActivationPeaks)
    floor: Optional[int] = None
    ooms: list = field(default_factory=list)  # one line per out-of-memory error
    between: int = 0  # the largest excursion of the work between two calls (bytes)
    mark: Optional[tuple] = None  # (allocated, peak) when the last call ended
    ooms_seen: Optional[int] = None  # the allocator's OOM count when the last call started
    # Several ranks gathering: the first plan of these parameters, which every re-plan
    # starts from (see [Note: the auto budget of ranks gathering] in dynamo/auto_budget.py)
    base: Optional[BudgetPlan] = None

    def budget_for(self, key: ShapeKey, elements: int,
                   other_resident: int = 0) -> Optional[AutoBudget]:
        """The weights budget for a call at ``key``; None before any peak is known (the
        call streams every block and measures)."""
        if self.reserve is not None:
            peak, how = self.reserve, "activation_reserve_bytes"
        else:
            found = self.peaks.predict(key, elements)
            if found is None:
                return None
            peak, how = found
        if self.between > peak:
            peak, how = self.between, "what the work between two calls allocated"
        return AutoBudget(self.capacity, peak, how, margin_bytes(peak), other_resident,
                          self.floor, weights_budget(self.capacity, peak, other_resident,
                                                     self.floor))

    def ended(self, allocated: int, peak: int) -> None:
        """The allocator's counters as a call of the graph ends."""
        self.mark = (allocated, peak)

    def started(self, peak: int, ooms: Optional[int]) -> bool:
        """The counters as the next call starts: records the work since the last call
        ended (`between`); True where an allocation failed with out-of-memory since the
        last call started (one of the graph's own was handled there: it left nothing
        resident to move)."""
        grew = ooms is not None and self.ooms_seen is not None and ooms > self.ooms_seen
        self.ooms_seen = ooms
        if self.mark is not None:
            allocated, peak_then = self.mark
            self.mark = None
            if peak != peak_then:  # a new peak in between, or the counters were reset
                self.between = max(self.between, peak - allocated)
        return grew

    def after_oom(self, failed_budget: int, moved_bytes: int, line: str) -> int:
        """Lower the floor after an out-of-memory error: never again more than the budget
        that failed minus the bytes moved back to streaming. Returns the floor."""
        floor = max(failed_budget - moved_bytes, 0)
        self.floor = floor if self.floor is None else min(self.floor, floor)
        self.ooms.append(line)
        return self.floor


def replan(base: BudgetPlan, weights: int, num_slots: int,
           lines: Sequence[str] = ()) -> BudgetPlan:
    """``base`` (a plan's figures: blocks, copy and compute seconds, minimum) planned again
    for a weights budget of ``weights`` bytes: the resident blocks that fit in what is left
    after the minimum (none when the budget is below it)."""
    plan = dataclasses.replace(base, device_budget=weights,
                               capacity=max(weights - base.minimum, 0), resident=[],
                               reasons={}, measured_s=None, budget_lines=list(lines))
    return plan_resident_blocks(plan.block_bytes, plan.copy_s, plan.compute_s,
                                num_slots=num_slots, capacity=plan.capacity, plan=plan)

"""`memory_report(model)`: where a model's weights live, measured."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from ..runtime import (cgroup_memory, device_memory_bytes, is_stored, max_memory_allocated,
                       pinned_figures, process_memory, runtimes_holding, span_bytes)


@dataclass(frozen=True)
class MemoryReport:
    """Weight memory of one model under dlo. Host figures are of this process."""

    num_blocks: int
    max_block_bytes: int
    num_slots: int
    slot_bytes: int
    resident_bytes: int
    host_shard_bytes: int
    buffer_bytes: int
    rss_bytes: Optional[int]
    pss_bytes: Optional[int]
    private_bytes: Optional[int]
    shared_bytes: Optional[int]
    cgroup_current_bytes: Optional[int]
    cgroup_peak_bytes: Optional[int]
    device_peak_bytes: Optional[int]
    predicted: Optional[dict] = None
    """The policy model's figures for this run's plan (``host_shard_bytes``,
    ``slot_bytes``), printed beside the measured ones; None before anything streams."""
    num_resident_blocks: int = 0
    """Blocks the ``device_budget`` keeps on the device (summed over the model's graphs)."""
    streamed_bytes_per_call: int = 0
    """Bytes of blocks copied to the device per call (the streamed blocks of every graph)."""
    predicted_s_per_call: Optional[float] = None
    """The budget planner's predicted seconds per call (summed over graphs), printed
    beside ``measured_s_per_call`` (the last call of each graph, on the host clock)."""
    measured_s_per_call: Optional[float] = None
    predicted_copy_s_per_call: Optional[float] = None
    """Of the prediction: seconds of copies (H2D and AllGather) of the streamed blocks."""
    predicted_compute_s_per_call: Optional[float] = None
    """Of the prediction: seconds of compute of every block (their FLOPs over the measured
    matmul rate). Copies and compute overlap, so the call takes less than their sum."""
    pinned_requested_bytes: int = 0
    """Page-locked host bytes the host shards and staging buffers use (0 unpinned)."""
    pinned_allocated_bytes: int = 0
    """Page-locked host bytes held for them: the slabs they are packed into, exactly sized
    where the platform registers host memory, powers of two elsewhere (see [Note: pinned
    slabs] in runtime/host/host_slabs.py)."""
    device_capacity_bytes: Optional[int] = None
    """The device's capacity the auto budget plans with (``device_memory``, else the free
    memory at compile plus the weights' own bytes); else the device's total memory."""
    activation_peak_bytes: Optional[int] = None
    """The largest activation peak measured (device peak of a call minus what was
    allocated before it and the resident copies it made); None before any."""
    activation_peaks: tuple = ()
    """``(input shapes, peak bytes)`` of every shape measured, per graph."""
    weights_budget_bytes: Optional[int] = None
    """What the device budget lets the weights use (summed over the model's graphs)."""
    host_file_bytes: int = 0
    """Of this rank's host shards, the bytes read from the checkpoint's files each time
    (``host_store="mmap"``), not held in ``host_shard_bytes``."""
    budget_lines: tuple = ()
    """How each graph's budget was found and which blocks it keeps resident and why
    (bytes, predicted time per call before and after); out-of-memory errors met."""

    _SPECIAL = ("predicted", "predicted_s_per_call", "measured_s_per_call",
                "predicted_copy_s_per_call", "predicted_compute_s_per_call",
                "activation_peaks", "budget_lines")

    def __str__(self) -> str:
        rows = [(f.name, getattr(self, f.name)) for f in fields(self)
                if f.name not in self._SPECIAL]
        width = max(len(name) for name, _ in rows)
        lines = [f"{'figure':<{width}}  value", f"{'-' * width}  {'-' * 16}"]
        for name, value in rows:
            line = f"{name:<{width}}  {_fmt(name, value)}"
            if self.predicted and name in self.predicted:
                model = self.predicted[name]
                files = self.host_file_bytes if name == "host_shard_bytes" else 0
                line += (f"   model {model / 2**20:.1f} MiB "
                         f"({(value + files - model) / max(model, 1):+.1%}"
                         + (f", with the {files / 2**20:.1f} MiB read from files)" if files
                            else ")"))
            lines.append(line)
        if self.predicted_s_per_call is not None:
            measured = self.measured_s_per_call
            lines.append(f"{'s_per_call':<{width}}  "
                         + (f"{measured * 1e3:.3f} ms" if measured is not None else "n/a")
                         + f"   model {self.predicted_s_per_call * 1e3:.3f} ms"
                         + (f" (copies {self.predicted_copy_s_per_call * 1e3:.3f} ms, compute "
                            f"{self.predicted_compute_s_per_call * 1e3:.3f} ms)"
                            if self.predicted_copy_s_per_call is not None else ""))
        for shapes, peak in self.activation_peaks:
            lines.append(f"{'activation_peak':<{width}}  {_fmt('_bytes', peak)}   at {shapes}")
        lines += [f"{'device_budget':<{width}}  {line}" for line in self.budget_lines]
        return "\n".join(lines)


def _fmt(name: str, value: Optional[int]) -> str:
    if value is None:
        return "n/a"
    if name.endswith("_bytes"):
        return f"{value:,} B ({value / 2**20:.1f} MiB)"
    return str(value)


def memory_report(model: torch.nn.Module) -> MemoryReport:
    """Measure ``model``'s weight placement: blocks, slots, resident and host bytes."""
    params = list(dict.fromkeys(model.parameters()))
    runtimes = runtimes_holding(params)
    blocks = []
    slot_bytes = num_slots = 0
    resident = sum(span_bytes(p) for p in params if not is_stored(p))
    device = params[0].device if params else torch.device("cpu")
    predicted: Optional[dict] = None
    plans = []
    streamed = 0
    pinned: list = []
    for rt in runtimes:
        files = rt.store.files
        pinned += [rt.store.slabs, files.staging.slabs if files is not None and files.staging else None]
        ids = {rt.store.entry(p).block for p in params if p in rt.store}
        mine = [rt.store.blocks[i] for i in sorted(ids)]
        blocks += mine
        if mine and rt.mode is not None:
            from ..planning.modes import predicted_weight_bytes

            figures = predicted_weight_bytes(rt.mode, [b.nbytes for b in mine],
                                             rt.group.dp, rt.slots.num_slots)
            predicted = {k: (predicted or {}).get(k, 0) + v for k, v in figures.items()}
        slot_bytes += rt.slots.total_bytes
        num_slots = max(num_slots, rt.slots.num_slots)
        resident += rt.reads.resident_copy_bytes
        device = rt.device
        plans += list(rt.budget_plans.values())
    if plans:
        streamed = sum(p.streamed_bytes for p in plans)
    else:
        streamed = sum(b.nbytes for b in blocks)
    measured = [p.measured_s for p in plans]
    auto = auto_figures(runtimes, plans)
    if auto["device_capacity_bytes"] is None:
        auto["device_capacity_bytes"] = device_memory_bytes(device)
    pinned_requested, pinned_allocated = pinned_figures(*pinned)
    host = process_memory()
    cgroup = cgroup_memory()
    return MemoryReport(
        num_blocks=len(blocks),
        max_block_bytes=max((b.slot_bytes for b in blocks), default=0),
        num_slots=num_slots,
        slot_bytes=slot_bytes,
        resident_bytes=resident,
        host_shard_bytes=sum(b.shard.numel() for b in blocks if b.source is None),
        host_file_bytes=sum(b.shard_nbytes for b in blocks if b.source is not None),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        rss_bytes=host["rss"], pss_bytes=host["pss"], private_bytes=host["private"],
        shared_bytes=host["shared"], cgroup_current_bytes=cgroup["current"],
        cgroup_peak_bytes=cgroup["peak"], device_peak_bytes=max_memory_allocated(device),
        predicted=predicted,
        num_resident_blocks=sum(len(p.resident) for p in plans),
        streamed_bytes_per_call=streamed,
        predicted_s_per_call=sum(p.predicted_s for p in plans) if plans else None,
        measured_s_per_call=(sum(measured) if plans and None not in measured else None),
        predicted_copy_s_per_call=sum(p.streamed_copy_s for p in plans) if plans else None,
        predicted_compute_s_per_call=sum(p.compute_total_s for p in plans) if plans else None,
        pinned_requested_bytes=pinned_requested,
        pinned_allocated_bytes=pinned_allocated,
        **auto,
    )


def auto_figures(runtimes, plans) -> dict:
    """The device budget's figures for the report: the auto budget's capacity and
    measured peaks (`dlo_fx.planning.device_memory`), each plan's budget and resident
    blocks with why."""
    records = [m for rt in runtimes for m in rt.device_memory.values()]
    plans = [p for p in plans if p.block_bytes]  # a graph that streams nothing has no budget
    peaks = tuple((shapes, peak) for m in records
                  for shapes, (_, peak) in m.peaks.measured.items())
    lines: list[str] = []
    for plan in plans:
        lines += plan.budget_lines
        lines += [f"resident block {g} ({plan.labels[g] if g < len(plan.labels) else ''}): "
                  f"{plan.block_bytes[g]:,} B, {plan.reasons.get(g, '')}" for g in plan.resident]
        if plan.budget_lines or plan.resident:
            lines.append(f"predicted {plan.predicted_s * 1e3:.3f} ms per call with "
                         f"{len(plan.resident)} of {len(plan.block_bytes)} blocks resident "
                         f"({plan.streamed_s * 1e3:.3f} ms with every block streamed), measured "
                         + (f"{plan.measured_s * 1e3:.3f} ms" if plan.measured_s is not None
                            else "n/a"))
    lines += [line for m in records for line in m.ooms]
    lines += [f"every block streams until {rt.hold_resident} ends: measured whole before any "
              "block goes resident" for rt in runtimes if rt.hold_resident and rt.device_memory]
    return {"device_capacity_bytes": max((m.capacity for m in records), default=None),
            "activation_peak_bytes": max((p for _, p in peaks), default=None),
            "activation_peaks": peaks,
            "weights_budget_bytes": sum(p.device_budget for p in plans) if plans else None,
            "budget_lines": tuple(lines)}

"""A `Plan` for a person: the table ``print(plan)`` shows, and the dump ``plan.write``
writes (the dump writer's ``blocks.md`` and ``timeline.svg``, and the schedule as text),
every one of them labelled as a prediction for the plan's hardware."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from ...planning.simulate import CallState, block_program, simulate_call
from ..dump.blocks_md import blocks_markdown
from ..dump.record import BlockRow, GraphDump, ResidentRow
from ..dump.svg import render_svg, resident_runs
from ..dump.timeline import Bar, Prediction, Timing

__all__ = ["format_bytes", "format_seconds", "plan_table", "write_plan"]


def format_bytes(n: float) -> str:
    """``"1.36 GiB (1,461,190,656 B)"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({int(n):,} B)"
    return f"{int(n):,} B"


def format_seconds(s: float) -> str:
    """Milliseconds below one second, seconds above."""
    return f"{s:,.2f} s" if s >= 1.0 else f"{s * 1e3:.1f} ms"


def _source(plan, name: str, width: int = 96) -> str:
    text = plan.hardware.source(name)
    return text if len(text) <= width else text[:width - 3] + "..."


def plan_table(plan) -> str:
    """The text of ``print(plan)``."""
    hw, dev = plan.hardware, plan.device_bytes
    n, r = len(plan.graph_blocks), len(plan.resident_blocks)
    largest = max(plan.block_bytes, default=0)
    terms = {"copy": sum(plan.h2d_s[i] for i in range(len(plan.h2d_s))
                         if i not in plan.resident_blocks),
             "gather": sum(plan.gather_s[i] for i in range(len(plan.gather_s))
                           if i not in plan.resident_blocks),
             "compute": sum(plan.compute_s)}
    rows = [
        ("model", plan.model),
        ("inputs", plan.inputs),
        ("hardware", f"{hw.name} (predicted: nothing here is measured on this machine)"),
        ("ranks", f"dp={plan.dp}, mode {plan.mode} ({plan.mode_reason})"),
        ("blocks", f"{plan.num_blocks} (largest {format_bytes(largest)})"
                   + (f"; the forward reads {n}" if n != plan.num_blocks else "")),
        ("resident blocks", f"{r} of {n}" + (f": {resident_runs(plan.resident_blocks)}"
                                               if r else "")),
        ("resident parameters", f"{len(plan.resident_parameters)}, "
                                f"{format_bytes(dev['resident parameters'])}"),
        ("slots", f"{plan.num_slots} x largest block = {format_bytes(plan.slot_bytes)}"),
        ("host bytes per rank", format_bytes(plan.host_bytes)),
        ("activation peak", format_bytes(plan.activation_peak)),
        ("device bytes", format_bytes(dev["total"]) + " = slots + resident parameters + "
                         "resident blocks + activation peak"),
        ("device memory", format_bytes(plan.capacity) if plan.capacity else "-"),
        ("fits", "yes" if plan.fits else "no"),
        ("FLOPs per step", f"{sum(plan.flops) / 1e12:,.2f} TFLOP ({sum(plan.flops):,})"),
        ("compute per step", format_seconds(terms["compute"])),
        ("copies per step", format_seconds(terms["copy"]) + " H2D, "
                            + format_seconds(terms["gather"]) + " AllGather (streamed blocks)"),
        ("predicted step", f"{format_seconds(plan.predicted_step_s)}, bound by {plan.bound}"),
        ("every block streamed", format_seconds(plan.streamed_step_s)),
        ("planned in", f"{plan.plan_s:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"dlo plan of {plan.model} for {hw.name}"]
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    lines.append("figures (per rank):")
    rates = ", ".join(f"{d} {v / 1e12:.1f} TFLOP/s" for d, v in hw.flops_per_s.items())
    lines += [f"  H2D {hw.h2d_gbps:.1f} GB/s  [{_source(plan, 'h2d_gbps')}]",
              f"  AllGather {hw.gather_gbps:.1f} GB/s  [{_source(plan, 'gather_gbps')}]",
              f"  matmul {rates}"]
    lines += [f"    {d}: [{_source(plan, 'flops_per_s.' + d)}]" for d in hw.flops_per_s]
    lines.append(f"  memory {format_bytes(hw.memory_bytes)}  [{_source(plan, 'memory_bytes')}]")
    if not hw.copies_overlap:
        lines.append("  copies run in turn with compute (no core or copy engine of their "
                     "own): each streamed block's copy adds to the step")
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def _dump(plan, folder: Path) -> GraphDump:
    streamed = [g for g in range(len(plan.graph_blocks)) if g not in plan.resident_blocks]
    host_of = {fqn: i for i, b in enumerate(plan.blocks) for fqn in b}
    share = plan.dp if plan.mode == "allgather" else 1
    rows = tuple(
        BlockRow(index=g, slot=j % plan.num_slots, fqns=plan.graph_blocks[g],
                 nbytes=plan.graph_block_bytes[g], slot_bytes=plan.graph_block_bytes[g],
                 shard_bytes=-(-plan.graph_block_bytes[g] // share),
                 host_block=host_of[plan.graph_blocks[g][0]],
                 reason=plan.block_ends[host_of[plan.graph_blocks[g][0]]])
        for j, g in enumerate(streamed))
    resident = tuple(ResidentRow(fqn, 0, "resident whatever the budget (offload's rules)")
                     for fqn in plan.resident_parameters)
    return GraphDump(index=0, folder=folder, mode=plan.mode, dp=plan.dp, rank=0,
                     num_slots=plan.num_slots, budget=max(plan.graph_block_bytes, default=0),
                     blocks=rows, resident=resident, program=(), budget_plan=plan.budget,
                     mode_reason=plan.mode_reason, predicted=plan.hardware.name)


def _prediction(plan) -> tuple[Prediction, list]:
    streamed = [g for g in range(len(plan.graph_blocks)) if g not in plan.resident_blocks]
    gather = plan.mode == "allgather" and plan.dp > 1
    program = block_program(plan.compute_s, streamed, plan.num_slots, gather=gather)
    steady = len(streamed) > plan.num_slots
    call = simulate_call(program, plan.h2d_s, plan.gather_s, CallState() if steady else None)
    if steady:
        call = simulate_call(program, plan.h2d_s, plan.gather_s, call.next_state)
    bars = tuple(Bar(s.kind, -1, s.start, s.end, s.wrap, resident_block=s.block)
                 if s.kind == "compute" and s.block in plan.resident_blocks
                 else Bar(s.kind, s.block, s.start, s.end, s.wrap) for s in call.spans)
    return Prediction(bars, call.end, call.stall_s, steady), program


def _schedule_text(plan, program) -> str:
    lines = [f"# The schedule dlo would run for {plan.model} on {plan.hardware.name} "
             "(predicted, block by block;",
             f"# a compile writes it into the graph: prefetch/wait/swap nodes, num_slots="
             f"{plan.num_slots})"]
    for e in program:
        what = f"{plan.graph_blocks[e.block][0]} .. {plan.graph_blocks[e.block][-1]}"
        if e.kind == "compute":
            kept = " (resident)" if e.block in plan.resident_blocks else ""
            lines.append(f"compute b{e.block}{kept}: {plan.flops[e.block] / 1e9:,.1f} GFLOP, "
                         f"{e.seconds * 1e3:.3f} ms  # {what}")
        else:
            wrap = " (wrap-around, for the next call)" if e.wrap else ""
            lines.append(f"{e.kind} b{e.block}{wrap}  # {plan.graph_block_bytes[e.block]:,} B")
    return "\n".join(lines) + "\n"


def write_plan(plan, folder: Union[str, os.PathLike]) -> Path:
    """Write ``blocks.md``, ``schedule.txt`` and ``timeline.svg`` of ``plan`` into
    ``folder`` (made where missing); ValueError naming the folder where it cannot."""
    folder = Path(folder)
    dump = _dump(plan, folder)
    prediction, program = _prediction(plan)
    timing = Timing(tuple(plan.h2d_s), tuple(plan.gather_s), tuple(plan.compute_s),
                    f"predicted for {plan.hardware.name}: H2D {plan.hardware.h2d_gbps:.1f} "
                    f"GB/s, compute {sum(plan.flops) / 1e12:.2f} TFLOP at the hardware's "
                    "matmul rates (nothing measured)")
    title = (f"dlo plan (predicted) of {plan.model} on {plan.hardware.name}: "
             f"{len(dump.blocks)} streamed blocks of {len(plan.graph_blocks)}, "
             f"{plan.num_slots} slots, "
             f"{plan.mode}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "blocks.md").write_text(blocks_markdown(dump))
        (folder / "schedule.txt").write_text(_schedule_text(plan, program))
        (folder / "timeline.svg").write_text(render_svg(dump, prediction, timing, title))
        (folder / "plan.txt").write_text(str(plan) + "\n")
    except OSError as exc:
        raise ValueError(f"dlo_fx.plan: cannot write the plan's dump to {folder}: {exc}; "
                         "give a writable folder") from exc
    return folder

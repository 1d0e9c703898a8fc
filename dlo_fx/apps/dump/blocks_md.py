"""``blocks.md``: the blocks of one graph, its resident set, and measured stalls."""

from __future__ import annotations

from typing import Optional

from .record import GraphDump
from .stalls import StallSummary

NO_TRACE = ("No traced run yet. Compile with `options={\"trace\": True}`, run the model,\n"
            "then call `dlo_fx.apps.dump.flush(model)` (it also runs when the process exits).")


def _b(n: int) -> str:
    return f"{n:,}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _resident_blocks(plan) -> list[str]:
    """The blocks the device budget keeps on the device, and why (none without it)."""
    if plan is None:
        return []
    lines = ["", "## Resident blocks (device_budget)", "",
             f"device_budget {_b(plan.device_budget)} B: minimum {_b(plan.minimum)} B (slots "
             f"for the largest block + parameters resident anyway), {_b(plan.capacity)} B "
             "left for whole blocks, chosen to minimise the predicted time per call (a steady",
             "call; equal choices spread through the stack so each resident block's compute",
             "runs while the next streamed block copies), from the "
             f"{plan.figures} figures",
             f"({plan.describe_rates()}). Predicted "
             f"{plan.streamed_s * 1e3:.3f} ms per call with every block streamed, "
             f"{plan.predicted_s * 1e3:.3f} ms with these resident.",
             *([f"Per call: copies {_ms(sum(plan.copy_s))} ms with every block streamed, "
                f"{_ms(plan.streamed_copy_s)} ms with these resident; compute "
                f"{_ms(plan.compute_total_s)} ms ({sum(plan.flops) / 1e9:.3g} GFLOP of "
                f"matmuls, attention and convolutions at the {plan.figures} matmul rate)."]
               if plan.copy_s else []),
             "Blocks are numbered before the resident ones are taken out.",
             *([""] + [f"device_budget='auto': {line}" for line in plan.budget_lines]
               if plan.budget_lines else []), ""]
    if not plan.resident:
        return lines + ["No block fits in what the budget leaves."]
    timed = len(plan.copy_s) == len(plan.block_bytes) == len(plan.compute_s)
    lines += ["| block | FQNs | bytes | copy ms (saved) | compute ms | why |",
              "| ---: | --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {g} | {plan.labels[g] if g < len(plan.labels) else ''} | "
              f"{_b(plan.block_bytes[g])} | {_ms(plan.copy_s[g]) if timed else ''} | "
              f"{_ms(plan.compute_s[g]) if timed else ''} | {plan.reasons[g]} |"
              for g in plan.resident]
    lines.append(f"| total ({len(plan.resident)} of {len(plan.block_bytes)}) | | "
                 f"{_b(plan.resident_bytes)} | "
                 + (f"{_ms(sum(plan.copy_s[g] for g in plan.resident))} | "
                    f"{_ms(sum(plan.compute_s[g] for g in plan.resident))} |" if timed
                    else " | |") + " |")
    return lines


def blocks_markdown(dump: GraphDump, stalls: Optional[StallSummary] = None) -> str:
    """The text of ``blocks.md``; ``stalls`` (per graph block) after a traced run."""
    blocks, resident = dump.blocks, dump.resident
    slot_bytes = max((b.slot_bytes for b in blocks), default=0)
    sharded = dump.mode == "allgather"
    head = (f"# Plan for {dump.predicted} (predicted): blocks and resident set"
            if dump.predicted else f"# Graph {dump.index}: blocks and resident set")
    lines = [
        head,
        "",
        f"- mode: {dump.mode}" + (f", rank {dump.rank} of a {dump.dp}-rank shard group"
                                   if sharded else "")
        + (f" (why: {dump.mode_reason})" if dump.mode_reason else ""),
        f"- slots: {dump.num_slots} x {_b(slot_bytes)} B = {_b(dump.num_slots * slot_bytes)} B "
        "on the device (block b lives in slot b % slots)",
        f"- block budget: {_b(dump.budget)} B",
        *([f"- layers: {dump.layers}"] if dump.layers else []),
        "",
        "## Blocks",
        "",
        "`bytes`: the block's parameters; `shard bytes`: what this rank keeps in host",
        "memory and copies to the device" + (" (the AllGather completes the rest)." if sharded
                                             else "."),
        "`ends because`: why the block closes there (whole layers up to the budget).",
        "",
        "| block | first FQN | last FQN | params | bytes | slot | shard bytes | ends because |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    if not blocks:
        lines.append("| | (this graph reads no streamed parameter) | | | | | | |")
    for b in blocks:
        lines.append(f"| {b.index} | {b.fqns[0]} | {b.fqns[-1]} | {len(b.fqns)} | "
                     f"{_b(b.nbytes)} | {b.slot} | {_b(b.shard_bytes)} | {b.reason} |")
    lines.append(f"| total | | | {sum(len(b.fqns) for b in blocks)} | "
                 f"{_b(sum(b.nbytes for b in blocks))} | | "
                 f"{_b(sum(b.shard_bytes for b in blocks))} | |")
    lines += _resident_blocks(dump.budget_plan)
    lines += ["", "## Resident set", ""]
    if resident:
        lines += ["| FQN | bytes | reason |", "| --- | ---: | --- |"]
        lines += [f"| {r.fqn} | {_b(r.nbytes)} | {r.reason} |" for r in resident]
        lines.append(f"| total ({len(resident)}) | {_b(sum(r.nbytes for r in resident))} | |")
    else:
        lines.append("Every parameter of this graph is streamed.")
    if dump.predicted:  # no run: its predicted stalls are in the timeline
        return "\n".join(lines) + "\n"
    lines += ["", "## Measured stalls", ""]
    if stalls is None or not stalls.waits:
        lines.append(NO_TRACE)
    else:
        lines.append("Time compute waited for each block (its `wait` spans in `trace.json`),")
        lines.append("summed over every traced call, largest first.")
        lines.append("")
        lines += stalls.lines()
    return "\n".join(lines) + "\n"

"""`dlo_fx.plan`: what a model will do on hardware one does not have, before it exists.

[Note: a plan is the run's own decisions on the target's numbers]
Every decision of a plan is the one `offload`/`load` and the compile make, called with the
target's figures instead of the planning machine's:

- the blocks: `loading.plan.split_params` on the module alone, as `dlo_fx.offload` and
  `dlo_fx.load` call it (a model built on the meta device is enough: only shapes and
  dtypes matter), laid out as the host store lays them out (`runtime.host.layout`:
  aligned tensors, shards of ``dp``), so slot and host bytes are the run's;
- the FLOPs of each block and the activation peak: one forward on the meta device at the
  given shapes (`forward.trace_forward`, [Note: a forward planned on the meta device]),
  counted by the compile's counter over the nodes each block spans;
- the mode: ``mode="auto"`` simulates both modes (`planning.modes.choose_mode`) with the
  hardware's H2D and gather rates where a run would probe them;
- the resident blocks: ``device_budget="auto"`` plans them for the hardware's memory
  (``device_memory`` where given) less the activation peak and the margin
  (`planning.device_memory.weights_budget`, then `replan`), an explicit budget as the
  compile does (`planning.budget.plan_resident_blocks`);
- the step time: the budget planner's steady call (`planning.budget.predict_call_s`).

Nothing is measured on the machine that plans, and no figure is called measured: each
carries the source its `Hardware` gives it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from ...config import DLOConfig
from ...loading.plan import Target, model_targets, split_params
from ...model.storage_dtype import mark_storage
from ...planning.budget import BudgetPlan, copy_seconds, minimum_bytes, plan_resident_blocks
from ...planning.device_memory import margin_bytes, replan, weights_budget
from ...planning.flops import graph_flops
from ...planning.modes import choose_mode
from ...planning.residency import Candidate, decide_residency
from ...planning.stages.resident_set import block_compute_seconds, block_spans
from ...runtime import ShardSpec, lay_out, storage_dtype_of
from .forward import trace_forward
from .hardware import Hardware, hardware_of

__all__ = ["Plan", "plan"]

Inputs = Union[torch.Tensor, tuple, list, Mapping[str, Any]]


@dataclass
class Plan:
    """A model planned for a hardware target (see [Note: a plan is the run's own decisions
    on the target's numbers]). Bytes are per rank; blocks are numbered in the order the
    forward first reads them (as a compile numbers them)."""

    model: str
    hardware: Hardware
    inputs: str  # the input shapes planned for
    dp: int
    mode: str
    mode_reason: str
    num_slots: int
    blocks: list[tuple[str, ...]]  # the FQNs of each block offload/load stores
    block_bytes: list[int]
    block_ends: list[str]  # why each block ends where it does
    graph_blocks: list[tuple[str, ...]]  # the compile's: the parameters of a block it reads
    graph_block_bytes: list[int]
    resident_blocks: list[int]  # graph blocks the device budget keeps on the device
    resident_parameters: list[str]  # resident whatever the budget (small, read late, ...)
    slot_bytes: int
    host_bytes: int  # this rank's share of the blocks in host memory
    device_bytes: dict[str, int]  # slots, resident parameters, resident blocks, activations
    activation_peak: int
    flops: list[int]  # of the nodes each graph block spans (as the rest: per graph block)
    h2d_s: list[float]
    gather_s: list[float]
    compute_s: list[float]
    predicted_step_s: float
    streamed_step_s: float  # every block streamed
    bound: str  # "copy", "gather" or "compute"
    capacity: Optional[int]  # the device bytes planned for (device_budget="auto")
    fits: bool
    notes: list[str] = field(default_factory=list)
    budget: Optional[BudgetPlan] = None
    plan_s: float = 0.0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def __str__(self) -> str:
        from .report import plan_table

        return plan_table(self)

    def write(self, folder: Union[str, os.PathLike]) -> str:
        """Write the plan's dump into ``folder``: ``blocks.md``, ``schedule.txt`` and
        ``timeline.svg`` (each labelled predicted); returns the folder."""
        from .report import write_plan

        return str(write_plan(self, folder))


def _split_inputs(inputs: Inputs) -> tuple[tuple, dict]:
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise ValueError(f"dlo_fx.plan: inputs={type(inputs).__name__} is not allowed: give the "
                     "forward's inputs as a tensor, a tuple of its positional arguments or a "
                     "dict of its keyword arguments (tensors meta or real)")


def _describe(args: tuple, kwargs: Mapping[str, Any]) -> str:
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
        return repr(v)

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()
                                      if isinstance(v, torch.Tensor)]
    return ", ".join(parts)


def _laid_out(block: list[Target], dp: int, alignment: int) -> ShardSpec:
    """The shard geometry the host store gives ``block`` (`HostStore.layout`)."""
    cursor = 0
    for t in block:
        _, cursor = lay_out(t.tensor, t.fqn, cursor, alignment, 0, 0,
                            storage_dtype_of(t.tensor))
    return ShardSpec.of(cursor, dp, alignment)


def _mode(config: DLOConfig, dp: int, sizes: list[int], hw: Hardware) -> tuple[str, str]:
    if dp == 1:
        return "rank_local", "one rank: nothing to gather"
    if config.mode in ("allgather", "rank_local"):
        return config.mode, f"mode={config.mode!r} given"
    if config.mode is None:
        return "allgather", f"mode=None with {dp} ranks"
    figures = {"h2d_gbps": hw.h2d_gbps, "gather_gbps": hw.gather_gbps,
               "host_ram": float("inf"), "device_memory": float(hw.memory_bytes)}
    mode, why = choose_mode(sizes, dp, config.num_slots, lambda: figures)
    return mode, why.replace("measured", f"{hw.name}'s")


def plan(model: nn.Module, inputs: Inputs, *, hardware: Union[str, Hardware, Mapping],
         options: Union[Mapping[str, Any], DLOConfig, None] = None, dp: int = 1) -> Plan:
    """Plan ``model`` at ``inputs``' shapes for ``hardware`` (a preset name of
    `dlo_fx.apps.plan.HARDWARE` or a `Hardware`), with the dlo ``options`` a run would
    have, on ``dp`` ranks. ``model`` may be built on the meta device (no weights); it is
    not changed (but for the storage-dtype mark where ``storage_dtype`` is given, as
    `dlo_fx.load` marks it). Returns a `Plan`; ``print(plan)`` prints its table,
    ``plan.write(folder)`` its dump. ValueError, naming what to fix, for bad input."""
    start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise ValueError(f"dlo_fx.plan takes a torch module (nn.Module), not a "
                         f"{type(model).__name__}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dlo_fx.plan: dp={dp!r} is not allowed: expected the number of "
                         "ranks, an int >= 1")
    config = DLOConfig.from_options(options)
    hw = hardware_of(hardware)
    args, kwargs = _split_inputs(inputs)
    if config.storage_dtype is not None:
        mark_storage(model, config.storage_dtype)
    params, _ = model_targets(model, None)
    split = split_params(params, config, (), "dlo_fx.plan")
    forward = trace_forward(model, args, kwargs)

    # the host blocks (offload's), in first-read order; blocks never read last
    def use(t: Target, pick: Any, uses: Mapping[str, int]) -> Optional[int]:
        found = [uses[fqn] for _, _, fqn in t.names if fqn in uses]
        return pick(found) if found else None

    host = split["blocks"]
    firsts = [min((f for t in b if (f := use(t, min, forward.first_use)) is not None),
                  default=None) for b in host]
    order = sorted(range(len(host)), key=lambda i: (firsts[i] is None, firsts[i] or 0, i))
    mode, mode_reason = _mode(config, dp, [sum(t.nbytes for t in host[i]) for i in order], hw)
    allgather = mode == "allgather" and dp > 1
    share = dp if allgather else 1

    # the compile's residency decision on the parameters the forward reads, in use order,
    # their blocks following the host blocks (`planning.stages.plan.form_blocks`)
    read = sorted((t for t in params if use(t, min, forward.first_use) is not None),
                  key=lambda t: (use(t, min, forward.first_use), use(t, max, forward.last_use)))
    host_of = {id(t): i for i, b in enumerate(host) for t in b}
    cands = [Candidate(t.fqn, 0 if t.tensor.numel() == 0 else t.nbytes,
                       first=use(t, min, forward.first_use), last=use(t, max, forward.last_use))
             for t in read]
    costs = graph_flops(forward.nodes)
    dtypes = sorted({d for n, d in costs if n}, key=str)
    figures = f"{hw.name} preset's" if isinstance(hardware, str) else "given"
    peak = (config.activation_reserve_bytes if config.activation_reserve_bytes is not None
            else forward.activation_peak)
    chosen: dict[str, Any] = {}

    def blocks_of(streamed: list[int], budget: int, layers: Any) -> list[list[int]]:
        groups: dict[Any, list[int]] = {}
        for i in streamed:
            groups.setdefault(host_of.get(id(read[i]), ("fresh", i)), []).append(i)
        return sorted(groups.values(), key=lambda g: min(cands[i].first for i in g))

    def choose(blocks: list[list[int]], reasons: list[Optional[str]]) -> dict[int, str]:
        sizes = [sum(cands[i].nbytes for i in b) for b in blocks]
        spans = block_spans([min(cands[i].first for i in b) for b in blocks],
                            len(forward.nodes))
        flops, compute_s = block_compute_seconds(costs, spans, hw.flops)
        copy_s = [copy_seconds(n, dp=dp, allgather=allgather, h2d_gbps=hw.h2d_gbps,
                               gather_gbps=hw.gather_gbps) for n in sizes]
        always = sum(c.nbytes for c, r in zip(cands, reasons) if r is not None)
        base = BudgetPlan(
            device_budget=0, minimum=minimum_bytes(sizes, config.num_slots, always),
            capacity=0, h2d_gbps=hw.h2d_gbps, gather_gbps=hw.gather_gbps,
            labels=[f"{cands[b[0]].name} .. {cands[b[-1]].name}" for b in blocks],
            fqns=[[cands[i].name for i in b] for b in blocks], copy_s=copy_s,
            compute_s=compute_s, flops=flops, figures=figures,
            copies_overlap=hw.copies_overlap,
            flops_per_s={str(d).removeprefix("torch."): hw.flops(d) for d in dtypes})
        # every block streamed, as the compile plans first (the auto budget re-plans it)
        base = plan_resident_blocks(sizes, copy_s, compute_s, num_slots=config.num_slots,
                                    capacity=0, plan=base)
        chosen.update(plan=_budget(config, hw, base, peak), sizes=sizes, always=always,
                      blocks=[[read[i] for i in b] for b in blocks])
        bp = chosen["plan"]
        return {g: bp.reasons[g] for g in bp.resident}

    decision = decide_residency(cands, resident_bytes=config.resident_bytes,
                                block_bytes=config.block_bytes, num_slots=config.num_slots,
                                blocks_of=blocks_of, choose_blocks=choose)
    if not chosen:  # nothing the forward reads is streamed
        choose([], decision.reasons)
    bp, graph_blocks = chosen["plan"], chosen["blocks"]
    sizes = chosen["sizes"]
    resident = list(bp.resident)
    streamed = [g for g in range(len(graph_blocks)) if g not in resident]
    kept = [c.name for c, r in zip(cands, decision.reasons)
            if r is not None and not r.startswith("device_budget")]
    kept_bytes = sum(c.nbytes for c, r in zip(cands, decision.reasons)
                     if r is not None and not r.startswith("device_budget"))
    # the slots hold the largest block stored, resident or not (`SlotMachine.fit_slots`)
    host_specs = [_laid_out(host[i], share, config.alignment) for i in order]
    slot = max((spec.padded_bytes for spec in host_specs), default=0)
    device = {"slots": config.num_slots * slot, "resident parameters": kept_bytes,
              "resident blocks": bp.resident_bytes, "activation peak": peak}
    device["total"] = sum(device.values())
    h2d_s = [n / share / (hw.h2d_gbps * 1e9) for n in sizes]
    gather_s = [n / share * (share - 1) / (hw.gather_gbps * 1e9) for n in sizes]
    notes = list(chosen.get("notes", []))
    capacity = config.device_memory or hw.memory_bytes
    fits = not bp.budget_lines or bp.device_budget >= bp.minimum
    if config.device_budget not in (None, "auto") and config.device_budget < bp.minimum:
        fits = False
        notes.append(f"device_budget={config.device_budget:,} B is below the minimum of "
                     f"{bp.minimum:,} B: the compile would raise ValueError")
    elif not fits:
        notes.append(f"does not fit: the weights need {bp.minimum:,} B on the device at "
                     f"least (num_slots={config.num_slots} slots of the largest block and "
                     f"{chosen['always']:,} B of resident parameters), the device leaves "
                     f"{bp.device_budget:,} B; lower num_slots or block_bytes, or plan for a "
                     "device with more memory")
    if fits and device["total"] + margin_bytes(peak) > capacity:
        fits = False
        notes.append(f"does not fit: {device['total']:,} B on the device plus a margin of "
                     f"{margin_bytes(peak):,} B exceed the {capacity:,} B of device memory")
    terms = {"copy": sum(h2d_s[g] for g in streamed),
             "gather": sum(gather_s[g] for g in streamed), "compute": sum(bp.compute_s)}
    if len(streamed) <= config.num_slots:  # nothing moves in a steady call
        terms["copy"] = terms["gather"] = 0.0
    unread = [i for i in order if firsts[i] is None]
    if unread:
        notes.append(f"{len(unread)} block(s) the forward never reads at these inputs "
                     "(stored, never copied)")
    return Plan(
        model=type(model).__name__, hardware=hw, inputs=_describe(args, kwargs), dp=dp,
        mode=mode, mode_reason=mode_reason, num_slots=config.num_slots,
        blocks=[tuple(t.fqn for t in host[i]) for i in order],
        block_bytes=[sum(t.nbytes for t in host[i]) for i in order],
        block_ends=[split["ends"][i] for i in order],
        graph_blocks=[tuple(t.fqn for t in b) for b in graph_blocks], graph_block_bytes=sizes,
        resident_blocks=resident, resident_parameters=kept, slot_bytes=config.num_slots * slot,
        host_bytes=sum(s.shard_bytes for s in host_specs), device_bytes=device,
        activation_peak=peak, flops=list(bp.flops), h2d_s=h2d_s, gather_s=gather_s,
        compute_s=list(bp.compute_s), predicted_step_s=bp.predicted_s,
        streamed_step_s=bp.streamed_s, bound=max(terms, key=lambda k: terms[k]),
        capacity=capacity, fits=fits, notes=notes, budget=bp,
        plan_s=time.perf_counter() - start)


def _budget(config: DLOConfig, hw: Hardware, base: BudgetPlan, peak: int) -> BudgetPlan:
    """The resident blocks of ``base`` as the compile chooses them on the target: the auto
    budget for its memory, an explicit budget, or none."""
    budget = config.device_budget
    if budget is None:
        return base
    if budget != "auto":
        return replan(base, budget, config.num_slots)
    capacity = config.device_memory or hw.memory_bytes
    weights = weights_budget(capacity, peak)
    how = ("activation_reserve_bytes" if config.activation_reserve_bytes is not None
           else "fake-tensor memory of one forward at these shapes")
    return replan(base, weights, config.num_slots, [
        f"device capacity {capacity:,} B - activation peak {peak:,} B ({how}) - margin "
        f"{margin_bytes(peak):,} B = weights budget {weights:,} B"])

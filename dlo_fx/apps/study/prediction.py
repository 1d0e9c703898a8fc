"""`predict`: evaluate the model for both modes; `recommend`: pick one and say why.

The recommendation first drops a mode that does not fit (device peak over HBM, or
physical host peak over host RAM) and names that term. When both fit it compares the
time per block term by term (compute, H2D, gather, lockstep, fixed issue cost, each as
it lands on the step) and names the term that separates them most. When the two times
are within `TIE_FRACTION`, the smaller host footprint decides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Union

from . import model
from ...planning.routes import RouteFigures, RouteInputs, all_to_all_bytes, choose_route, \
    route_costs
from .inputs import PlanInputs

TIE_FRACTION = 0.005
"""Block times closer than this share are treated as equal."""

TERMS = ("compute", "H2D", "gather", "lockstep", "fixed")
"""Names of the per-block time terms, as used in reasons."""


@dataclass(frozen=True)
class ModePrediction:
    """Predicted figures of one mode (sizes in GB, times in ms unless named _s)."""

    mode: str
    host_copies: float
    pinned_per_rank_gb: float
    pinned_total_gb: float
    cgroup_load_peak_gb: float
    host_physical_peak_gb: float
    device_peak_gb: float
    compute_ms: float
    h2d_ms: float
    gather_ms: float
    lockstep_ms: float
    fixed_ms: float
    bound: str
    """The largest of compute / H2D / gather: the term the block waits on."""
    contributions_ms: Mapping[str, float]
    """What each term adds to the block time (a hidden term adds its unhidden part)."""
    block_time_ms: float
    step_time_ms: float
    request_time_s: float
    requests_per_hour: float
    fits_host: bool
    fits_device: bool

    @property
    def fits(self) -> bool:
        """Whether both the host and the device peak fit."""
        return self.fits_host and self.fits_device


@dataclass(frozen=True)
class Prediction:
    """Both modes for one `PlanInputs`, and the recommended mode with its reason."""

    inputs: PlanInputs
    allgather: ModePrediction
    rank_local: ModePrediction
    mode: str
    reason: str
    routes: Mapping[str, RouteFigures] = dataclasses.field(default_factory=dict)
    """Every gather group of the topology, priced (`dlo_fx.planning.routes`)."""
    gather: str = ""
    """The gather group chosen: ``"sp"``, ``"dp"``, ``"world"`` or ``"none"`` (rank-local)."""
    gather_reason: str = ""

    def for_mode(self, mode: str) -> ModePrediction:
        """The prediction of ``"allgather"`` or ``"rank_local"``."""
        if mode not in model.MODES:
            raise ValueError(f"mode must be one of {model.MODES}, got {mode!r}")
        return getattr(self, mode)

    def to_dict(self) -> dict:
        """Plain data for JSON output."""
        out = dataclasses.asdict(self)
        out["inputs"]["world"] = self.inputs.world_size
        out["inputs"]["max_block_gb"] = self.inputs.block_gb
        out["inputs"]["host_h2d_gbps"] = self.inputs.host_bandwidth_gbps
        out["inputs"]["gather_group"] = self.inputs.gather_group
        for name in model.MODES:
            out[name]["fits"] = self.for_mode(name).fits
        return out


def fits(pred: ModePrediction) -> bool:
    """Whether a mode's peaks fit the host RAM and the HBM."""
    return pred.fits


def _mode(inputs: PlanInputs, values: Mapping[str, float], mode: str) -> ModePrediction:
    p = mode + "."
    ms = 1000.0
    compute = values["compute_time"] * ms
    h2d = values[p + "h2d_time"] * ms
    gather = values.get(p + "gather_time", 0.0) * ms
    lockstep = values.get(p + "lockstep_time", 0.0) * ms
    fixed = inputs.collective_overhead_ms if mode == "allgather" else inputs.copy_overhead_ms
    overlapped = {"compute": compute, "H2D": h2d, "gather": gather}
    bound = max(overlapped, key=lambda k: overlapped[k])
    leak = 1.0 - inputs.overlap_efficiency
    contributions = {k: (v if k == bound else leak * v) for k, v in overlapped.items()}
    contributions.update(lockstep=lockstep, fixed=fixed)
    block = values[p + "block_time"] * ms
    step = values[p + "step_time"] * ms
    request_s = step * inputs.steps / ms
    device = values[p + "device_peak"]
    physical = values[p + "host_physical_peak"]
    return ModePrediction(
        mode=mode,
        host_copies=values[p + "host_copies"],
        pinned_per_rank_gb=values[p + "pinned_per_rank"],
        pinned_total_gb=values[p + "pinned_total"],
        cgroup_load_peak_gb=values[p + "cgroup_load_peak"],
        host_physical_peak_gb=physical,
        device_peak_gb=device,
        compute_ms=compute,
        h2d_ms=h2d,
        gather_ms=gather,
        lockstep_ms=lockstep,
        fixed_ms=fixed,
        bound=bound,
        contributions_ms=contributions,
        block_time_ms=block,
        step_time_ms=step,
        request_time_s=request_s,
        requests_per_hour=inputs.dp * 3600.0 / request_s if request_s > 0 else float("inf"),
        fits_host=physical <= inputs.host_ram_gb,
        fits_device=device <= inputs.hbm_gb,
    )


def _misfits(inputs: PlanInputs, pred: ModePrediction) -> list[str]:
    out = []
    if not pred.fits_device:
        out.append(f"device peak: {pred.mode} needs {pred.device_peak_gb:.1f} GB > HBM {inputs.hbm_gb:.1f} GB")
    if not pred.fits_host:
        out.append(
            f"host memory: {pred.mode} needs {pred.host_physical_peak_gb:.1f} GB physical at load "
            f"> host RAM {inputs.host_ram_gb:.1f} GB"
        )
    return out


def _why(inputs: PlanInputs, pred: ModePrediction, term: str) -> str:
    state = ", the bound term" if pred.bound == term else f", {1 - inputs.overlap_efficiency:.0%} of it not hidden"
    g = inputs.gather_group
    if term == "H2D":
        rate = min(inputs.h2d_gbps, inputs.host_bandwidth_gbps / inputs.world_size)
        what = (
            f"{inputs.world_size} ranks each copy whole {inputs.block_gb:.2f} GB blocks"
            if pred.mode == "rank_local"
            else f"each rank copies a 1/{g} shard"
        )
        return f"{what} at {rate:.1f} GB/s{state}"
    if term == "gather":
        if pred.mode == "rank_local":
            return "no collective"
        return f"{g}-rank AllGather at {inputs.gather_gbps:.0f} GB/s{state}"
    if term == "lockstep":
        if pred.mode == "rank_local":
            return "replicas run independently"
        return f"each gathered block waits for the slowest of {inputs.dp} replicas"
    if term == "compute":
        return "the bound term" if pred.bound == term else "hidden"
    if pred.mode == "allgather":
        return "shard copy + collective issued per block"
    return "whole-block copy issued per block"


def _decide(inputs: PlanInputs, ag: ModePrediction, rl: ModePrediction) -> tuple[str, str]:
    bad = {m.mode: _misfits(inputs, m) for m in (ag, rl)}
    if bad["allgather"] and bad["rank_local"]:
        return "none", "neither mode fits: " + "; ".join(bad["allgather"] + bad["rank_local"])
    if bad["allgather"] or bad["rank_local"]:
        loser, winner = (ag, rl) if bad["allgather"] else (rl, ag)
        return winner.mode, "; ".join(bad[loser.mode]) + (
            f" (while {winner.mode} needs {winner.device_peak_gb:.1f} GB device, "
            f"{winner.host_physical_peak_gb:.1f} GB host)"
        )
    winner, loser = (ag, rl) if ag.block_time_ms <= rl.block_time_ms else (rl, ag)
    gap = loser.block_time_ms - winner.block_time_ms
    if gap <= TIE_FRACTION * winner.block_time_ms:
        tie = (
            f"step time within {TIE_FRACTION:.1%} (allgather {ag.block_time_ms:.2f} vs rank_local "
            f"{rl.block_time_ms:.2f} ms/block); "
        )
        host_gap = abs(ag.host_physical_peak_gb - rl.host_physical_peak_gb)
        if host_gap > TIE_FRACTION * max(ag.host_physical_peak_gb, rl.host_physical_peak_gb):
            small, big = sorted((ag, rl), key=lambda m: m.host_physical_peak_gb)
            return small.mode, tie + (
                f"host memory decides: {big.mode} needs {big.host_physical_peak_gb:.1f} GB physical "
                f"at load vs {small.mode} {small.host_physical_peak_gb:.1f} GB"
            )
        if abs(ag.device_peak_gb - rl.device_peak_gb) > 1e-9:
            small, big = sorted((ag, rl), key=lambda m: m.device_peak_gb)
            return small.mode, tie + (
                f"device peak decides: {big.mode} needs {big.device_peak_gb:.2f} GB vs "
                f"{small.mode} {small.device_peak_gb:.2f} GB"
            )
        return winner.mode, tie + f"no term separates them; {winner.mode} is marginally faster"
    diffs = {t: loser.contributions_ms[t] - winner.contributions_ms[t] for t in TERMS}
    term = max(TERMS, key=lambda t: diffs[t])
    return winner.mode, (
        f"step time: {term} term dominates {loser.mode} "
        f"({loser.contributions_ms[term]:.2f} ms/block: {_why(inputs, loser, term)}) vs {winner.mode} "
        f"({winner.contributions_ms[term]:.2f} ms/block: {_why(inputs, winner, term)}); "
        f"{winner.mode} {winner.block_time_ms:.2f} vs {loser.mode} {loser.block_time_ms:.2f} ms/block "
        f"({gap / loser.block_time_ms:.1%} less time)"
    )


def predict(inputs: PlanInputs) -> Prediction:
    """Evaluate the model for both modes and recommend one."""
    if not isinstance(inputs, PlanInputs):
        raise TypeError(f"predict() takes PlanInputs, got {type(inputs).__name__}")
    values = model.evaluate(
        inputs.symbol_values(),
        fixed={"world": inputs.world_size, "gather_group": inputs.gather_group},
    )
    ag = _mode(inputs, values, "allgather")
    rl = _mode(inputs, values, "rank_local")
    mode, reason = _decide(inputs, ag, rl)
    routes = route_inputs(inputs)
    costs = route_costs(routes)
    gather, why = choose_route(routes, costs)
    return Prediction(inputs=inputs, allgather=ag, rank_local=rl, mode=mode, reason=reason,
                      routes=costs, gather=gather, gather_reason=why)


def route_inputs(inputs: PlanInputs) -> RouteInputs:
    """The numbers of ``inputs`` in the units of `dlo_fx.planning.routes` (the sequence-
    parallel all-to-all of one block from ``tokens``, ``heads`` and ``head_dim``)."""
    i, gb, ms = inputs, 1e9, 1e-3
    a2a = i.attention_layers * all_to_all_bytes(i.tokens, i.heads, i.head_dim,
                                                i.activation_bytes, i.sp)
    return RouteInputs(
        dp=i.dp, sp=i.sp, model_bytes=i.model_gb * gb, block_bytes=i.block_gb * gb,
        blocks=i.blocks, block_compute_s=i.block_compute_ms * ms, h2d_Bps=i.h2d_gbps * gb,
        link_Bps=i.gather_gbps * gb, host_ram_bytes=i.host_ram_gb * gb,
        host_h2d_Bps=i.host_bandwidth_gbps * gb, sp_serial_fraction=i.sp_serial_fraction,
        overlap_efficiency=i.overlap_efficiency, lockstep_fraction=i.lockstep_fraction,
        copy_overhead_s=i.copy_overhead_ms * ms,
        collective_overhead_s=i.collective_overhead_ms * ms, all_to_all_bytes=a2a)


def recommend(what: Union[PlanInputs, Prediction]) -> tuple[str, str]:
    """``(mode, reason)`` for a `PlanInputs` or an existing `Prediction`.

    ``mode`` is ``"allgather"``, ``"rank_local"`` or ``"none"`` when neither fits; the
    reason names the deciding term and its figures.
    """
    pred = what if isinstance(what, Prediction) else predict(what)
    return pred.mode, pred.reason

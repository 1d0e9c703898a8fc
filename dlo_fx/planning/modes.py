"""The two streaming modes of one plan, predicted: ``mode="auto"``'s choice, and the
weight bytes `memory_report` prints beside the measured ones.

`predict_modes` runs the schedule simulator (`dlo_fx.planning.simulate`) on the plan's
blocks in each mode: ``allgather`` copies this rank's ``1/dp`` shard of a block and
completes it with an AllGather on a lane of its own; ``rank_local`` copies whole blocks
and gathers nothing. `decide` drops a mode whose bytes do not fit (slots over the device
memory, the host copies of every rank over the host RAM), then takes the faster steady
call; calls within `TIE_FRACTION` of each other go to the smaller host footprint
(allgather's). The planning study (``dlo-fx plan``, `dlo_fx.apps.study`) models the same
two modes symbolically, with the load-time and lockstep terms a run cannot measure; the
library never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .simulate import block_program, simulate_call

__all__ = ["ModeFigures", "TIE_FRACTION", "choose_mode", "decide", "predict_modes",
           "predicted_weight_bytes", "weight_bytes"]

GB = 1e9
TIE_FRACTION = 0.005
"""Steady calls closer than this share are treated as equal (as the study does)."""


@dataclass(frozen=True)
class ModeFigures:
    """One mode of a plan: bytes per rank and the simulated steady call."""

    mode: str
    host_shard_bytes: int
    """Host bytes of the blocks on one rank: ``ceil(bytes / dp)`` of each block, or every
    block whole in rank-local mode."""
    host_bytes: int
    """Host bytes of the blocks on all ``dp`` ranks together."""
    slot_bytes: int
    """``num_slots`` slots of the largest block."""
    call_s: float
    """Simulated steady call (compute taken as the blocks' ``compute_s``)."""


def weight_bytes(mode: str, block_bytes: Sequence[int], dp: int,
                 num_slots: int) -> tuple[int, int]:
    """(host shard bytes per rank, slot bytes) of ``mode``."""
    if mode not in ("allgather", "rank_local"):
        raise ValueError(f"mode must be 'allgather' or 'rank_local', got {mode!r}")
    share = dp if mode == "allgather" else 1
    host = sum(-(-n // share) for n in block_bytes)
    return host, num_slots * max(block_bytes, default=0)


def predict_modes(block_bytes: Sequence[int], *, dp: int, num_slots: int, h2d_gbps: float,
                  gather_gbps: float, compute_s: Sequence[float] = ()
                  ) -> dict[str, ModeFigures]:
    """Both modes of a plan of ``block_bytes`` (every block streamed) over ``dp`` ranks."""
    compute = list(compute_s) or [0.0] * len(block_bytes)
    streamed = list(range(len(block_bytes)))
    out = {}
    for mode in ("allgather", "rank_local"):
        host, slots = weight_bytes(mode, block_bytes, dp, num_slots)
        gather = mode == "allgather" and dp > 1
        share = dp if gather else 1
        h2d_s = [n / share / (h2d_gbps * GB) for n in block_bytes]
        gather_s = [n / share * (dp - 1) / (gather_gbps * GB) if gather else 0.0
                    for n in block_bytes]
        program = block_program(compute, streamed, num_slots, gather=gather)
        call = simulate_call(program, h2d_s, gather_s)
        if len(streamed) > num_slots:  # a steady call of the loop
            call = simulate_call(program, h2d_s, gather_s, call.next_state)
        out[mode] = ModeFigures(mode, host, host * (1 if mode == "allgather" else dp), slots,
                                call.compute_end)
    return out


def _misfit(f: ModeFigures, host_ram: int, device_memory: int) -> list[str]:
    out = []
    if f.slot_bytes > device_memory:
        out.append(f"device: {f.mode} needs {f.slot_bytes / GB:.3f} GB of slots > "
                   f"{device_memory / GB:.3f} GB")
    if f.host_bytes > host_ram:
        out.append(f"host memory: {f.mode} needs {f.host_bytes / GB:.3f} GB of host shards "
                   f"over the ranks > host RAM {host_ram / GB:.3f} GB")
    return out


def decide(figures: dict[str, ModeFigures], *, host_ram: int,
           device_memory: int) -> tuple[str, str]:
    """The mode to run, and why (see the module docstring)."""
    ag, rl = figures["allgather"], figures["rank_local"]
    bad = {f.mode: _misfit(f, host_ram, device_memory) for f in (ag, rl)}
    if bad["allgather"] and bad["rank_local"]:  # run anyway: the smaller host footprint
        return "allgather", "neither mode fits: " + "; ".join(bad["allgather"] + bad["rank_local"])
    if bad["allgather"] or bad["rank_local"]:
        loser, winner = (ag, rl) if bad["allgather"] else (rl, ag)
        return winner.mode, "; ".join(bad[loser.mode])
    winner, loser = (ag, rl) if ag.call_s <= rl.call_s else (rl, ag)
    times = (f"allgather {ag.call_s * 1e3:.3f} vs rank_local {rl.call_s * 1e3:.3f} ms per "
             "simulated steady call")
    if loser.call_s - winner.call_s <= TIE_FRACTION * winner.call_s:
        if ag.host_bytes != rl.host_bytes:
            small, big = sorted((ag, rl), key=lambda f: f.host_bytes)
            return small.mode, (f"step time within {TIE_FRACTION:.1%} ({times}); host memory "
                                f"decides: {big.mode} needs {big.host_bytes / GB:.3f} GB of "
                                f"host shards vs {small.mode} {small.host_bytes / GB:.3f} GB")
        return winner.mode, f"step time within {TIE_FRACTION:.1%} ({times})"
    gap = (loser.call_s - winner.call_s) / loser.call_s
    return winner.mode, f"step time: {times} ({gap:.1%} less time)"


def choose_mode(block_bytes: Sequence[int], dp: int, num_slots: int,
                measure: Callable[[], Mapping[str, float]]) -> tuple[str, str]:
    """The mode ``mode="auto"`` runs, and why: both modes simulated with the figures
    ``measure()`` returns (`dlo_fx.runtime.probes.machine_figures`: a collective probe
    on the shard group, called only when there is something to gather)."""
    if dp == 1:
        return "rank_local", "one rank in the shard group: nothing to gather"
    m = measure()
    h2d, gather = m["h2d_gbps"], m["gather_gbps"]
    figures = predict_modes(block_bytes, dp=dp, num_slots=num_slots, h2d_gbps=h2d,
                            gather_gbps=min(gather, 1e6))
    mode, why = decide(figures, host_ram=int(m["host_ram"]),
                       device_memory=int(m["device_memory"]))
    reason = (f"{why} [measured H2D {h2d:.2f} GB/s, AllGather {gather:.2f} GB/s per "
              f"rank; {len(block_bytes)} blocks, {sum(block_bytes) / GB:.3f} GB, dp={dp}]")
    return mode, reason


def predicted_weight_bytes(mode: str, block_bytes: Sequence[int], dp: int,
                           num_slots: int) -> dict[str, int]:
    """The plan's host bytes per rank and slot bytes, which `memory_report` prints beside
    the measured ones."""
    host, slots = weight_bytes(mode, block_bytes, dp, num_slots)
    return {"host_shard_bytes": host, "slot_bytes": slots}  # no activations, no residents

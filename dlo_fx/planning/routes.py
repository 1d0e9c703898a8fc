"""The gather group of a topology, predicted: which ranks share each block's host copy.

A topology of ``dp`` replicas of ``sp`` sequence-parallel ranks can gather each block over
one of four groups (the engine's ``gather`` choices, [Note: the gather group of a
topology] in apps/engine/topology.py): ``"sp"``, a replica's ranks; ``"dp"``, one rank
per replica; ``"world"``, every rank; ``"none"``, rank-local (no gather). `route_costs`
prices each on numbers alone and `choose_route` picks one and says why; ``dlo-fx plan``
prints both, and the engine's ``gather="auto"`` takes the choice where it is given the
figures (``Engine(plan=...)``).

[Note: the routes' cost model]
Per block, per denoising step, per rank (B: the block's bytes; g: the group's size):

- compute ``t_c = t_1 (alpha + (1 - alpha) / sp)``: the block's time for one request on
  one device, of which the share ``alpha`` is not split by sequence parallelism. A
  measured (or calibrated) ``t_1`` already holds the block's all-to-all time.
- the sequence-parallel all-to-all (Ulysses): before each attention a rank holds q, k and
  v for ``tokens / sp`` tokens and all heads, after it the output; each of the four is
  re-split so that (sp - 1)/sp of it leaves the rank (`all_to_all_bytes`), on the device
  links: ``t_a2a``.
- H2D of the rank's share, ``B / g``, at the link's rate or the host's aggregate rate
  shared by every rank, whichever is lower: ``t_h2d``.
- the AllGather, each rank receiving ``(g - 1) / g x B`` (`allgather_bytes`) on the same
  device links as the all-to-all: the links are busy ``t_gather + t_a2a`` per block.
- lock-step: a group spanning replicas (``"dp"``, ``"world"`` with dp > 1) makes each
  gathered block wait for the slowest of the dp replicas, ``kappa x t_c x (dp - 1) / dp``;
  ``"sp"`` couples nothing new (its ranks compute one request in lock-step already), and
  ``"none"`` nothing at all.
- block time ``= max(t_c, t_h2d, t_gather + t_a2a) + (1 - omega) x (t_c + t_h2d +
  t_gather - max(t_c, t_h2d, t_gather)) + lock-step + the fixed issue cost``: the bound
  term, the share ``1 - omega`` of the hidden transfers that still lands on the step, the
  waits. Without an all-to-all it is the planning study's block time term by term (a test
  holds them equal, for both modes); the all-to-all lengthens only a block whose links it
  makes the bound.
- host bytes per rank ``ceil(model bytes / g)``; the node holds ``world`` of them.

`choose_route` drops a route whose host bytes (every rank of the node) exceed the host's
RAM, then takes the shortest block; within `TIE_FRACTION` the smaller host share wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["ROUTES", "RouteFigures", "RouteInputs", "TIE_FRACTION", "all_to_all_bytes",
           "allgather_bytes", "choose_route", "group_size", "host_bytes_per_rank",
           "route_costs"]

GB = 1e9
ROUTES = ("sp", "dp", "world", "none")
"""The gather groups, in the order ties and reports list them."""
TIE_FRACTION = 0.005
"""Block times closer than this share are treated as equal (as the study does)."""


def all_to_all_bytes(tokens: int, heads: int, head_dim: int, dtype_bytes: int,
                     sp: int) -> float:
    """Bytes one rank sends in the all-to-alls of one attention layer split over ``sp``
    ranks (Ulysses): q, k, v before it and the output after it, each ``tokens / sp x
    heads x head_dim`` elements on the rank, ``(sp - 1) / sp`` of which leave it."""
    if sp <= 1:
        return 0.0
    return 4.0 * tokens / sp * heads * head_dim * dtype_bytes * (sp - 1) / sp


def allgather_bytes(block_bytes: float, group: int) -> float:
    """Bytes one rank receives gathering a block of ``block_bytes`` over ``group`` ranks,
    each holding ``1 / group`` of it."""
    return block_bytes * (group - 1) / group if group > 1 else 0.0


def host_bytes_per_rank(model_bytes: float, group: int) -> float:
    """Host bytes of the blocks on one rank when ``group`` ranks share one copy."""
    return -(-model_bytes // group)


def group_size(route: str, dp: int, sp: int) -> int:
    """Ranks of ``route``'s gather group at ``dp x sp``."""
    sizes = {"sp": sp, "dp": dp, "world": dp * sp, "none": 1}
    if route not in sizes:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    return sizes[route]


@dataclass(frozen=True)
class RouteInputs:
    """The numbers of one topology, model and node (bytes, seconds, bytes per second)."""

    dp: int
    sp: int
    model_bytes: float
    """Bytes of the streamed blocks (one host copy)."""
    block_bytes: float
    """Bytes of the largest block."""
    blocks: int
    """Blocks per step."""
    block_compute_s: float
    """One block, one request, one device (``t_1``); it holds the all-to-all's time."""
    h2d_Bps: float
    """Host-to-device bandwidth of one device's link."""
    link_Bps: float
    """Device-to-device bandwidth per rank (the links the gather and the all-to-all share)."""
    host_ram_bytes: float
    host_h2d_Bps: Optional[float] = None
    """The host's aggregate host-to-device bandwidth; ``None``: every link at full rate."""
    sp_serial_fraction: float = 0.0
    overlap_efficiency: float = 1.0
    lockstep_fraction: float = 0.0
    copy_overhead_s: float = 0.0
    """Fixed cost of issuing one rank-local block copy."""
    collective_overhead_s: float = 0.0
    """Fixed cost of issuing one shard copy and its gather."""
    all_to_all_bytes: float = 0.0
    """Bytes one rank sends in one block's all-to-alls (`all_to_all_bytes` times the
    block's attention layers); 0 where the model's sequence is not split."""

    def __post_init__(self) -> None:
        for name in ("dp", "sp", "blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RouteInputs.{name}={value!r}: expected an integer >= 1")
        for name in ("model_bytes", "block_bytes", "h2d_Bps", "link_Bps", "host_ram_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RouteInputs.{name}={getattr(self, name)!r}: expected > 0")

    @property
    def world(self) -> int:
        return self.dp * self.sp


@dataclass(frozen=True)
class RouteFigures:
    """One gather group, priced (seconds per block, bytes per rank)."""

    route: str
    group: int
    host_bytes_per_rank: float
    host_bytes: float
    """Every rank of the node together."""
    compute_s: float
    h2d_s: float
    gather_s: float
    all_to_all_s: float
    lockstep_s: float
    fixed_s: float
    bound: str
    """The term the block waits on: ``compute``, ``H2D`` or ``links`` (gather + all-to-all)."""
    block_s: float
    fits_host: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _price(route: str, i: RouteInputs) -> RouteFigures:
    g = group_size(route, i.dp, i.sp)
    per_rank = min(i.h2d_Bps, (i.host_h2d_Bps or i.world * i.h2d_Bps) / i.world)
    compute = i.block_compute_s * (i.sp_serial_fraction + (1 - i.sp_serial_fraction) / i.sp)
    h2d = i.block_bytes / g / per_rank
    gather = allgather_bytes(i.block_bytes, g) / i.link_Bps
    a2a = i.all_to_all_bytes / i.link_Bps
    spans_replicas = route in ("dp", "world") and i.dp > 1
    lockstep = i.lockstep_fraction * compute * (i.dp - 1) / i.dp if spans_replicas else 0.0
    fixed = i.collective_overhead_s if g > 1 else i.copy_overhead_s
    terms = {"compute": compute, "H2D": h2d, "links": gather + a2a}
    bound = max(terms, key=lambda k: terms[k])
    hidden = compute + h2d + gather - max(compute, h2d, gather)
    block = terms[bound] + (1 - i.overlap_efficiency) * hidden + lockstep + fixed
    host = host_bytes_per_rank(i.model_bytes, g)
    return RouteFigures(route, g, host, host * i.world, compute, h2d, gather, a2a, lockstep,
                        fixed, bound, block, host * i.world <= i.host_ram_bytes)


def route_costs(inputs: RouteInputs) -> dict[str, RouteFigures]:
    """Every distinct gather group of the topology, priced (see [Note: the routes' cost
    model]). A group equal to another is listed once, under the first name of `ROUTES`
    (at dp 1 ``"world"`` is ``"sp"``; at sp 1 ``"dp"`` and ``"world"`` are one group,
    listed as ``"dp"``); a group of one rank is ``"none"``."""
    out: dict[str, RouteFigures] = {}
    seen: set[int] = set()
    for route in ROUTES:
        g = group_size(route, inputs.dp, inputs.sp)
        if route != "none" and (g == 1 or g in seen):
            continue
        seen.add(g)
        out[route] = _price(route, inputs)
    return out


def choose_route(inputs: RouteInputs,
                 costs: Optional[Mapping[str, RouteFigures]] = None) -> tuple[str, str]:
    """The gather group to run, and why (see [Note: the routes' cost model])."""
    costs = dict(costs or route_costs(inputs))
    fit = {r: f for r, f in costs.items() if f.fits_host}
    dropped = [f"{r} needs {f.host_bytes / GB:.1f} GB of host shards on the node > "
               f"host RAM {inputs.host_ram_bytes / GB:.1f} GB"
               for r, f in costs.items() if not f.fits_host]
    if not fit:  # run anyway: the smallest host footprint
        best = min(costs.values(), key=lambda f: f.host_bytes)
        return best.route, "no route fits the host: " + "; ".join(dropped)
    ranked = sorted(fit.values(), key=lambda f: f.block_s)
    best = ranked[0]
    times = ", ".join(f"{f.route} {f.block_s * 1e3:.2f}" for f in ranked)
    tied = [f for f in ranked if f.block_s - best.block_s <= TIE_FRACTION * best.block_s]
    if len(tied) > 1:
        best = min(tied, key=lambda f: f.host_bytes_per_rank)
        why = (f"block times within {TIE_FRACTION:.1%} ({times} ms/block); the smaller host "
               f"share decides: {best.host_bytes_per_rank / GB:.2f} GB per rank")
    else:
        runner = ranked[1] if len(ranked) > 1 else None
        why = f"shortest block ({times} ms/block)"
        if runner is not None:
            why += (f"; {runner.route} loses on {_loss(best, runner)}")
    if dropped:
        why += "; dropped: " + "; ".join(dropped)
    return best.route, f"{why} [dp={inputs.dp} x sp={inputs.sp}, bound by {best.bound}]"


def _loss(best: RouteFigures, other: RouteFigures) -> str:
    """The term that separates ``other`` from ``best`` most, in words."""
    gaps = {"its copies (H2D)": other.h2d_s - best.h2d_s,
            "the lock-step of its replicas": other.lockstep_s - best.lockstep_s,
            "its gather and all-to-all on the links": (other.gather_s + other.all_to_all_s)
            - (best.gather_s + best.all_to_all_s)}
    term = max(gaps, key=lambda k: gaps[k])
    return f"{term}, +{gaps[term] * 1e3:.2f} ms/block"

"""The symbolic memory and timing model of the two streaming modes.

The model is an ordered list of `Definition`s: each names one quantity, gives it a
symbol and a sympy expression over the input symbols (`symbols.py`) and the symbols of
earlier definitions. `formulas()` prints them; `evaluate()` substitutes numbers.

Modes. ``allgather``: the ``g`` ranks of a gather group share one host copy of the
blocks, each pinning ``1/g`` of every block; a block reaches the device as a shard-sized
H2D copy and is completed by an AllGather over the device links. ``rank_local``: every
rank pins the whole model and copies whole blocks; no collective.

Time per block. Both modes run the next block's transfer while the current block
computes, so a block costs the largest of its terms (compute, H2D, gather). Overlap is
not perfect: a share ``1 - omega`` of each hidden term still lands on the step (the
copy engines compete with compute for memory bandwidth). Gathering a block is also a
barrier across the ``dp`` replicas, each running its own request: the block waits for
the slowest of them, a cost modelled as ``kappa_lock`` times the compute, scaled by
``(dp - 1) / dp`` (nothing to wait for with one replica). Fixed per-block issue costs
are added last.

Host memory at load. Ranks map the checkpoint through one shared page cache
(``phi_cache`` of it resident and charged), stage their shards privately before
pinning (``sigma_stage`` per host copy), and carry a framework overhead each. Pinned
memory is seen by the cgroup in the proportion ``psi_pin`` (0 where the accelerator
driver allocates it outside the cgroup, as on Ascend; 1 on CUDA); total physical
memory is what the cgroup sees plus the pinned memory it does not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Sequence

import sympy

from . import symbols as s

Style = Literal["str", "latex", "pretty"]
MODES = ("allgather", "rank_local")


@dataclass(frozen=True)
class Definition:
    """One modelled quantity: ``lhs = rhs``."""

    key: str
    lhs: sympy.Symbol
    rhs: sympy.Expr
    meaning: str
    unit: str


def _out(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, nonnegative=True, real=True)


def _block_time(terms: Sequence[sympy.Expr], extra: sympy.Expr) -> sympy.Expr:
    bound = sympy.Max(*terms)
    return bound + (1 - s.omega) * (sympy.Add(*terms) - bound) + extra


def _mode_definitions(mode: str) -> list[Definition]:
    tag = "ag" if mode == "allgather" else "rl"
    copies = _out(f"C^{tag}")
    pinned = _out(f"P_rank^{tag}")
    pinned_total = _out(f"P_total^{tag}")
    cgroup = _out(f"H_cg^{tag}")
    physical = _out(f"H_phys^{tag}")
    device = _out(f"D^{tag}")
    t_h2d = _out(f"t_h2d^{tag}")
    t_block = _out(f"t_blk^{tag}")
    step = _out(f"T_step^{tag}")
    p = f"{mode}."
    if mode == "allgather":
        t_gather = _out("t_gather^ag")
        t_lock = _out("t_lock^ag")
        copies_rhs = s.W / s.g
        pinned_rhs = s.M / s.g
        device_rhs = s.R + s.A + s.S * s.B + s.G * s.B / s.g
        h2d_rhs = s.B / (s.g * s.b_rank)
        timing = [
            Definition(p + "h2d_time", t_h2d, h2d_rhs, "H2D time of one block's shard per rank", "s"),
            Definition(
                p + "gather_time",
                t_gather,
                (s.g - 1) * s.B / (s.g * s.b_gather),
                "AllGather time of one block (each rank receives (g-1)/g of it)",
                "s",
            ),
            Definition(
                p + "lockstep_time",
                t_lock,
                s.kappa * s.t_c * (s.dp - 1) / s.dp,
                "per-block wait for the slowest of the dp replicas at the gather",
                "s",
            ),
            Definition(
                p + "block_time",
                t_block,
                _block_time([s.t_c, t_h2d, t_gather], t_lock + s.f_coll),
                "time per block: the bound term, overlap leakage, lockstep, issue cost",
                "s",
            ),
        ]
    else:
        copies_rhs = s.W
        pinned_rhs = s.M
        device_rhs = s.R + s.A + s.S * s.B
        timing = [
            Definition(p + "h2d_time", t_h2d, s.B / s.b_rank, "H2D time of one whole block per rank", "s"),
            Definition(
                p + "block_time",
                t_block,
                _block_time([s.t_c, t_h2d], s.f_copy),
                "time per block: the bound term, overlap leakage, issue cost",
                "s",
            ),
        ]
    memory = [
        Definition(p + "host_copies", copies, copies_rhs, "host copies of the blocks on the host", "1"),
        Definition(p + "pinned_per_rank", pinned, pinned_rhs, "pinned host bytes per rank", "GB"),
        Definition(p + "pinned_total", pinned_total, s.W * pinned, "pinned host bytes of all ranks", "GB"),
        Definition(
            p + "cgroup_load_peak",
            cgroup,
            s.phi * s.M + s.sigma * copies * s.M + s.W * s.O_rank + s.psi * pinned_total,
            "cgroup-visible host peak while loading",
            "GB",
        ),
        Definition(
            p + "host_physical_peak",
            physical,
            cgroup + (1 - s.psi) * pinned_total,
            "physical host memory at the load peak (cgroup-visible + pinned the cgroup misses)",
            "GB",
        ),
        Definition(p + "device_peak", device, device_rhs, "device memory peak per rank", "GB"),
    ]
    total = [Definition(p + "step_time", step, s.L * t_block, "time of one denoising step", "s")]
    return memory + timing + total


COMMON_DEFINITIONS: tuple[Definition, ...] = (
    Definition("world", s.W, s.dp * s.sp, "ranks on the host", "1"),
    Definition(
        "gather_group",
        s.g,
        sympy.Piecewise((s.dp, s.dp > 1), (s.sp, True)),
        "gather group: the DP group, or the SP group when dp = 1 (gather_over='world' uses W)",
        "1",
    ),
    Definition(
        "h2d_bandwidth_per_rank",
        s.b_rank,
        sympy.Min(s.b_link, s.b_host / s.W),
        "H2D bandwidth per rank when all W ranks copy at once",
        "GB/s",
    ),
    Definition(
        "compute_time",
        s.t_c,
        s.t_1 * (s.alpha + (1 - s.alpha) / s.sp),
        "compute time of one block on one rank of an SP group",
        "s",
    ),
)

DEFINITIONS: tuple[Definition, ...] = (
    COMMON_DEFINITIONS + tuple(_mode_definitions("allgather")) + tuple(_mode_definitions("rank_local"))
)
"""Every modelled quantity, in evaluation order."""

_BY_KEY = {d.key: d for d in DEFINITIONS}


def definition(key: str) -> Definition:
    """Look a definition up by key, e.g. ``"allgather.device_peak"``."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise ValueError(f"unknown formula key {key!r}; known keys: {', '.join(_BY_KEY)}") from None


def expression(key: str, expand: bool = False) -> sympy.Expr:
    """The right-hand side of a definition; with ``expand`` the earlier definitions it
    refers to are substituted in, leaving only input symbols."""
    expr = definition(key).rhs
    if not expand:
        return expr
    for d in reversed(DEFINITIONS[: DEFINITIONS.index(_BY_KEY[key])]):
        expr = expr.subs(d.lhs, d.rhs)
    return expr


def _render(expr: sympy.Expr, style: Style) -> str:
    if style == "latex":
        return sympy.latex(expr)
    if style == "pretty":
        return sympy.pretty(expr, use_unicode=False)
    if style == "str":
        return sympy.sstr(expr)
    raise ValueError(f"style must be 'str', 'latex' or 'pretty', got {style!r}")


def formulas(style: Style = "str") -> dict[str, str]:
    """Every definition printed as ``lhs = rhs`` in the given sympy style."""
    sep = " = "
    return {d.key: _render(d.lhs, style) + sep + _render(d.rhs, style) for d in DEFINITIONS}


@functools.lru_cache(maxsize=None)
def _compiled() -> tuple[tuple[Definition, tuple[sympy.Symbol, ...], Callable[..., float]], ...]:
    out = []
    for d in DEFINITIONS:
        args = tuple(sorted(d.rhs.free_symbols, key=lambda x: x.name))
        out.append((d, args, sympy.lambdify(args, d.rhs, modules="math")))
    return tuple(out)


def evaluate(values: Mapping[sympy.Symbol, float], fixed: Mapping[str, float] | None = None) -> dict[str, float]:
    """Evaluate every definition for the given input-symbol values.

    ``fixed`` maps definition keys to values used instead of the formula (e.g. a gather
    group chosen by the caller). Returns definition key -> value.
    """
    env: dict[sympy.Symbol, float] = dict(values)
    fixed = dict(fixed or {})
    result: dict[str, float] = {}
    for d, args, fn in _compiled():
        if d.key in fixed:
            value = float(fixed[d.key])
        else:
            missing = [a.name for a in args if a not in env]
            if missing:
                raise ValueError(f"formula {d.key!r} needs values for {', '.join(missing)}")
            value = float(fn(*(env[a] for a in args)))
        env[d.lhs] = value
        result[d.key] = value
    return result

"""The named sympy symbols of the memory and timing model, with their meaning and unit.

Sizes are in GB (10^9 bytes), bandwidths in GB/s and times in seconds inside the model;
`PlanInputs` takes times in milliseconds and converts them. Every symbol that an input
feeds is listed in `INPUT_SYMBOLS` under the `PlanInputs` field name it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import sympy


@dataclass(frozen=True)
class SymbolInfo:
    """One model symbol: the sympy object, what it stands for and its unit."""

    symbol: sympy.Symbol
    meaning: str
    unit: str


def _sym(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, nonnegative=True, real=True)


# Model and placement.
M = _sym("M")
L = _sym("L")
B = _sym("B_max")
R = _sym("R")
A = _sym("A")
dp = _sym("dp")
sp = _sym("sp")
S = _sym("S")
G = _sym("G")

# Host memory behaviour at load time.
O_rank = _sym("O_rank")
phi = _sym("phi_cache")
sigma = _sym("sigma_stage")
psi = _sym("psi_pin")

# Bandwidths.
b_link = _sym("b_link")
b_host = _sym("b_host")
b_gather = _sym("b_gather")

# Time per block.
t_1 = _sym("t_1")
alpha = _sym("alpha_sp")
omega = _sym("omega")
kappa = _sym("kappa_lock")
f_copy = _sym("f_copy")
f_coll = _sym("f_coll")

# Derived quantities that get their own formula.
W = _sym("W")
g = _sym("g")
b_rank = _sym("b_rank")
t_c = _sym("t_c")

SYMBOLS: Mapping[str, SymbolInfo] = {
    "M": SymbolInfo(M, "size of the streamed blocks (one host copy of the checkpoint)", "GB"),
    "L": SymbolInfo(L, "number of streamed blocks", "1"),
    "B_max": SymbolInfo(B, "size of the largest block (sizes each device slot)", "GB"),
    "R": SymbolInfo(R, "weights kept resident on the device outside the blocks", "GB"),
    "A": SymbolInfo(A, "activations, workspaces and framework memory per device", "GB"),
    "S": SymbolInfo(S, "device slots a block streams into (num_slots)", "1"),
    "G": SymbolInfo(G, "shard-sized gather input buffers per rank (0: dlo-fx gathers in place)", "1"),
    "dp": SymbolInfo(dp, "data-parallel degree (independent requests in flight)", "1"),
    "sp": SymbolInfo(sp, "sequence-parallel degree (ranks sharing one request)", "1"),
    "O_rank": SymbolInfo(O_rank, "host framework overhead per rank process", "GB"),
    "phi_cache": SymbolInfo(
        phi, "fraction of the checkpoint resident in page cache, charged to the cgroup", "1"
    ),
    "sigma_stage": SymbolInfo(
        sigma, "transient private staging at load, per host copy, as a fraction of M", "1"
    ),
    "psi_pin": SymbolInfo(
        psi, "fraction of pinned host memory the cgroup sees (0 Ascend, 1 CUDA)", "1"
    ),
    "b_link": SymbolInfo(b_link, "host-to-device link bandwidth of one device", "GB/s"),
    "b_host": SymbolInfo(b_host, "aggregate host-to-device bandwidth of the host", "GB/s"),
    "b_gather": SymbolInfo(b_gather, "AllGather bus bandwidth per rank over device links", "GB/s"),
    "t_1": SymbolInfo(t_1, "compute time of one block for one request on one device", "s"),
    "alpha_sp": SymbolInfo(alpha, "part of the block compute that sequence parallelism does not split", "1"),
    "omega": SymbolInfo(omega, "overlap efficiency: share of a hidden transfer that stays hidden", "1"),
    "kappa_lock": SymbolInfo(
        kappa, "lockstep cost of a gathered block, as a fraction of its compute", "1"
    ),
    "f_copy": SymbolInfo(f_copy, "fixed per-block cost of issuing a rank-local copy", "s"),
    "f_coll": SymbolInfo(f_coll, "fixed per-block cost of issuing the shard copy and collective", "s"),
    "W": SymbolInfo(W, "ranks on the host (world size)", "1"),
    "g": SymbolInfo(g, "ranks that share one host copy and gather a block together", "1"),
    "b_rank": SymbolInfo(b_rank, "host-to-device bandwidth one rank gets while all ranks copy", "GB/s"),
    "t_c": SymbolInfo(t_c, "compute time of one block on one rank", "s"),
}
"""Every symbol the formulas use, keyed by its sympy name."""

INPUT_SYMBOLS: Mapping[str, sympy.Symbol] = {
    "model_gb": M,
    "blocks": L,
    "max_block_gb": B,
    "resident_gb": R,
    "activation_gb": A,
    "num_slots": S,
    "gather_buffers": G,
    "dp": dp,
    "sp": sp,
    "overhead_gb": O_rank,
    "page_cache_fraction": phi,
    "staging_fraction": sigma,
    "pinned_cgroup_fraction": psi,
    "h2d_gbps": b_link,
    "host_h2d_gbps": b_host,
    "gather_gbps": b_gather,
    "block_compute_ms": t_1,
    "sp_serial_fraction": alpha,
    "overlap_efficiency": omega,
    "lockstep_fraction": kappa,
    "copy_overhead_ms": f_copy,
    "collective_overhead_ms": f_coll,
}
"""`PlanInputs` field name -> the symbol its value is substituted for."""

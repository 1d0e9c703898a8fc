"""`PlanInputs`: the validated inputs of one planning question.

Units are the ones a person types: GB (10^9 bytes), GB/s and milliseconds. Defaults
describe the generic node of `dlo_fx.apps.figures` (the same figures the dump's
timeline assumes), perfect overlap, no lockstep cost and the load constants fitted on
Ascend. Presets (`presets.py`) replace them with a documented constant set.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Optional

import sympy

from .. import figures as c
from .symbols import INPUT_SYMBOLS

GATHER_OVER = ("dp", "world")


def _check_number(name: str, value: object, *, low: float = 0.0, strict: bool = False,
                  high: Optional[float] = None, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    bad = value <= low if strict else value < low
    if bad or (high is not None and value > high):
        rng = f"{'>' if strict else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
        raise ValueError(f"{name} must be {rng}, got {value!r}" + (f"; {hint}" if hint else ""))


def _check_count(name: str, value: object, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}" + (f"; {hint}" if hint else ""))


ACTIVATION_SHARE = 20.0 / 64.0
"""Default activation memory as a share of the device memory (``activation_gb=None``)."""


@dataclass(frozen=True)
class PlanInputs:
    """Everything the model needs to predict both modes for one model and topology."""

    model_gb: float
    """GB of the streamed blocks (one host copy of the checkpoint's DiT blocks)."""
    blocks: int
    """Number of streamed blocks."""
    dp: int = 1
    """Data-parallel degree: replicas, each running its own request."""
    sp: int = 1
    """Sequence-parallel degree: ranks sharing one request."""
    world: Optional[int] = None
    """Ranks on the host; ``None`` means ``dp * sp``. When given, dp must divide it."""
    max_block_gb: Optional[float] = None
    """GB of the largest block; ``None`` means ``model_gb / blocks``."""
    resident_gb: float = 0.0
    """GB of weights that stay on the device outside the blocks."""
    activation_gb: Optional[float] = None
    """GB of activations, workspaces and framework memory per device; ``None`` means
    `ACTIVATION_SHARE` of ``hbm_gb`` (20 GB of a 64 GB device: the order of the DLO
    write-up's 720p 10 s peaks, 23.1-28.1 GB, less the weight slots), so the default fits
    the device given."""
    num_slots: int = 2
    """Device slots a block streams into (the ``num_slots`` option)."""
    gather_buffers: int = 0
    """Shard-sized gather input buffers per rank: 0 for dlo-fx, which gathers in place
    into the slot; the reference implementation kept 2."""
    overhead_gb: float = c.value("overhead_gb")
    """Host framework overhead per rank process, GB."""
    page_cache_fraction: float = c.value("page_cache_fraction")
    """Share of the checkpoint resident in page cache and charged to the cgroup at load."""
    staging_fraction: float = c.value("staging_fraction")
    """Transient private staging at load per host copy, as a share of ``model_gb``."""
    pinned_cgroup_fraction: float = c.value("pinned_cgroup_fraction_ascend")
    """Share of pinned host memory the cgroup sees: 0 on Ascend, 1 on CUDA."""
    h2d_gbps: float = c.value("generic_h2d_gbps")
    """Host-to-device link bandwidth of one device, GB/s (default: ``generic_h2d_gbps``)."""
    host_h2d_gbps: Optional[float] = None
    """Aggregate host-to-device bandwidth of the host, GB/s; ``None`` means every link
    runs at full speed at once (``world * h2d_gbps``)."""
    gather_gbps: float = c.value("generic_gather_gbps")
    """AllGather bus bandwidth per rank over the device links, GB/s (default:
    ``generic_gather_gbps``)."""
    block_compute_ms: float = c.value("generic_block_compute_ms")
    """Compute time of one block for one request on one device, ms (default: a
    placeholder, ``generic_block_compute_ms``; measure it for your model and resolution)."""
    sp_serial_fraction: float = 0.0
    """Share of the block compute that sequence parallelism does not split."""
    overlap_efficiency: float = 1.0
    """Share of a hidden transfer that stays hidden behind compute (1 = perfect)."""
    lockstep_fraction: float = 0.0
    """AllGather lockstep cost as a share of block compute, at many replicas."""
    copy_overhead_ms: float = c.value("cuda_copy_overhead_ms")
    """Fixed per-block cost of issuing a rank-local whole-block copy, ms."""
    collective_overhead_ms: float = c.value("cuda_collective_overhead_ms")
    """Fixed per-block cost of issuing the shard copy and the AllGather, ms."""
    gather_over: str = "dp"
    """Which ranks share a host copy: ``"dp"`` (the DP group; the SP group when
    dp = 1) or ``"world"`` (all ranks)."""
    steps: int = 50
    """Denoising steps per request, for request time and throughput."""
    tokens: int = 0
    """Sequence length of one request (its tokens): with ``heads`` and ``head_dim``, the
    sequence-parallel all-to-all the gather group choice counts; 0: none counted."""
    heads: int = 0
    """Attention heads of the model (the all-to-all's size)."""
    head_dim: int = 0
    """Channels per attention head (the all-to-all's size)."""
    attention_layers: int = 1
    """Attention layers per block, each with its all-to-all."""
    activation_bytes: int = 2
    """Bytes per element of the attention's inputs and output (2: BF16)."""
    host_ram_gb: float = 2048.0
    """Physical host memory, GB."""
    hbm_gb: float = 64.0
    """Device memory per rank, GB."""

    def __post_init__(self) -> None:
        _check_number("hbm_gb", self.hbm_gb, strict=True, hint="pass the device memory in GB")
        if self.activation_gb is None:
            object.__setattr__(self, "activation_gb", ACTIVATION_SHARE * self.hbm_gb)
        _check_number("model_gb", self.model_gb, strict=True, hint="pass the checkpoint size in GB")
        _check_count("blocks", self.blocks, "pass the number of streamed blocks")
        _check_count("dp", self.dp)
        _check_count("sp", self.sp)
        _check_count("num_slots", self.num_slots)
        if isinstance(self.gather_buffers, bool) or not isinstance(self.gather_buffers, int) \
                or self.gather_buffers < 0:
            raise ValueError(f"gather_buffers must be a whole number >= 0, got {self.gather_buffers!r}")
        if self.world is not None:
            _check_count("world", self.world)
            if self.world % self.dp:
                divisors = [d for d in range(1, self.world + 1) if self.world % d == 0]
                raise ValueError(
                    f"dp={self.dp} does not divide world={self.world}; choose dp from {divisors}"
                )
            if self.dp * self.sp != self.world:
                raise ValueError(
                    f"sp={self.sp} does not match world/dp = {self.world // self.dp}; "
                    f"set sp to {self.world // self.dp} or leave world unset"
                )
        if self.max_block_gb is not None:
            _check_number("max_block_gb", self.max_block_gb, strict=True)
            mean = self.model_gb / self.blocks
            if self.max_block_gb > self.model_gb or self.max_block_gb < mean * (1 - 1e-9):
                raise ValueError(
                    f"max_block_gb={self.max_block_gb:g} must lie between the mean block "
                    f"model_gb/blocks = {mean:.4g} and model_gb = {self.model_gb:g}"
                )
        for name in ("resident_gb", "activation_gb", "overhead_gb"):
            _check_number(name, getattr(self, name), hint="sizes cannot be negative")
        for name in ("page_cache_fraction", "staging_fraction", "pinned_cgroup_fraction",
                     "sp_serial_fraction", "overlap_efficiency", "lockstep_fraction"):
            _check_number(name, getattr(self, name), high=1.0, hint="it is a fraction")
        for name in ("h2d_gbps", "gather_gbps"):
            _check_number(name, getattr(self, name), strict=True, hint="a bandwidth must be positive")
        if self.host_h2d_gbps is not None:
            _check_number("host_h2d_gbps", self.host_h2d_gbps, strict=True,
                          hint="a bandwidth must be positive; leave it unset for no host limit")
        _check_number("block_compute_ms", self.block_compute_ms, hint="times cannot be negative")
        for name in ("copy_overhead_ms", "collective_overhead_ms"):
            _check_number(name, getattr(self, name), hint="times cannot be negative")
        if self.gather_over not in GATHER_OVER:
            raise ValueError(f"gather_over must be one of {GATHER_OVER}, got {self.gather_over!r}")
        _check_count("steps", self.steps)
        for name in ("tokens", "heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        _check_count("attention_layers", self.attention_layers)
        _check_count("activation_bytes", self.activation_bytes)
        _check_number("host_ram_gb", self.host_ram_gb, strict=True, hint="pass the host's RAM in GB")
        _check_number("hbm_gb", self.hbm_gb, strict=True, hint="pass the device memory in GB")

    @property
    def world_size(self) -> int:
        """Ranks on the host."""
        return self.world if self.world is not None else self.dp * self.sp

    @property
    def gather_group(self) -> int:
        """Ranks that share one host copy in allgather mode."""
        if self.gather_over == "world":
            return self.world_size
        return self.dp if self.dp > 1 else self.sp

    @property
    def block_gb(self) -> float:
        """GB of the largest block."""
        return self.max_block_gb if self.max_block_gb is not None else self.model_gb / self.blocks

    @property
    def host_bandwidth_gbps(self) -> float:
        """Aggregate host-to-device bandwidth, GB/s."""
        return self.host_h2d_gbps if self.host_h2d_gbps is not None else self.world_size * self.h2d_gbps

    def replace(self, **changes: object) -> "PlanInputs":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def symbol_values(self) -> Mapping[sympy.Symbol, float]:
        """Input-symbol values for `model.evaluate` (times in seconds)."""
        values = {}
        for field, symbol in INPUT_SYMBOLS.items():
            if field == "max_block_gb":
                v = self.block_gb
            elif field == "host_h2d_gbps":
                v = self.host_bandwidth_gbps
            else:
                v = float(getattr(self, field))
            if field.endswith("_ms"):
                v /= 1000.0
            values[symbol] = float(v)
        return values


def input_field_names() -> tuple[str, ...]:
    """Names of the `PlanInputs` fields, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(PlanInputs))

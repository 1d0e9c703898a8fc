"""The target of a plan: an accelerator's copy rate, gather rate, FLOP rate per dtype and
memory, each with where it comes from.

`Hardware` is what `dlo_fx.plan` takes; `HARDWARE` holds the presets, every value a
constant of `dlo_fx.apps.figures` (its kind and source travel with it): the H200's figures
are calibrated on this project's H200 run (docs/benchmarks.md), every other accelerator's
FLOP rates are its datasheet's dense rates times the share of spec the H200 run reached
(`matmul_efficiency`), its host link the H200 run's measured share of PCIe. No figure of a
plan comes from the machine that plans.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import torch

from .. import figures
from ...config import did_you_mean

__all__ = ["HARDWARE", "Hardware", "cpu_copies_overlap", "hardware_of"]

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One accelerator as a plan sees it (one rank of a run)."""

    name: str
    h2d_gbps: float
    """Host-to-device copy of pinned memory, GB/s."""
    gather_gbps: float
    """Bytes an AllGather delivers to each rank per second, GB/s (allgather mode, dp > 1)."""
    flops_per_s: Mapping[str, float]
    """Matmul rate per dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``), FLOP/s."""
    memory_bytes: int
    """Device memory a run may use (what ``device_memory`` would declare), bytes."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Where each figure comes from, by field name (``flops_per_s.bfloat16`` for a rate)."""
    copies_overlap: bool = True
    """Whether a block's copy runs beside compute: a device's copy engine does; a CPU does
    only where its compute leaves a core to the copy thread (`cpu_copies_overlap`). See
    [Note: a copy lane of its own] in planning/budget.py."""

    def __post_init__(self) -> None:
        for name in ("h2d_gbps", "gather_gbps", "memory_bytes"):
            figures.positive(f"dlo_fx.plan: hardware {self.name!r}: ", name, getattr(self, name),
                             "a number > 0")
        if not isinstance(self.copies_overlap, bool):
            raise ValueError(f"dlo_fx.plan: hardware {self.name!r}: copies_overlap="
                             f"{self.copies_overlap!r} is not allowed: expected True (copies "
                             "run beside compute) or False")
        if not isinstance(self.flops_per_s, Mapping) or not self.flops_per_s:
            raise ValueError(f"dlo_fx.plan: hardware {self.name!r}: flops_per_s must map dtype "
                             "names to FLOP/s, e.g. {'bfloat16': 400e12, 'float32': 30e12}")
        for dtype, rate in self.flops_per_s.items():
            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise ValueError(f"dlo_fx.plan: hardware {self.name!r}: flops_per_s key "
                                 f"{dtype!r} is not a torch dtype name (bfloat16, float16, "
                                 "float32, ...)")
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
                raise ValueError(f"dlo_fx.plan: hardware {self.name!r}: flops_per_s[{dtype!r}]"
                                 f"={rate!r} is not allowed: expected FLOP/s > 0")

    def flops(self, dtype: Optional[torch.dtype]) -> float:
        """The matmul rate of ``dtype`` (FLOP/s): its own, else float16's for bfloat16 and
        the reverse; ValueError naming the dtype where the hardware has none."""
        name = str(dtype).removeprefix("torch.")
        twin = {"bfloat16": "float16", "float16": "bfloat16"}.get(name)
        for key in (name, twin):
            if key in self.flops_per_s:
                return float(self.flops_per_s[key])
        raise ValueError(f"dlo_fx.plan: the model computes matmuls in {name}, and hardware "
                         f"{self.name!r} has no FLOP rate for it (it has "
                         f"{', '.join(self.flops_per_s)}); give flops_per_s[{name!r}]")

    def source(self, name: str) -> str:
        return self.sources.get(name, "given")


def cpu_copies_overlap(threads: Optional[int] = None, cores: Optional[int] = None) -> bool:
    """Whether a CPU computing with ``threads`` intra-op threads (default: torch's) leaves a
    core of its ``cores`` (default: those this process may run on) to the copy thread."""
    threads = torch.get_num_threads() if threads is None else threads
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return threads < (cores or 1)


def _rate(tflops: str, *, calibrated: Optional[str] = None) -> tuple[float, str]:
    if calibrated is not None:
        c = figures.CONSTANTS[calibrated]
        return c.value, f"{c.kind}: {c.source}"
    spec, eff = figures.CONSTANTS[tflops], figures.CONSTANTS["matmul_efficiency"]
    return (spec.value * 1e12 * eff.value,
            f"derived: {spec.value:g} TFLOP/s ({spec.source}) x matmul_efficiency "
            f"{eff.value:.3f} ({eff.source})")


def _preset(name: str, *, h2d: str, gather: str, memory: str, bf16: str, fp32: str,
            bf16_calibrated: Optional[str] = None) -> Hardware:
    c = figures.CONSTANTS
    rates, sources = {}, {}
    for dtype, spec, cal in (("bfloat16", bf16, bf16_calibrated), ("float32", fp32, None)):
        rates[dtype], sources[f"flops_per_s.{dtype}"] = _rate(spec, calibrated=cal)
    for key in ("h2d_gbps", "gather_gbps", "memory_bytes"):
        const = c[{"h2d_gbps": h2d, "gather_gbps": gather, "memory_bytes": memory}[key]]
        sources[key] = f"{const.kind}: {const.source}"
    return Hardware(name, c[h2d].value, c[gather].value, rates, int(c[memory].value * GB),
                    sources)


HARDWARE: Mapping[str, Hardware] = {
    h.name: h for h in (
        _preset("h100-pcie", h2d="pcie5_h2d_gbps", gather="nvlink3_gbps",
                memory="h100_pcie_hbm_gb", bf16="h100_pcie_bf16_tflops",
                fp32="h100_pcie_fp32_tflops"),
        _preset("h100-sxm", h2d="pcie5_h2d_gbps", gather="nvlink4_gbps",
                memory="h100_sxm_hbm_gb", bf16="h100_sxm_bf16_tflops",
                fp32="h100_sxm_fp32_tflops"),
        _preset("h200", h2d="h200_h2d_gbps", gather="nvlink4_gbps", memory="h200_hbm_gb",
                bf16="h100_sxm_bf16_tflops", fp32="h200_fp32_tflops",
                bf16_calibrated="h200_bf16_flops"),
        _preset("b200", h2d="pcie5_h2d_gbps", gather="b300_gather_gbps", memory="b200_hbm_gb",
                bf16="b200_bf16_tflops", fp32="b200_fp32_tflops"),
        _preset("b300", h2d="pcie5_h2d_gbps", gather="b300_gather_gbps", memory="b300_hbm_gb",
                bf16="b300_bf16_tflops", fp32="b300_fp32_tflops"),
        _preset("a100-80gb", h2d="pcie4_h2d_gbps", gather="nvlink3_gbps", memory="a100_hbm_gb",
                bf16="a100_bf16_tflops", fp32="a100_fp32_tflops"),
        _preset("l40s", h2d="pcie4_h2d_gbps", gather="pcie4_gather_gbps",
                memory="l40s_gddr_gb", bf16="l40s_bf16_tflops", fp32="l40s_fp32_tflops"),
        _preset("rtx-4090", h2d="pcie4_h2d_gbps", gather="pcie4_gather_gbps",
                memory="rtx4090_gddr_gb", bf16="rtx4090_bf16_tflops",
                fp32="rtx4090_fp32_tflops"),
        _preset("ascend-910b3", h2d="pcie4_h2d_gbps", gather="hccs_gather_gbps",
                memory="ascend_hbm_gb", bf16="ascend_910b3_fp16_tflops",
                fp32="ascend_910b3_fp32_tflops"),
    )
}
"""The presets by name (``dlo-fx plan --hardware NAME``)."""


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def hardware_of(spec: Union[str, Hardware, Mapping[str, Any]]) -> Hardware:
    """A preset by name (``"h200"``, ``"H100 SXM"``, ``"A100 80GB"``: case, spaces and
    dashes do not matter), a `Hardware`, or a mapping of its fields."""
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, str):
        by_key = {_key(n): h for n, h in HARDWARE.items()}
        found = by_key.get(_key(spec))
        if found is None:
            raise ValueError(f"dlo_fx.plan: unknown hardware {spec!r}; "
                             f"{did_you_mean(spec, HARDWARE)}choose one of "
                             f"{', '.join(HARDWARE)}, or give a Hardware (copy rate, gather "
                             "rate, FLOP rate per dtype, memory)")
        return found
    if isinstance(spec, Mapping):
        names = {f.name for f in dataclasses.fields(Hardware)}
        unknown = sorted(set(spec) - names)
        if unknown:
            raise ValueError(f"dlo_fx.plan: hardware has no field(s) {unknown}; "
                             f"{did_you_mean(unknown, names)}its fields: {', '.join(sorted(names))}")
        missing = sorted(n for n in ("h2d_gbps", "gather_gbps", "flops_per_s", "memory_bytes")
                         if n not in spec)
        if missing:
            raise ValueError(f"dlo_fx.plan: hardware needs {', '.join(missing)} (it was given "
                             f"{', '.join(sorted(spec)) or 'nothing'})")
        return Hardware(**{"name": "custom", **spec})
    raise ValueError(f"dlo_fx.plan: hardware={spec!r} is not allowed: give a preset name "
                     f"({', '.join(HARDWARE)}), a dlo_fx.apps.plan.Hardware or a dict of its "
                     "fields")

"""Named constant sets for `PlanInputs`: hardware nodes and workloads.

A preset sets some `PlanInputs` fields; several presets combine left to right (a node
and a workload, e.g. ``b300-8gpu`` then ``minimax-h3``), and explicit inputs override
them. Every value comes from `figures.CONSTANTS` and carries that constant's source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from ..figures import CONSTANTS
from .inputs import input_field_names


@dataclass(frozen=True)
class PresetValue:
    """One field a preset sets, and where its value comes from."""

    value: float
    constant: str
    source: str


@dataclass(frozen=True)
class Preset:
    """A named set of `PlanInputs` field values."""

    name: str
    description: str
    values: Mapping[str, PresetValue]

    def fields(self) -> dict[str, float]:
        """Field name -> value."""
        return {k: v.value for k, v in self.values.items()}


def _from(constants: Mapping[str, str], integer: Iterable[str] = ()) -> dict[str, PresetValue]:
    out = {}
    for field, name in constants.items():
        const = CONSTANTS[name]
        value = int(round(const.value)) if field in set(integer) else const.value
        out[field] = PresetValue(value, name, const.source)
    return out


def _world(n: int, source: str) -> dict[str, PresetValue]:
    return {"world": PresetValue(n, "", source)}


PRESETS: Mapping[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "ascend-910b3",
            "Ascend 910B3 node of the DLO write-up: 64 GB HBM, 2 TB RAM, pinned memory "
            "outside the cgroup, 150 ms of AllGather dispatch per 72-block step.",
            _from({
                "hbm_gb": "ascend_hbm_gb",
                "host_ram_gb": "ascend_host_ram_gb",
                "pinned_cgroup_fraction": "pinned_cgroup_fraction_ascend",
                "collective_overhead_ms": "ascend_collective_overhead_ms",
            }),
        ),
        Preset(
            "b300-8gpu",
            "One 8x NVIDIA B300 node: 288 GB HBM3e, NVLink 5, PCIe Gen5 host links, 2 TB "
            "RAM, CUDA pinned memory charged to the cgroup.",
            {
                **_world(8, "Eight GPUs on one node (HGX/DGX B300)."),
                **_from({
                    "hbm_gb": "b300_hbm_gb",
                    "host_ram_gb": "b300_host_ram_gb",
                    "gather_gbps": "b300_gather_gbps",
                    "h2d_gbps": "b300_h2d_gbps",
                    "host_h2d_gbps": "b300_host_h2d_gbps",
                    "overlap_efficiency": "b300_overlap_efficiency",
                    "pinned_cgroup_fraction": "pinned_cgroup_fraction_cuda",
                    "copy_overhead_ms": "cuda_copy_overhead_ms",
                    "collective_overhead_ms": "cuda_collective_overhead_ms",
                }),
            },
        ),
        Preset(
            "cosmos3-nano",
            "Cosmos3-Nano DiT: 33 GB in 72 blocks.",
            _from({"model_gb": "cosmos3_nano_gb", "blocks": "cosmos3_nano_blocks"}, integer=["blocks"]),
        ),
        Preset(
            "cosmos3-super",
            "Cosmos3-Super DiT: 124 GB in 128 blocks, 720p 10 s activations.",
            _from(
                {
                    "model_gb": "cosmos3_super_gb",
                    "blocks": "cosmos3_super_blocks",
                    "activation_gb": "cosmos3_super_activation_gb",
                },
                integer=["blocks"],
            ),
        ),
        Preset(
            "minimax-h3",
            "MiniMax-H3 T2VA (768x1344, 124 frames, BF16): 66.3 GB DiT in 50 blocks, "
            "49 denoising updates, compute and lockstep calibrated on 8x B300.",
            _from(
                {
                    "model_gb": "minimax_dit_gb",
                    "blocks": "minimax_blocks",
                    "activation_gb": "minimax_activation_gb",
                    "block_compute_ms": "minimax_block_compute_ms",
                    "sp_serial_fraction": "minimax_sp_serial_fraction",
                    "lockstep_fraction": "minimax_lockstep_fraction",
                    "steps": "minimax_steps",
                    "tokens": "minimax_tokens",
                    "heads": "minimax_heads",
                    "head_dim": "minimax_head_dim",
                },
                integer=["blocks", "steps", "tokens", "heads", "head_dim"],
            ),
        ),
    )
}
"""All presets by name."""


def preset(name: str) -> Preset:
    """Look a preset up by name."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None


def preset_fields(names: Iterable[str]) -> dict[str, float]:
    """The merged field values of several presets, later ones winning."""
    out: dict[str, float] = {}
    for name in names:
        out.update(preset(name).fields())
    return out


def _check() -> None:
    known = set(input_field_names())
    for p in PRESETS.values():
        unknown = set(p.values) - known
        if unknown:
            raise AssertionError(f"preset {p.name} sets unknown fields {sorted(unknown)}")


_check()

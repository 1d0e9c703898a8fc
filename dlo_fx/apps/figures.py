"""Every published or assumed figure the applications use, each with its source.

Kinds: ``measured`` (a published measurement used as is), ``derived`` (arithmetic on
published figures, shown in the source), ``fitted`` (chosen so the model reproduces
published figures; `study/calibration.py` holds the fit and its residuals), ``spec`` (public
hardware specification) and ``assumed`` (an order-of-magnitude choice, named as such).

This is the one place of such figures: the planning study (`dlo_fx.apps.study`) and the
dump's predicted timeline (`dlo_fx.apps.dump.timeline`) read them.
The module imports nothing heavy (no sympy), so the dump can use it at compile time.

Sources cited:

* **DLO write-up**: the vLLM-Omni "Distributed Layerwise Offload" blog post (full
  version with Ascend memory accounting, B300 results and the MiniMax-H3 study; summary
  version with the memory-scaling table).
* **MiniMax-H3 study**: S. Li, "Topology-Aware Distributed Layerwise Offloading for
  MiniMax-H3 on Eight NVIDIA B300 GPUs" (artifacts in the GitHub repository
  lishunyang12/vllm-omni-rankings), summarised in the DLO write-up.
* **MiniMax-H3 recipe**: the vLLM-Omni MiniMax-H3 recipe and PR #5764, which give the
  DiT size and block count.

Sizes are GB (10^9 bytes); GiB figures from a source are converted with 1 GiB = 1.073741824 GB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

GIB = 1.073741824
"""GB per GiB."""


@dataclass(frozen=True)
class Constant:
    """A documented constant."""

    value: float
    unit: str
    kind: str
    source: str


@dataclass(frozen=True)
class PublishedLoadPeak:
    """A published cgroup-visible host peak at load time (Ascend 910B3, AllGather mode)."""

    label: str
    model_gb: float
    dp: int
    cgroup_gb: float
    source: str


@dataclass(frozen=True)
class PublishedExtrapolation:
    """One row of the DLO write-up's memory-scaling table (AllGather mode, Ascend)."""

    model_gb: float
    dp: int
    cgroup_gb: float
    total_gb: float


@dataclass(frozen=True)
class PublishedWave:
    """A MiniMax-H3 wave time on 8x B300 for one topology and mode, as published."""

    dp: int
    sp: int
    mode: str
    wave_s: float
    derivation: str


_MINIMAX_BLOCK_GB = 66.3 / 50

CONSTANTS: Mapping[str, Constant] = {
    # --- a generic node where nothing was measured: the defaults of `PlanInputs` and
    # --- of the dump's predicted timeline (`dlo_fx.apps.dump.Assumptions`) ----------------
    "generic_h2d_gbps": Constant(
        25.0, "GB/s", "assumed",
        "Host-to-device copy of pinned memory over PCIe 4.0 x16 (32 GB/s per direction "
        "on paper, about 25 GB/s reached).",
    ),
    "generic_gather_gbps": Constant(
        50.0, "GB/s", "assumed",
        "Bytes an AllGather delivers to each rank per second: the order of a ring over "
        "device links of a few hundred Gb/s per GPU.",
    ),
    "generic_compute_gbps": Constant(
        100.0, "GB/s", "assumed",
        "A block's compute time taken as its weight bytes over this rate (a bf16 DiT block "
        "on about 4k tokens at about 400 TFLOP/s); used by the dump's timeline.",
    ),
    "generic_block_compute_ms": Constant(
        50.0, "ms", "assumed",
        "Compute time of one block for one request on one device: a placeholder of the "
        "planning study; measure it for your model and resolution.",
    ),
    # --- host memory at load (fitted against the Ascend measurements) ---------------
    "overhead_gb": Constant(
        3.25, "GB", "derived",
        "DLO write-up: the 178 GB cgroup peak of Cosmos3-Nano DP4 without mmap is 132 GB of "
        "private copies + 33 GB page cache + about 13 GB framework/transient; 13 GB / 4 ranks.",
    ),
    "page_cache_fraction": Constant(
        0.939, "1", "derived",
        "DLO write-up: fresh-cgroup Cosmos3-Nano DP2 usage 49 GB = 31 GB cache + 18 GB RSS; "
        "31 GB of the 33 GB checkpoint is in page cache (31/33).",
    ),
    "staging_fraction": Constant(
        0.219, "1", "fitted",
        "Fitted (calibration.fit_staging_fraction): the value that minimises the largest "
        "relative error of the cgroup peak over the three published measurements "
        "(Nano DP2 49 GB, Nano DP4 47 GB, Super DP4 172 GB) with the two constants above held.",
    ),
    "pinned_cgroup_fraction_ascend": Constant(
        0.0, "1", "measured",
        "DLO write-up: on Ascend pin_memory() allocates through the NPU driver; the cgroup "
        "shows cache + RSS exactly, kmem 0 GB, driver mapping RSS 0 kB.",
    ),
    "pinned_cgroup_fraction_cuda": Constant(
        1.0, "1", "measured",
        "DLO write-up: CUDA process-tree memory includes the pinned CPU shards.",
    ),
    # --- Ascend 910B3 node (DLO write-up test bed) -----------------------------------
    "ascend_hbm_gb": Constant(64.0, "GB", "measured", "DLO write-up: Ascend 910B3, 64 GB HBM per card."),
    "ascend_host_ram_gb": Constant(2048.0, "GB", "measured", "DLO write-up: 2 TB system RAM."),
    "ascend_collective_overhead_ms": Constant(
        150.0 / 72.0, "ms", "derived",
        "DLO write-up: AllGather overhead 150 ms per denoising step on Cosmos3-Nano DP4 "
        "(72 ms stream switching + 10 ms HCCL + 68 ms Python dispatch) over 72 blocks.",
    ),
    # --- Cosmos3 models ---------------------------------------------------------------
    "cosmos3_nano_gb": Constant(33.0, "GB", "measured", "DLO write-up: Cosmos3-Nano, 33 GB safetensors."),
    "cosmos3_nano_blocks": Constant(72.0, "1", "measured", "DLO write-up: Cosmos3-Nano, 72 blocks."),
    "cosmos3_super_gb": Constant(124.0, "GB", "measured", "DLO write-up: Cosmos3-Super, 124 GB BF16."),
    "cosmos3_super_blocks": Constant(128.0, "1", "measured", "DLO write-up: Cosmos3-Super, 128 blocks."),
    "cosmos3_super_activation_gb": Constant(
        28.1 - 2 * 124.0 / 128.0, "GB", "derived",
        "DLO write-up: 28.1 GB peak HBM for Cosmos3-Super at 720p 10 s, less two slots of "
        "124/128 GB.",
    ),
    # --- 8x B300 node -----------------------------------------------------------------
    "b300_hbm_gb": Constant(288.0, "GB", "spec", "NVIDIA B300 (Blackwell Ultra): 288 GB HBM3e per GPU."),
    "b300_host_ram_gb": Constant(2048.0, "GB", "spec", "NVIDIA DGX B300: 2 TB system memory."),
    "b300_gather_gbps": Constant(
        900.0, "GB/s", "spec",
        "NVLink 5: 1.8 TB/s per GPU in both directions together, 900 GB/s each way.",
    ),
    "b300_h2d_gbps": Constant(
        64.0, "GB/s", "spec",
        "PCIe Gen5 x16: 64 GB/s each way. The host CPUs of B300 systems are PCIe Gen5, so "
        "the GPU-side Gen6 x16 (128 GB/s) is not the limit.",
    ),
    "b300_host_h2d_gbps": Constant(
        370.0, "GB/s", "fitted",
        "Fitted to the MiniMax-H3 study: rank-local DP1xSP8 is H2D-bound, 8 ranks each "
        "copying the 66.3 GB DiT per step. 370 GB/s is 72% of eight Gen5 x16 links.",
    ),
    "b300_overlap_efficiency": Constant(
        0.70, "1", "fitted",
        "Fitted to the MiniMax-H3 study's six wave times (see minimax_block_compute_ms).",
    ),
    "cuda_copy_overhead_ms": Constant(
        0.02, "ms", "assumed", "Order of one CUDA copy launch plus event record per block."
    ),
    "cuda_collective_overhead_ms": Constant(
        0.10, "ms", "assumed", "Order of one copy plus one NCCL collective launch per block."
    ),
    # --- MiniMax-H3 T2VA workload (768x1344, 124 frames, BF16) ------------------------
    "minimax_dit_gb": Constant(66.3, "GB", "measured", "MiniMax-H3 recipe: 66.3 GB BF16 DiT."),
    "minimax_blocks": Constant(50.0, "1", "measured", "MiniMax-H3 recipe: the 50 main DiT blocks."),
    "minimax_activation_gb": Constant(
        20.03 * GIB - 2 * _MINIMAX_BLOCK_GB, "GB", "derived",
        "MiniMax-H3 study: rank-local DP8xSP1 peak 20.03 GiB per GPU, less two slots of "
        "66.3/50 GB; resident input/time/final modules are counted here.",
    ),
    "minimax_tokens": Constant(
        32 * (768 // 16) * (1344 // 16), "1", "assumed",
        "Video tokens of one MiniMax-H3 T2VA request (768x1344, 124 frames), assuming a "
        "Wan-style VAE (8x spatial, 4x temporal: 32 latent frames) and 2x2 patches: "
        "32 x 48 x 84; the audio tokens are not counted.",
    ),
    "minimax_heads": Constant(
        50.0, "1", "assumed",
        "Attention heads of 128 channels: a block of 66.3/50 GB in BF16 holds 663 M "
        "parameters, 16 d^2 for self- and cross-attention and a 4x MLP gives d = 6437, "
        "rounded to 50 x 128 = 6400.",
    ),
    "minimax_head_dim": Constant(128.0, "1", "assumed", "See minimax_heads."),
    "minimax_steps": Constant(
        49.0, "1", "measured", "MiniMax-H3 study: 50 requested steps run 49 denoising updates."
    ),
    "minimax_block_compute_ms": Constant(
        55.0, "ms", "fitted",
        "Fitted with sp_serial_fraction, host H2D bandwidth, overlap efficiency and lockstep "
        "fraction so the model's wave times match the six published MiniMax-H3 wave times "
        "(three topologies x two modes) to within 1%.",
    ),
    "minimax_sp_serial_fraction": Constant(
        0.12, "1", "fitted", "Fitted with minimax_block_compute_ms (SP scaling 1 -> 2 -> 8)."
    ),
    "minimax_lockstep_fraction": Constant(
        0.22, "1", "fitted",
        "Fitted with minimax_block_compute_ms: the AllGather cost that grows with the "
        "number of replicas (+2.2% throughput at DP4xSP2, -4.1% at DP8xSP1).",
    ),
    # --- accelerators `dlo_fx.plan` plans for (`dlo_fx.apps.plan.hardware`) ------------
    # Memory as published (GB); FLOP rates dense (no sparsity), per GPU; gather rates are
    # the device link's bytes per second each way, which an AllGather's ring delivers.
    "h200_h2d_gbps": Constant(
        55.4, "GB/s", "measured",
        "docs/benchmarks.md, H200 run of benchmarks/gpu_check.py: pinned host-to-device "
        "copies at 55.4 GB/s (the pinned-copy floor of FLUX.1-dev's 23.80 GB, 429.8 ms).",
    ),
    "pcie5_h2d_gbps": Constant(
        55.4, "GB/s", "derived",
        "PCIe Gen5 x16: 64 GB/s each way on paper; what the H200 run measured on its Gen5 "
        "link (h200_h2d_gbps, 0.866 of paper).",
    ),
    "pcie4_h2d_gbps": Constant(
        32.0 * 55.4 / 64.0, "GB/s", "derived",
        "PCIe Gen4 x16: 32 GB/s each way on paper, at the share the H200 run reached on "
        "Gen5 (0.866).",
    ),
    "h200_bf16_flops": Constant(
        74.38e12 / 0.1715, "FLOP/s", "fitted",
        "docs/benchmarks.md, H200: FLUX.1-dev at 1,024^2 resident, 171.5 ms per step; "
        "dlo_fx.plan counts 74.38 TFLOP of matmuls and attention in that step: 434 "
        "TFLOP/s, 44% of the 989 TFLOP/s dense BF16 spec (the rest: elementwise work, "
        "launch gaps, kernels below peak).",
    ),
    "matmul_efficiency": Constant(
        74.38e12 / 0.1715 / 989e12, "1", "derived",
        "h200_bf16_flops / the H200's 989 TFLOP/s dense BF16 spec: the share of a spec "
        "FLOP rate a DiT step reaches, applied to every other accelerator's spec rates.",
    ),
    "nvlink4_gbps": Constant(
        450.0, "GB/s", "spec",
        "NVLink 4 (H100 SXM, H200): 900 GB/s per GPU both directions together, 450 each way.",
    ),
    "nvlink3_gbps": Constant(
        300.0, "GB/s", "spec",
        "NVLink 3 (A100 SXM) and the H100 PCIe's NVLink bridge: 600 GB/s both directions, "
        "300 each way.",
    ),
    "pcie4_gather_gbps": Constant(
        25.0, "GB/s", "assumed",
        "No NVLink (L40S, RTX 4090): an AllGather goes over PCIe Gen4 (through the host "
        "where peer-to-peer is disabled, as on GeForce cards), about 25 GB/s.",
    ),
    "hccs_gather_gbps": Constant(
        196.0, "GB/s", "assumed",
        "Ascend 910B HCCS: 7 links of 56 GB/s, 392 GB/s both directions, 196 each way; "
        "the collective's efficiency is not known here.",
    ),
    "h100_sxm_hbm_gb": Constant(80.0, "GB", "spec", "NVIDIA H100 SXM5: 80 GB HBM3."),
    "h100_sxm_bf16_tflops": Constant(989.0, "TFLOP/s", "spec",
                                     "NVIDIA H100 SXM5 datasheet: BF16/FP16 Tensor Core "
                                     "1,979 TFLOP/s with sparsity, 989 dense; FP32 67."),
    "h100_sxm_fp32_tflops": Constant(67.0, "TFLOP/s", "spec", "NVIDIA H100 SXM5: FP32 67 TFLOP/s."),
    "h100_pcie_hbm_gb": Constant(80.0, "GB", "spec", "NVIDIA H100 PCIe: 80 GB HBM2e."),
    "h100_pcie_bf16_tflops": Constant(756.0, "TFLOP/s", "spec",
                                      "NVIDIA H100 PCIe datasheet: BF16/FP16 Tensor Core "
                                      "1,513 TFLOP/s with sparsity, 756 dense."),
    "h100_pcie_fp32_tflops": Constant(51.0, "TFLOP/s", "spec", "NVIDIA H100 PCIe: FP32 51 TFLOP/s."),
    "h200_hbm_gb": Constant(
        139.0 * GIB, "GB", "measured",
        "docs/benchmarks.md: the H200 of the gpu_check run, a 139 GiB device as torch sees "
        "it (141 GB HBM3e on the datasheet).",
    ),
    "h200_fp32_tflops": Constant(67.0, "TFLOP/s", "spec", "NVIDIA H200 SXM: FP32 67 TFLOP/s."),
    "b200_hbm_gb": Constant(180.0, "GB", "spec", "NVIDIA HGX B200: 1,440 GB HBM3e over 8 GPUs, 180 GB each."),
    "b200_bf16_tflops": Constant(2250.0, "TFLOP/s", "spec",
                                 "NVIDIA HGX B200: BF16/FP16 Tensor Core 4.5 PFLOP/s with "
                                 "sparsity per GPU, 2.25 dense."),
    "b200_fp32_tflops": Constant(75.0, "TFLOP/s", "spec", "NVIDIA HGX B200: FP32 75 TFLOP/s per GPU."),
    "b300_bf16_tflops": Constant(2250.0, "TFLOP/s", "spec",
                                 "NVIDIA HGX B300: BF16/FP16 Tensor Core 2.25 PFLOP/s dense per GPU "
                                 "(as B200; Blackwell Ultra adds FP4, not BF16)."),
    "b300_fp32_tflops": Constant(75.0, "TFLOP/s", "spec", "NVIDIA HGX B300: FP32 75 TFLOP/s per GPU."),
    "a100_hbm_gb": Constant(80.0, "GB", "spec", "NVIDIA A100 80GB SXM: 80 GB HBM2e."),
    "a100_bf16_tflops": Constant(312.0, "TFLOP/s", "spec",
                                 "NVIDIA A100 datasheet: BF16/FP16 Tensor Core 312 TFLOP/s dense."),
    "a100_fp32_tflops": Constant(19.5, "TFLOP/s", "spec", "NVIDIA A100: FP32 19.5 TFLOP/s."),
    "l40s_gddr_gb": Constant(48.0, "GB", "spec", "NVIDIA L40S: 48 GB GDDR6."),
    "l40s_bf16_tflops": Constant(362.05, "TFLOP/s", "spec",
                                 "NVIDIA L40S datasheet: BF16/FP16 Tensor Core 733 TFLOP/s with "
                                 "sparsity, 362 dense."),
    "l40s_fp32_tflops": Constant(91.6, "TFLOP/s", "spec", "NVIDIA L40S: FP32 91.6 TFLOP/s."),
    "rtx4090_gddr_gb": Constant(24.0, "GB", "spec", "NVIDIA GeForce RTX 4090: 24 GB GDDR6X."),
    "rtx4090_bf16_tflops": Constant(165.2, "TFLOP/s", "spec",
                                    "NVIDIA Ada whitepaper, RTX 4090: BF16/FP16 Tensor Core with "
                                    "FP32 accumulate 165.2 TFLOP/s dense (330.3 with FP16 "
                                    "accumulate, which torch's matmuls do not use)."),
    "rtx4090_fp32_tflops": Constant(82.6, "TFLOP/s", "spec", "NVIDIA RTX 4090: FP32 82.6 TFLOP/s."),
    "ascend_910b3_fp16_tflops": Constant(
        313.0, "TFLOP/s", "assumed",
        "Ascend 910B3: about 313 TFLOP/s FP16/BF16 dense as commonly quoted for the 910B "
        "series (Huawei publishes 910B figures per SKU only in part).",
    ),
    "ascend_910b3_fp32_tflops": Constant(
        75.0, "TFLOP/s", "assumed", "Ascend 910B3 FP32: about a quarter of FP16, assumed."),
}
"""All documented constants by name."""


def value(name: str) -> float:
    """The value of a documented constant."""
    try:
        return CONSTANTS[name].value
    except KeyError:
        raise ValueError(f"unknown constant {name!r}; known: {', '.join(CONSTANTS)}") from None


PUBLISHED_LOAD_PEAKS: tuple[PublishedLoadPeak, ...] = (
    PublishedLoadPeak(
        "Cosmos3-Nano DP2", 33.0, 2, 49.0,
        "DLO write-up: fresh cgroup, 31 GB cache + 18 GB RSS",
    ),
    PublishedLoadPeak("Cosmos3-Nano DP4", 33.0, 4, 47.0, "DLO write-up: cold-start cgroup peak with mmap"),
    PublishedLoadPeak("Cosmos3-Super DP4", 124.0, 4, 172.0, "DLO write-up: memory-scaling table"),
)
"""The three cgroup peaks the load constants are fitted to."""

PUBLISHED_EXTRAPOLATION: tuple[PublishedExtrapolation, ...] = (
    PublishedExtrapolation(33.0, 4, 47.0, 80.0),
    PublishedExtrapolation(124.0, 4, 172.0, 296.0),
    PublishedExtrapolation(185.0, 4, 220.0, 405.0),
    PublishedExtrapolation(400.0, 4, 423.0, 823.0),
    PublishedExtrapolation(400.0, 8, 443.0, 843.0),
)
"""The DLO write-up's memory-scaling table (first two rows measured, the rest estimated)."""

_AG_DP4_WAVE = 4 * 3600 / 151.89
_RL_DP8_WAVE = 8 * 3600 / 183.78

PUBLISHED_WAVES: tuple[PublishedWave, ...] = (
    PublishedWave(1, 8, "allgather", 34.55, "DLO write-up: P50 34.55 s"),
    PublishedWave(1, 8, "rank_local", 34.55 * 2.294, "AllGather +129.4% throughput: 34.55 s x 2.294"),
    PublishedWave(4, 2, "allgather", _AG_DP4_WAVE, "151.89 videos/h at 4 videos per wave"),
    PublishedWave(4, 2, "rank_local", _AG_DP4_WAVE * 1.022, "AllGather +2.2% throughput"),
    PublishedWave(8, 1, "rank_local", _RL_DP8_WAVE, "183.78 videos/h at 8 videos per wave"),
    PublishedWave(8, 1, "allgather", _RL_DP8_WAVE / 0.959, "AllGather -4.1% throughput"),
)
"""MiniMax-H3 T2VA wave times on 8x B300 used to calibrate the timing constants."""

PUBLISHED_DEVICE_PEAKS_GIB: Mapping[tuple[int, int], tuple[float, float]] = {
    (1, 8): (26.26, 23.53),
    (4, 2): (23.91, 24.97),
    (8, 1): (20.03, 94.03),
}
"""MiniMax-H3 study, paired five-wave comparison: measured per-GPU peak in GiB,
(dp, sp) -> (rank_local, allgather)."""


def positive(owner: str, name: str, value: object, expected: str) -> None:
    """Refuse ``owner``'s figure ``name`` unless it is a number > 0 (a bool is not one):
    ``ValueError`` naming both and what was ``expected``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{owner}{name}={value!r} is not allowed: expected {expected}")

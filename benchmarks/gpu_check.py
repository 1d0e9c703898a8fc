#!/usr/bin/env python
"""The accelerator path proven in one command: identity through every entry point, and a
FLUX.1-dev-shaped transformer at real size, each figure measured side by side.

    python benchmarks/gpu_check.py --out bench-out/gpu_check.json --markdown docs/benchmarks.md
        # one H200: about 4 minutes, start of Python included (add --wan: about 2 more)
    python benchmarks/gpu_check.py --device cpu      # every code path, tiny sizes, ~1 minute

What runs, in this order (every figure comes from this run; nothing is typed by hand):

1. **Host RSS in a clean process.** A child process (``--child rss``) builds the model,
   makes it streamed (2 slots), compiles it and calls it once; it does nothing else. Its
   peak and final RSS are compared with the host store it holds; its streaming time and
   first call (Dynamo's trace included) are those a user meets in a fresh process. It runs
   while the parent does step 2 (tiny models), so its timings may be a little high.
2. **Identity** (tiny models, on the device): a reference DiT through ``dlo_fx.load`` +
   compile and through ``dlo_fx.offload`` + compile (from the host and from the device),
   and ``dlo_fx.compile_pipeline`` on a tiny FluxPipeline, each against the same model or
   pipeline resident on the device, bit for bit.
3. **Flux at real size** (``FluxTransformer2DModel`` with the published FLUX.1-dev config,
   bf16, random weights built on the device; nothing is downloaded or written) at 1,024^2
   (4,096 image + 512 text tokens) and 2,048^2 (16,384 image tokens). Variants: resident,
   dlo 2 slots, dlo 3 slots, dlo with fp8 ``storage_dtype``, dlo with
   ``device_budget="auto"``, diffusers group offloading (block level, streams), and the
   pinned-copy floor: the streamed bytes copied host->device from pinned memory in block-
   sized copies. Each resolution: a first call per variant (timed, and compared with the
   resident output bit for bit), one warm-up round, then ``--runs`` rounds calling every
   variant in turn (order reversed every other round); medians and paired ratios. What
   lives at once is bounded by host memory: phase 1 holds resident, dlo 2 slots, auto and
   group offloading (both resolutions); phase 2 resident, dlo 3 slots and fp8. Phase 2 at
   2,048^2 is the first thing dropped to fit the time budget (``--budget-s``, 240 s): it
   runs only where the run is then expected to end in time (``--full``: always), and the
   output says when it was dropped.
   The compute-bound/transfer-bound label of a resolution is measured: resident step time
   against the pinned-copy floor.
4. **Wan2.1-14B** (``--wan``): ``WanTransformer3DModel`` with the published config at 480p /
   81 frames (latents 16 x 21 x 60 x 104): resident vs dlo 2 slots.

A failed check or a missed target makes the script exit 1, every reason printed. Targets
(at real size only; tiny sizes report them but do not apply them): compute-bound: dlo /
resident <= 1.01; transfer-bound: dlo / pinned-copy floor <= 1.05 and dlo / group
offloading <= 0.85; host RSS <= host store + 2 GiB; dlo outputs bit-identical to resident
(fp8 and group offloading excepted: reported only); no host sync in steady state.

How a model becomes a streamed one is `make_streamed`: ``dlo_fx.offload`` where this
dlo_fx has it, else (or with ``--via-load``) ``dlo_fx.load`` of a temporary safetensors
file of the same weights, written once per model.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import _timing as T  # noqa: E402

import dlo_fx  # noqa: E402
from dlo_fx.runtime import platform  # noqa: E402

GiB = 1 << 30

# -- the models --------------------------------------------------------------------------
# FLUX.1-dev's transformer/config.json (black-forest-labs/FLUX.1-dev)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4,
                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
               in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
               num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
               eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024)
WAN_TINY = dict(WAN_14B, num_attention_heads=2, attention_head_dim=16, text_dim=32,
                freq_dim=32, ffn_dim=64, num_layers=3, rope_max_seq_len=32)
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Resolution:
    label: str
    grid: tuple[int, int]  # packed latent grid (image tokens = h * w)
    text: int  # text tokens

    @property
    def image_tokens(self) -> int:
        return self.grid[0] * self.grid[1]


@dataclass(frozen=True)
class Sizes:
    tiny: bool
    flux: dict
    resolutions: tuple[Resolution, ...]
    wan: dict
    wan_latents: tuple[int, ...]  # C, F, H, W
    wan_text: int
    runs: int
    pipeline_hw: int = 16


def sizes(tiny: bool, runs: int) -> Sizes:
    if tiny:
        return Sizes(True, FLUX_TINY, (Resolution("1024^2 (tiny: 64 tokens)", (8, 8), 16),
                                       Resolution("2048^2 (tiny: 256 tokens)", (16, 16), 16)),
                     WAN_TINY, (16, 3, 8, 8), 16, runs)
    return Sizes(False, FLUX_DEV, (Resolution("1024^2", (64, 64), 512),
                                   Resolution("2048^2", (128, 128), 512)),
                 WAN_14B, (16, 21, 60, 104), 512, runs)


# -- the device ---------------------------------------------------------------------------
def compute_device(text: Optional[str]) -> torch.device:
    """The device named, with its index (``cuda`` -> ``cuda:0``): the model and the
    options then spell it alike."""
    device = torch.device(text) if text else platform.default_device()
    if device.type not in ("cpu", "meta") and device.index is None:
        acc = getattr(torch, "accelerator", None)
        index = (acc.current_device_index() if hasattr(acc, "current_device_index")
                 else torch.get_device_module(device).current_device())
        device = torch.device(device.type, index)
    return device


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        platform.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def _devmod(device: torch.device):
    return None if device.type == "cpu" else torch.get_device_module(device)


def allocated(device: torch.device) -> Optional[int]:
    mod = _devmod(device)
    return None if mod is None else int(mod.memory_allocated(device))


def reset_peak(device: torch.device) -> None:
    mod = _devmod(device)
    if mod is not None:
        mod.reset_peak_memory_stats(device)


def peak(device: torch.device) -> Optional[int]:
    mod = _devmod(device)
    return None if mod is None else int(mod.max_memory_allocated(device))


def host_rss() -> dict[str, Optional[int]]:
    """This process's resident set now and at its peak (``VmRSS``, ``VmHWM``), bytes."""
    out: dict[str, Optional[int]] = {"rss": None, "peak_rss": None}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = {"VmRSS:": "rss", "VmHWM:": "peak_rss"}.get(line.split(":")[0] + ":")
                if key:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def free_memory(device: torch.device) -> None:
    """Let go of what dropped variants held: compiled frames, runtimes, cached blocks."""
    torch._dynamo.reset()
    with contextlib.suppress(ImportError):
        from dlo_fx.runtime import reset_runtimes
        reset_runtimes()
    gc.collect()
    mod = _devmod(device)
    if mod is not None:
        mod.empty_cache()
        host_empty = getattr(mod, "empty_host_cache", None) or getattr(
            torch._C, "_host_emptyCache", None)
        if host_empty is not None:  # pinned blocks cached by PyTorch's host allocator
            with contextlib.suppress(Exception):
                host_empty()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN equal to the same NaN), shapes and dtypes included."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(view), b.contiguous().view(view)
    return torch.equal(a.cpu(), b.cpu())


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f} s] {msg}", flush=True)


START = time.perf_counter()


# -- making a streamed model: the one function ---------------------------------------------
VIA_LOAD = False  # --via-load: dlo_fx.load of a temporary file even where offload exists
_FILES: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
# (source model -> its safetensors file, the stand-in's; removed with the model)
_TMP: Optional[tempfile.TemporaryDirectory] = None


def offload_available() -> bool:
    return hasattr(dlo_fx, "offload") and not VIA_LOAD


def entry_point() -> str:
    return "dlo_fx.offload" if offload_available() else "dlo_fx.load (stand-in for offload)"


def _factory(model: torch.nn.Module) -> Callable[[], torch.nn.Module]:
    cls = type(model)
    if hasattr(cls, "from_config") and hasattr(model, "config"):  # a diffusers model
        config = dict(model.config)
        return lambda: cls.from_config(config)
    config = getattr(model, "config", None)  # the reference DiT
    return (lambda: cls(config)) if config is not None else cls


def checkpoint_of(model: torch.nn.Module, path: Optional[str] = None) -> str:
    """A safetensors file of ``model``'s weights, written once (the stand-in's input)."""
    global _TMP
    if model in _FILES:
        return _FILES[model]
    from safetensors.torch import save_file

    if path is None:
        if _TMP is None:
            _TMP = tempfile.TemporaryDirectory(prefix="gpu_check-")
        path = os.path.join(_TMP.name, f"model-{len(_FILES)}.safetensors")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()},
              path)
    _FILES[model] = path
    weakref.finalize(model, _remove, path)
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def make_streamed(source: torch.nn.Module, options: dict, *, copy_source: bool = True
                  ) -> tuple[torch.nn.Module, float]:
    """A streamed twin of ``source`` with ``options`` (its compute device included), and
    the seconds it took. ``dlo_fx.offload`` of a copy of ``source`` (``source`` itself with
    ``copy_source=False``), or ``dlo_fx.load`` of ``source``'s weights from a temporary
    file where offload does not exist (or ``--via-load``)."""
    device = torch.device(options["device"])
    if offload_available():
        model = copy.deepcopy(source) if copy_source else source
        return timed(lambda: offload(model, options), device)[::-1]
    path = checkpoint_of(source)
    dtype = model_dtype(source)
    seconds, model = timed(lambda: dlo_fx.load(_factory(source), path, dtype=dtype,
                                               options=options), device)
    return model, seconds


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The floating dtype most of ``model``'s parameters have (its float32 modules aside)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.dtype.is_floating_point:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get)


def offload(model: torch.nn.Module, options: dict) -> torch.nn.Module:
    """``dlo_fx.offload(model, options=...)``: the model it returns, else ``model``."""
    out = dlo_fx.offload(model, options=options)
    return out if isinstance(out, torch.nn.Module) else model


def compiled(model: torch.nn.Module, options: dict) -> Callable:
    """``torch.compile(model, backend="dlo", options=<the streamed model's>)``.

    The model inherits its options without them; they are repeated here because Dynamo
    shares a compiled frame between modules of one class compiled with equal backend
    arguments, and a dlo graph is scheduled for its runtime's options (slots, budget,
    storage dtype): two variants compiled with bare ``backend="dlo"`` would run the first
    one's graph (dlo refuses that: "this graph was scheduled for 3 slots ...")."""
    return torch.compile(model, backend="dlo", options=options, dynamic=False)


# -- models and inputs -----------------------------------------------------------------------
@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(cls_name: str, config: dict, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A diffusers transformer with random weights, built in bf16 on ``device``, its
    ``_keep_in_fp32_modules`` in float32 (as ``from_pretrained(torch_dtype=bf16)`` and
    ``dlo_fx.load(dtype=bf16)`` give it)."""
    import diffusers

    torch.manual_seed(seed)
    with torch.device(device), default_dtype(DTYPE):
        model = getattr(diffusers, cls_name)(**config)
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dtype.is_floating_point:
                want = torch.float32 if any(k in name.split(".") for k in keep) else DTYPE
                if t.dtype != want:
                    t.data = t.data.to(want)
    return model.eval().requires_grad_(False)


def flux_inputs(cfg: dict, res: Resolution, device: torch.device, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, w = res.grid
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(h)),
                                     torch.arange(float(w)), indexing="ij"), -1).reshape(-1, 3)
    kw = dict(hidden_states=torch.randn(1, h * w, cfg["in_channels"], generator=g),
              encoder_hidden_states=torch.randn(1, res.text, cfg["joint_attention_dim"],
                                                generator=g),
              pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=g),
              timestep=torch.tensor([1.0]), guidance=torch.tensor([3.5]))
    kw = {k: v.to(device, DTYPE) for k, v in kw.items()}
    kw.update(img_ids=ids.to(device), txt_ids=torch.zeros(res.text, 3, device=device),
              return_dict=False)
    return kw


def wan_inputs(cfg: dict, latents: tuple[int, ...], text: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, *latents, generator=g).to(device, DTYPE),
                encoder_hidden_states=torch.randn(1, text, cfg["text_dim"], generator=g
                                                  ).to(device, DTYPE),
                timestep=torch.tensor([999], device=device), return_dict=False)


def call(fn: Callable, kw: dict) -> torch.Tensor:
    with torch.inference_mode():
        out = fn(**kw)
    return out[0] if isinstance(out, (tuple, list)) else out


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- the pinned-copy floor ---------------------------------------------------------------
class CopyFloor:
    """``nbytes`` copied host->device in copies of ``chunk`` bytes from one page-locked
    buffer (pageable on CPU), on the current stream: what streaming those bytes costs at
    the least."""

    def __init__(self, nbytes: int, chunk: int, device: torch.device) -> None:
        chunk = max(1, min(chunk, nbytes))
        self.nbytes, self.device = nbytes, device
        self.src = torch.empty(chunk, dtype=torch.uint8, pin_memory=platform.can_pin(device))
        self.src.fill_(1)
        self.dst = [torch.empty(chunk, dtype=torch.uint8, device=device) for _ in range(2)]
        self.sizes = [chunk] * (nbytes // chunk) + ([nbytes % chunk] if nbytes % chunk else [])

    def __call__(self) -> None:
        for i, n in enumerate(self.sizes):
            self.dst[i % 2][:n].copy_(self.src[:n], non_blocking=True)


# -- a measured variant -------------------------------------------------------------------
@dataclass
class Variant:
    name: str
    fn: Callable  # called with the inputs' keyword arguments
    model: Optional[torch.nn.Module]
    exact: bool  # must equal resident bit for bit
    streamed_bytes: int = 0  # bytes it copies host->device per call
    own_device_bytes: Optional[int] = None  # device bytes it holds between calls
    figures: dict = field(default_factory=dict)


def dlo_variant(name: str, source: torch.nn.Module, options: dict, device: torch.device,
                exact: bool = True) -> Variant:
    before_dev, before_rss = allocated(device), host_rss()["rss"]
    model, seconds = make_streamed(source, options)
    variant = Variant(name, compiled(model, options), model, exact)
    variant.figures.update(offload_s=seconds, entry_point=entry_point(), options={
        k: str(v) for k, v in options.items()})
    variant.figures["_before"] = (before_dev, before_rss)
    return variant


def group_offload_variant(source: torch.nn.Module, device: torch.device) -> Variant:
    before_dev, before_rss = allocated(device), host_rss()["rss"]
    model = copy.deepcopy(source)
    streams = device.type != "cpu"

    def apply():
        model.enable_group_offload(device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1,
                                   use_stream=streams)
    seconds, _ = timed(apply, device)
    variant = Variant("group offload" + ("" if streams else " (CPU: no streams)"), model,
                      model, False, streamed_bytes=param_bytes(model))
    variant.figures.update(offload_s=seconds, _before=(before_dev, before_rss))
    return variant


RSS_ADDED = ("\"host RSS added\" is cumulative: the growth of the process's RSS from just "
             "before a variant was made to the end of its first call. A phase makes all its variants before "
             "it calls any, so a row also counts the host memory of the variants listed after "
             "it in its phase; a variant's own share is its figure minus the next row's.")
"""What the table's "host RSS added" column includes (`first_call`, `markdown`)."""


def first_call(v: Variant, kw: dict, device: torch.device, reference: Optional[torch.Tensor],
               res: Resolution) -> None:
    """The variant's first call at ``res`` (a compile for dlo), timed and compared."""
    seconds, out = timed(lambda: call(v.fn, kw), device)
    f = v.figures.setdefault(res.label, {})
    f["first_call_s"] = seconds
    f["exact_required"] = v.exact
    if reference is not None:
        f["bit_identical"] = bits_equal(out, reference)
        if not f["bit_identical"] and out.shape == reference.shape:
            f["max_abs_diff"] = float((out.float() - reference.float()).abs().max())
    f["finite"] = bool(torch.isfinite(out).all())
    before = v.figures.pop("_before", None)
    if before is not None:  # its first call: what it holds from now on
        dev, rss = before
        now = allocated(device)
        v.own_device_bytes = None if dev is None else now - dev
        after = host_rss()["rss"]
        v.figures["host_rss_added"] = None if rss is None or after is None else after - rss
        if v.model is not None and v.name.startswith("dlo"):
            report = dlo_fx.memory_report(v.model)
            v.streamed_bytes = report.streamed_bytes_per_call
            v.figures.update(host_store_bytes=report.host_shard_bytes,
                             slot_bytes=report.slot_bytes, num_blocks=report.num_blocks,
                             resident_blocks=report.num_resident_blocks,
                             max_block_bytes=report.max_block_bytes)
    del out


def budget_figures(variants: list, label: str) -> None:
    """The device budget's plan of each dlo variant at ``label``, after its timed rounds:
    resident blocks, the predicted step time beside the measured median, and (auto) the
    capacity and the activation peak it planned from (`dlo_fx.memory_report`)."""
    for v in variants:
        f = v.figures.get(label)
        if v.model is None or not v.name.startswith("dlo") or f is None:
            continue
        report = dlo_fx.memory_report(v.model)
        f["resident_blocks"] = report.num_resident_blocks
        f["streamed_bytes_per_call"] = report.streamed_bytes_per_call
        if report.predicted_s_per_call is not None:
            f["predicted_step_ms"] = report.predicted_s_per_call * 1e3
            if f.get("step_ms"):
                f["measured_over_predicted"] = f["step_ms"] / f["predicted_step_ms"]
        f["device_capacity_bytes"] = report.device_capacity_bytes
        f["activation_peak_bytes"] = report.activation_peak_bytes
        f["weights_budget_bytes"] = report.weights_budget_bytes


def device_peak(v: Variant, kw: dict, device: torch.device) -> Optional[int]:
    """Device bytes the variant needs during one call: its peak less what others hold."""
    if device.type == "cpu":
        return None
    sync(device)
    others = allocated(device) - (v.own_device_bytes or 0)
    reset_peak(device)
    call(v.fn, kw)
    sync(device)
    return peak(device) - others


def measure(variants: list[Variant], kw: dict, res: Resolution, floor: CopyFloor,
            device: torch.device, runs: int, reference: Optional[torch.Tensor]) -> dict:
    """First calls (compared with ``reference``), device peaks, then interleaved rounds of
    every variant and the pinned-copy floor; medians and ratios measured round by round."""
    for v in variants:
        if res.label not in v.figures:
            log(f"  {res.label}: first call of {v.name}")
            first_call(v, kw, device, reference, res)
    for v in variants:
        v.figures[res.label]["device_peak"] = device_peak(v, kw, device)

    def synced(fn):  # the previous call ended synchronised: its timer starts on an idle device
        return lambda: (fn(), sync(device))

    fns = {v.name: synced((lambda f: lambda: call(f, kw))(v.fn)) for v in variants}
    fns["pinned-copy floor"] = synced(floor)
    log(f"  {res.label}: {runs} interleaved rounds of {', '.join(fns)}")
    sync(device)
    times = T.interleaved(fns, reps=runs, warmup=1).times  # one warm-up round, A B / B A
    floor_t = times["pinned-copy floor"]
    resident_t = times.get("resident")
    out = {"floor_ms": T.median(floor_t) * 1e3, "floor_bytes": floor.nbytes,
           "floor_GBps": floor.nbytes / T.median(floor_t) / 1e9, "runs": runs,
           "samples_ms": {k: [t * 1e3 for t in v] for k, v in times.items()}}
    group = next((v for v in variants if v.name.startswith("group offload")), None)
    for v in variants:
        t = times[v.name]
        f = v.figures[res.label]
        f["step_ms"] = T.median(t) * 1e3
        if resident_t is not None:
            f["over_resident"] = T.median([a / b for a, b in zip(t, resident_t)])
        if v.streamed_bytes:
            scale = v.streamed_bytes / floor.nbytes
            f["over_floor"] = T.median([a / (b * scale) for a, b in zip(t, floor_t)])
        if group is not None and v is not group and v.name.startswith("dlo"):
            f["over_group_offload"] = T.median([a / b for a, b in zip(t, times[group.name])])
    if resident_t is not None:
        res_ms = T.median(resident_t) * 1e3
        out["resident_ms"] = res_ms
        out["label"] = "compute-bound" if res_ms >= out["floor_ms"] else "transfer-bound"
        out["label_why"] = (f"resident step {res_ms:.1f} ms "
                            f"{'>=' if res_ms >= out['floor_ms'] else '<'} pinned-copy floor "
                            f"{out['floor_ms']:.1f} ms ({floor.nbytes / 1e9:.2f} GB)")
    return out


# -- checks --------------------------------------------------------------------------------
class Checks:
    """Every failed check or missed target, with its reason; printed as found."""

    def __init__(self, apply_targets: bool) -> None:
        self.failures: list[str] = []
        self.apply_targets = apply_targets

    def check(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failures.append(what)
            print(f"FAILED: {what}", flush=True)
        return ok

    def target(self, value: Optional[float], limit: float, what: str, record: dict) -> None:
        met = value is not None and value <= limit
        record[what] = {"value": value, "limit": limit, "met": met,
                        "applied": self.apply_targets}
        if self.apply_targets:
            self.check(met, f"target missed: {what} = {value} (limit {limit})")


def identity(device: torch.device, checks: Checks) -> dict:
    """Bit identity through every entry point, tiny models, against the same model or
    pipeline resident on ``device``."""
    from dlo_fx.apps.models import example_inputs, reference_dit

    out: dict[str, Any] = {}
    options = {"device": str(device)}

    def dit(on: torch.device):
        return reference_dit(width=64, depth=3, heads=4, seed=0, device=on).eval(
            ).requires_grad_(False)

    ref_model = dit(device)
    inputs = example_inputs(ref_model.config, batch=1, height=8, width=8, seed=1, device=device)
    with torch.inference_mode():
        ref = ref_model(*inputs)

    def run(name: str, make: Callable[[], torch.nn.Module]) -> None:
        try:
            fn = compiled(make(), options)
            with torch.inference_mode():
                outs = [fn(*inputs) for _ in range(2)]
            out[name] = all(bits_equal(o, ref) for o in outs)
        except Exception as exc:  # the reason is the result
            out[name] = f"error: {type(exc).__name__}: {exc}"[:600]
            traceback.print_exc()
        checks.check(out[name] is True, f"identity {name}: {out[name]}")

    run("load + compile (reference DiT)",
        lambda: dlo_fx.load(_factory(ref_model), checkpoint_of(ref_model), options=options))
    if hasattr(dlo_fx, "offload"):
        run("offload + compile, model on the device (reference DiT)",
            lambda: offload(dit(device), options))
        if device.type != "cpu":
            run("offload + compile, model in host memory (reference DiT)",
                lambda: offload(dit(torch.device("cpu")), options))
    else:
        out["offload + compile"] = "not run: this dlo_fx has no dlo_fx.offload"
        print("NOTE: dlo_fx.offload does not exist here; its identity check is not run",
              flush=True)
    out["compile_pipeline (tiny FluxPipeline)"] = pipeline_identity(device)
    checks.check(out["compile_pipeline (tiny FluxPipeline)"] is True,
                 f"identity compile_pipeline: {out['compile_pipeline (tiny FluxPipeline)']}")
    return out


def pipeline_identity(device: torch.device):
    """`dlo_fx.compile_pipeline` on a tiny FluxPipeline (host memory, compute on
    ``device``) against the same pipeline resident on ``device``."""
    try:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import diffusers_pipelines as dp

        reference = dp.flux().to(device)
        expected = dp.images(reference, "flux")
        del reference
        pipe = dp.flux()
        dlo_fx.compile_pipeline(pipe, options={"device": str(device)})
        got = [dp.images(pipe, "flux") for _ in range(2)]
        return all(bits_equal(g, expected) for g in got)
    except Exception as exc:
        traceback.print_exc()
        return f"error: {type(exc).__name__}: {exc}"[:600]


def no_host_sync(v: Variant, resident: Variant, kw: dict, device: torch.device) -> dict:
    """One steady call under ``sync_debug("error")``: the resident model first (a sync of
    the model's own code is not dlo's)."""
    if device.type == "cpu":
        return {"skipped": "no host-device syncs exist on CPU"}
    call(v.fn, kw)
    try:
        with platform.sync_debug(device, "error"):
            call(resident.fn, kw)
    except RuntimeError as exc:
        return {"skipped": f"the resident model itself syncs: {str(exc)[:200]}"}
    try:
        with platform.sync_debug(device, "error"):
            call(v.fn, kw)
        return {"steady_state_syncs": 0}
    except RuntimeError as exc:
        return {"steady_state_syncs": "found", "error": str(exc)[:400]}


# -- the child: host RSS of a process that does nothing else ---------------------------------
def child_rss(args) -> int:
    device = compute_device(args.device)
    cfg = sizes(args.tiny, 1)
    res = cfg.resolutions[0]
    out: dict[str, Any] = {"entry_point": entry_point(), "rss_start": host_rss()["rss"]}
    options = {"device": str(device), "num_slots": 2, "device_budget": None}
    if args.checkpoint:  # the stand-in: the parent wrote the weights
        out["built"] = "weights from the parent's file"
        seconds, model = timed(lambda: dlo_fx.load(
            lambda: __import__("diffusers").FluxTransformer2DModel(**cfg.flux),
            args.checkpoint, dtype=DTYPE, options=options), device)
    else:
        seconds, model = timed(lambda: build("FluxTransformer2DModel", cfg.flux, device), device)
        out["build_s"] = seconds
        model, seconds = make_streamed(model, options, copy_source=False)
    out["offload_s"] = seconds
    out["rss_after_offload"] = host_rss()["rss"]
    kw = flux_inputs(cfg.flux, res, device)
    out["first_call_s"], _ = timed(lambda: call(compiled(model, options), kw), device)
    report = dlo_fx.memory_report(model)
    out.update(host_rss())
    out.update(host_store_bytes=report.host_shard_bytes, slot_bytes=report.slot_bytes,
               pinned_allocated_bytes=report.pinned_allocated_bytes, resolution=res.label)
    T.write_json(args.json, out)
    return 0


def start_child(args, device: torch.device, checkpoint: Optional[str], path: str):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "rss", "--device", str(device),
           "--json", path] + (["--tiny"] if args.tiny else []) + (
        ["--checkpoint", checkpoint] if checkpoint else []) + (
        ["--via-load"] if VIA_LOAD else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish_child(proc, path: str, checks: Checks) -> dict:
    output, _ = proc.communicate()
    if proc.returncode != 0 or not os.path.exists(path):
        print(output[-4000:], flush=True)
        checks.check(False, f"host-RSS child exited {proc.returncode}: {output[-600:]}")
        return {"error": output[-2000:]}
    with open(path) as f:
        out = json.load(f)
    store = out["host_store_bytes"]
    out["peak_rss_over_store"] = out["peak_rss"] - store if out.get("peak_rss") else None
    return out


# -- the whole run ----------------------------------------------------------------------------
def flux_section(cfg: Sizes, device: torch.device, resident_model: torch.nn.Module,
                 checks: Checks, full: bool, budget_s: Optional[float], result: dict,
                 save: Callable[[], None]) -> None:
    resident = Variant("resident", resident_model, resident_model, True,
                       own_device_bytes=param_bytes(resident_model))
    dev = str(device)
    section: dict[str, Any] = {"config": {k: str(v) for k, v in cfg.flux.items()},
                               "parameters": sum(p.numel() for p in resident_model.parameters()),
                               "weight_bytes": param_bytes(resident_model),
                               "entry_point": entry_point(), "resolutions": {}}
    result["flux"] = section
    inputs = {r.label: flux_inputs(cfg.flux, r, device) for r in cfg.resolutions}
    refs: dict[str, torch.Tensor] = {}
    for r in cfg.resolutions:
        seconds, refs[r.label] = timed(lambda: call(resident_model, inputs[r.label]), device)
        resident.figures.setdefault(r.label, {})["first_call_s"] = seconds
    section["dropped"] = []
    spent: dict[str, float] = {}  # phase 1's rounds (no first calls), seconds, by resolution
    floor: Optional[CopyFloor] = None
    phases = [(["dlo 2 slots", "dlo auto budget", "group offload"], cfg.resolutions),
              (["dlo 3 slots", "dlo fp8", "dlo half budget"], cfg.resolutions)]
    for phase, (names, resolutions) in enumerate(phases, 1):
        log(f"flux: phase {phase}: making {', '.join(names)}")
        variants: list[Variant] = []
        for name in names:
            try:
                if name == "group offload":
                    variants.append(group_offload_variant(resident_model, device))
                    continue
                # Streaming variants stream every block (device_budget=None); "dlo auto
                # budget" takes the default options (device_budget="auto"), "dlo half
                # budget" a budget of half the model's bytes.
                opts = {"device": dev, "num_slots": 3 if "3 slots" in name else 2,
                        "device_budget": None}
                if "fp8" in name:
                    opts["storage_dtype"] = torch.float8_e4m3fn
                if "auto" in name:
                    opts = {"device": dev}
                if "half budget" in name:
                    opts["device_budget"] = param_bytes(resident_model) // 2
                variants.append(dlo_variant(name, resident_model, opts, device,
                                            exact="fp8" not in name))
            except Exception as exc:
                traceback.print_exc()
                checks.check(False, f"flux {name}: could not be made: {type(exc).__name__}: {exc}")
        for i, r in enumerate(resolutions):
            if phase == 2 and i > 0 and not full:  # the first to go when time is short
                first = resolutions[0].label
                estimate = spent.get(r.label, 0.0) + sum(
                    v.figures.get(first, {}).get("first_call_s", 0.0) for v in variants)
                end = time.perf_counter() - START + estimate
                if budget_s is None or end > budget_s:
                    why = (f"{' and '.join(names)} at {r.label}: not measured, to fit the time "
                           + (f"budget (--budget-s {budget_s:.0f}: this run would end near "
                              f"{end:.0f} s)" if budget_s is not None else
                              "budget of tiny sizes") + "; --full measures them")
                    section["dropped"].append(why)
                    log(why)
                    continue
            try:
                for v in variants:
                    if r.label not in v.figures:
                        log(f"  {r.label}: first call of {v.name}")
                        first_call(v, inputs[r.label], device, refs[r.label], r)
                if floor is None:
                    base = next(v for v in variants if v.name == "dlo 2 slots")
                    floor = CopyFloor(base.streamed_bytes, base.figures["max_block_bytes"],
                                      device)
                started = time.perf_counter()
                figures = measure([resident] + variants, inputs[r.label], r, floor, device,
                                  cfg.runs, refs[r.label])
            except Exception as exc:
                traceback.print_exc()
                checks.check(False, f"flux {r.label} ({', '.join(names)}): "
                                    f"{type(exc).__name__}: {exc}")
                continue
            budget_figures(variants, r.label)
            into = section["resolutions"].setdefault(r.label, {
                "image_tokens": r.image_tokens, "text_tokens": r.text, "variants": {}})
            into[f"phase {phase}"] = figures
            for v in [resident] + variants:
                if v is resident and phase > 1:  # its row is phase 1's; phase 2's in samples
                    continue
                into["variants"][v.name] = {**v.figures.get(r.label, {}),
                                            **{k: val for k, val in v.figures.items()
                                               if not isinstance(val, dict) and k[0] != "_"},
                                            "own_device_bytes": v.own_device_bytes}
            if "dlo 2 slots" in names:
                into["label"], into["label_why"] = figures.get("label"), figures.get("label_why")
                into["no_host_sync"] = no_host_sync(
                    next(v for v in variants if v.name == "dlo 2 slots"), resident,
                    inputs[r.label], device)
                syncs = into["no_host_sync"].get("steady_state_syncs")
                checks.check(syncs in (0, None), f"flux {r.label}: host syncs in steady "
                                                 f"state: {into['no_host_sync']}")
            if phase == 1:
                spent[r.label] = time.perf_counter() - started
            save()
        for v in variants:
            for r in resolutions:
                f = v.figures.get(r.label, {})
                if v.exact and "bit_identical" in f:
                    checks.check(f["bit_identical"], f"flux {r.label} {v.name}: output differs "
                                 f"from resident (max |diff| {f.get('max_abs_diff')})")
        del variants
        free_memory(device)
    for r in cfg.resolutions:
        into = section["resolutions"].get(r.label)
        if not into or "dlo 2 slots" not in into["variants"]:
            continue
        d = into["variants"]["dlo 2 slots"]
        targets = into.setdefault("targets", {})
        auto = into["variants"].get("dlo auto budget", {})
        if "over_resident" in auto:
            checks.target(auto["over_resident"], 1.02,
                          f"flux {r.label} dlo auto budget/resident", targets)
        half = into["variants"].get("dlo half budget", {})
        if half.get("measured_over_predicted") is not None:
            checks.target(abs(half["measured_over_predicted"] - 1), 0.10,
                          f"flux {r.label} dlo half budget |measured/predicted - 1|", targets)
        if "step_ms" in half and "step_ms" in d:
            checks.target(half["step_ms"] / d["step_ms"], 1.0,
                          f"flux {r.label} dlo half budget/dlo 2 slots", targets)
        if into.get("label") == "compute-bound":
            checks.target(d.get("over_resident"), 1.01, f"flux {r.label} dlo/resident", targets)
        elif into.get("label") == "transfer-bound":
            checks.target(d.get("over_floor"), 1.05, f"flux {r.label} dlo/pinned-copy floor",
                          targets)
            if "over_group_offload" in d:
                checks.target(d["over_group_offload"], 0.85,
                              f"flux {r.label} dlo/group offloading", targets)
    save()


def wan_section(cfg: Sizes, device: torch.device, checks: Checks, result: dict) -> None:
    log("wan: building the resident model")
    resident_model = build("WanTransformer3DModel", cfg.wan, device)
    res = Resolution("480p x 81 frames" if not cfg.tiny else "tiny: 3 x 8 x 8 latents",
                     (cfg.wan_latents[1] * cfg.wan_latents[2] // 2, cfg.wan_latents[3] // 2),
                     cfg.wan_text)
    kw = wan_inputs(cfg.wan, cfg.wan_latents, cfg.wan_text, device)
    resident = Variant("resident", resident_model, resident_model, True,
                       own_device_bytes=param_bytes(resident_model))
    seconds, ref = timed(lambda: call(resident_model, kw), device)
    resident.figures[res.label] = {"first_call_s": seconds}
    v = dlo_variant("dlo 2 slots", resident_model, {"device": str(device), "num_slots": 2,
                                                     "device_budget": None}, device)
    log(f"  {res.label}: first call of {v.name}")
    first_call(v, kw, device, ref, res)
    floor = CopyFloor(v.streamed_bytes, v.figures["max_block_bytes"], device)
    figures = measure([resident, v], kw, res, floor, device, cfg.runs, ref)
    result["wan"] = {"config": {k: str(val) for k, val in cfg.wan.items()}, "resolution": res.label,
                     "latents": list(cfg.wan_latents), "tokens": res.image_tokens,
                     "weight_bytes": param_bytes(resident_model), **figures,
                     "variants": {x.name: {**x.figures.get(res.label, {}),
                                           **{k: val for k, val in x.figures.items()
                                              if not isinstance(val, dict) and k[0] != "_"},
                                           "own_device_bytes": x.own_device_bytes}
                                  for x in (resident, v)}}
    d = result["wan"]["variants"]["dlo 2 slots"]
    checks.check(d.get("bit_identical", False), "wan dlo 2 slots: output differs from resident")
    targets = result["wan"].setdefault("targets", {})
    if figures.get("label") == "compute-bound":
        checks.target(d.get("over_resident"), 1.01, "wan dlo/resident", targets)
    else:
        checks.target(d.get("over_floor"), 1.05, "wan dlo/pinned-copy floor", targets)
    del v, resident, resident_model
    free_memory(device)


# -- the plan's prediction beside each measured row ---------------------------------------
PLAN_OPTIONS: dict[str, Any] = {
    "dlo 2 slots": {"num_slots": 2, "device_budget": None},
    "dlo 3 slots": {"num_slots": 3, "device_budget": None},
    "dlo fp8": {"num_slots": 2, "device_budget": None, "storage_dtype": torch.float8_e4m3fn},
    "dlo auto budget": {},  # the default options, as the variant
    "dlo half budget": "half",  # device_budget = half the model's bytes, as the variant
    "resident": "resident",  # nothing copied: the plan's compute alone
}
"""The dlo_fx.plan options of each measured variant (group offloading is not dlo's)."""


def plan_hardware(requested: Optional[str], device_name: str) -> tuple[Optional[str], str]:
    """The dlo_fx.plan preset to predict this device with, and a note: ``--hardware``,
    else the preset the device's name names, else (on the CPU) the H200's, which shows the
    printing path only."""
    if requested:
        return requested, f"--hardware {requested}"
    key = "".join(ch for ch in device_name.lower() if ch.isalnum())
    for token, name in (("h200", "h200"), ("h100pcie", "h100-pcie"), ("h100", "h100-sxm"),
                        ("b200", "b200"), ("b300", "b300"), ("a100", "a100-80gb"),
                        ("l40s", "l40s"), ("4090", "rtx-4090"), ("910b", "ascend-910b3")):
        if token in key:
            return name, f"the {name} preset (from the device name {device_name!r})"
    if device_name == "cpu":
        return "h200", "the h200 preset: no preset describes a CPU, so this only shows the path"
    return None, f"no preset matches {device_name!r}; pass --hardware"


def add_predictions(result: dict, cfg: Sizes, hardware: Optional[str], note: str,
                    checks: Checks) -> None:
    """``dlo_fx.plan``'s prediction for each measured dlo row (and the resident one), on
    the meta device at the row's inputs: stored in the row as ``plan``."""
    result["plan_hardware"] = {"preset": hardware, "why": note}
    if hardware is None:
        return
    from dlo_fx.apps.plan import plan

    meta = torch.device("meta")
    weight_bytes = result.get("flux", {}).get("weight_bytes", 0)
    sections = []
    if result.get("flux"):
        by_label = {r.label: r for r in cfg.resolutions}
        sections += [("FluxTransformer2DModel", cfg.flux, flux_inputs(cfg.flux, by_label[label], meta),
                      into["variants"]) for label, into in result["flux"]["resolutions"].items()]
    if result.get("wan"):
        sections.append(("WanTransformer3DModel", cfg.wan,
                         wan_inputs(cfg.wan, cfg.wan_latents, cfg.wan_text, meta),
                         result["wan"]["variants"]))
    for cls_name, config, kw, variants in sections:
        for name, row in variants.items():
            options = PLAN_OPTIONS.get(name)
            if options is None:
                continue
            opts = {"num_slots": 2, "device_budget": None} if options == "resident" else \
                {"device_budget": weight_bytes // 2} if options == "half" else options
            try:
                model = build(cls_name, config, meta)
                planned = plan(model, kw, hardware=hardware, options=opts)
            except Exception as exc:
                traceback.print_exc()
                checks.check(False, f"plan of {cls_name} {name}: {type(exc).__name__}: {exc}")
                continue
            step = sum(planned.compute_s) if options == "resident" else planned.predicted_step_s
            row["plan"] = {"hardware": hardware, "predicted_step_ms": step * 1e3,
                           "bound": "compute" if options == "resident" else planned.bound,
                           "resident_blocks": len(planned.resident_blocks),
                           "num_blocks": planned.num_blocks,
                           "device_bytes": planned.device_bytes["total"]}
            if row.get("step_ms"):
                row["plan"]["measured_over_plan"] = row["step_ms"] / (step * 1e3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="default: the accelerator, else cpu")
    parser.add_argument("--out", default="bench-out/gpu_check.json")
    parser.add_argument("--markdown", default=None, metavar="PATH",
                        help="append the results table to PATH (e.g. docs/benchmarks.md)")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds after warm-up (>= 5)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny sizes on any device (the default on CPU)")
    parser.add_argument("--full", action="store_true",
                        help="also dlo 3 slots and fp8 at 2,048^2 (about +1 minute on an H200)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="dlo 3 slots and fp8 at 2,048^2 run only if the whole run is then "
                             "expected to end within this many seconds (default: 240 at real "
                             "sizes; at tiny sizes they are dropped unless this is given)")
    parser.add_argument("--wan", action="store_true",
                        help="also Wan2.1-14B at 480p / 81 frames (about +2 minutes on an H200)")
    parser.add_argument("--via-load", action="store_true",
                        help="make streamed models with dlo_fx.load of a temporary file, even "
                             "where dlo_fx.offload exists")
    parser.add_argument("--no-child", action="store_true", help="skip the host-RSS child")
    parser.add_argument("--hardware", default=None,
                        help="the dlo_fx.plan preset whose prediction each row prints "
                             "(default: the one the device's name names)")
    parser.add_argument("--child", choices=["rss"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global VIA_LOAD, START
    VIA_LOAD = VIA_LOAD or args.via_load
    START = time.perf_counter()
    device = compute_device(args.device)
    args.tiny = args.tiny or device.type == "cpu"
    if device.type == "cpu":  # tiny ops: OpenMP threads only spin on a shared machine
        torch.set_num_threads(1)
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):  # one code object, many compiled twins
            setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))
    if args.child:
        return child_rss(args)
    if args.runs < 5:
        print(f"NOTE: --runs {args.runs}: the figures are medians of fewer than 5 rounds",
              flush=True)
    cfg = sizes(args.tiny, args.runs)
    checks = Checks(apply_targets=not cfg.tiny)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "device": str(device),
        "device_name": (torch.get_device_module(device).get_device_name(device)
                        if device.type != "cpu" else "cpu"),
        "sizes": "tiny" if cfg.tiny else "real", "entry_point": entry_point(),
        "offload_exists": hasattr(dlo_fx, "offload"), "machine": T.machine_info(),
        "targets_applied": checks.apply_targets, "runs": cfg.runs,
    }

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - START, 1)
        result["failures"] = checks.failures
        T.write_json(args.out, result, indent=1)

    log(f"{result['device_name']}: {'tiny' if cfg.tiny else 'real'} sizes, streamed models "
        f"through {entry_point()}")
    try:
        log("flux: building the resident model on the device")
        seconds, resident_model = timed(
            lambda: build("FluxTransformer2DModel", cfg.flux, device), device)
        result["flux_build_s"] = seconds
        child = None
        child_dir = tempfile.TemporaryDirectory(prefix="gpu_check-child-")
        child_json = os.path.join(child_dir.name, "rss.json")
        if not args.no_child:
            stand_in = None if offload_available() else checkpoint_of(resident_model)
            log("host RSS: child process started (runs beside the identity checks)")
            child = start_child(args, device, stand_in, child_json)
        log("identity: every entry point, tiny models")
        result["identity"] = identity(device, checks)
        save()
        if child is not None:
            result["host_rss_child"] = finish_child(child, child_json, checks)
            child_dir.cleanup()
            rss = result["host_rss_child"]
            if "peak_rss" in rss:
                log(f"host RSS child: peak {rss['peak_rss'] / GiB:.2f} GiB for a "
                    f"{rss['host_store_bytes'] / GiB:.2f} GiB host store")
                checks.target(rss["peak_rss_over_store"] / GiB, 2.0,
                              "host RSS peak - host store (GiB)", rss.setdefault("targets", {}))
            save()
        budget = args.budget_s if args.budget_s is not None else None if cfg.tiny else 240.0
        flux_section(cfg, device, resident_model, checks, args.full, budget, result, save)
        del resident_model
        free_memory(device)
        if args.wan:
            wan_section(cfg, device, checks, result)
    except Exception as exc:
        traceback.print_exc()
        checks.check(False, f"gpu_check stopped: {type(exc).__name__}: {exc}")
    try:
        add_predictions(result, cfg, *plan_hardware(args.hardware, result["device_name"]),
                        checks)
    except Exception as exc:
        traceback.print_exc()
        checks.check(False, f"the plan's predictions: {type(exc).__name__}: {exc}")
    save()
    if _TMP is not None:  # the stand-in's files (a forked caller may never run atexit)
        _TMP.cleanup()
    table = markdown(result)
    print(table, flush=True)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + table)
    log(f"done; JSON in {args.out}")
    if checks.failures:
        print(f"\n{len(checks.failures)} FAILED:", flush=True)
        for line in checks.failures:
            print(f"  - {line}", flush=True)
        return 1
    return 0


# -- the markdown table --------------------------------------------------------------------
def _f(value, fmt: str = "{:.3f}", none: str = "-") -> str:
    return none if value is None else fmt.format(value)


def _gib(value) -> str:
    return _f(None if value is None else value / GiB, "{:.2f} GiB")


def _exact(v: dict) -> str:
    same = v.get("bit_identical")
    if same is None:
        return "-"
    if not v.get("exact_required", True):
        return f"{'yes' if same else 'no'} (not required)"
    return "yes" if same else "NO"


def _predicted(v: dict) -> str:
    p = v.get("plan")
    return "-" if not p else f"{p['predicted_step_ms']:.1f} ms ({p['bound']})"


def markdown(result: dict) -> str:
    m = result["machine"]
    tiny = ", tiny sizes" if result["sizes"] == "tiny" else ""
    lines = [f"## GPU: real size (`benchmarks/gpu_check.py`{tiny})", "",
             f"{result['device_name']} ({result['device']}), torch {m['torch']}, "
             f"{T.cpu_text(m)}, {m['nproc']} CPUs; {result['date']}; streamed models made "
             f"with {result['entry_point']}; medians of {result['runs']} interleaved rounds "
             f"after one warm-up round; whole run {result.get('elapsed_s')} s.", ""]
    ident = result.get("identity", {})
    if ident:
        lines.append("Identity (tiny models, bit for bit against the same model resident on "
                     "the device): " + "; ".join(f"{k}: {'exact' if v is True else v}"
                                                 for k, v in ident.items()) + ".")
        lines.append("")
    flux = result.get("flux")
    rows = [("flux", flux)] + ([("wan", result["wan"])] if "wan" in result else [])
    head = ("| model | resolution | label | variant | step | predicted (plan) | / predicted "
            "| / resident | / pinned-copy floor | / group offload | device peak | host RSS added "
            "| offload/load | first call | exact |")
    lines += [head, "|" + " --- |" * 15]
    for kind, sec in rows:
        if not sec:
            continue
        blocks = sec["resolutions"].items() if kind == "flux" else [(
            sec["resolution"], {"variants": sec["variants"], "label": sec.get("label")})]
        for label, into in blocks:
            for name, v in into["variants"].items():
                lines.append(
                    f"| {'FLUX.1-dev' if kind == 'flux' else 'Wan2.1-14B'} | {label} | "
                    f"{into.get('label') or '-'} | {name} | {_f(v.get('step_ms'), '{:.1f} ms')} "
                    f"| {_predicted(v)} | {_f(v.get('plan', {}).get('measured_over_plan'))} "
                    f"| {_f(v.get('over_resident'))} | {_f(v.get('over_floor'))} "
                    f"| {_f(v.get('over_group_offload'))} | {_gib(v.get('device_peak'))} "
                    f"| {_gib(v.get('host_rss_added'))} | {_f(v.get('offload_s'), '{:.1f} s')} "
                    f"| {_f(v.get('first_call_s'), '{:.1f} s')} "
                    f"| {_exact(v)} |")
    lines += ["", RSS_ADDED, ""]
    hw = result.get("plan_hardware")
    if hw:
        lines += [f"\"predicted (plan)\": `dlo_fx.plan` of the same model on the meta device at "
                  f"the row's inputs and options, for {hw['why']} (its figures, nothing this "
                  "run measured), with what bounds it; \"/ predicted\": measured over predicted.",
                  ""]
    if flux:
        for label, into in flux["resolutions"].items():
            p = into.get("phase 1") or into.get("phase 2") or {}
            lines.append(f"- {label}: {into.get('label_why', '-')}; pinned copies at "
                         f"{_f(p.get('floor_GBps'), '{:.1f} GB/s')}; no host sync in steady "
                         f"state: {into.get('no_host_sync', '-')}.")
            for name in ("dlo auto budget", "dlo half budget"):
                v = into["variants"].get(name)
                if v and "predicted_step_ms" in v:
                    lines.append(
                        f"- {label}, {name}: {v.get('resident_blocks')} of "
                        f"{v.get('num_blocks')} blocks resident; step predicted "
                        f"{_f(v.get('predicted_step_ms'), '{:.1f} ms')}, measured "
                        f"{_f(v.get('step_ms'), '{:.1f} ms')} (x"
                        f"{_f(v.get('measured_over_predicted'))}); capacity "
                        f"{_gib(v.get('device_capacity_bytes'))}, activation peak "
                        f"{_gib(v.get('activation_peak_bytes'))}, weights budget "
                        f"{_gib(v.get('weights_budget_bytes'))}.")
        if "wan" in result:
            lines.append(f"- Wan2.1-14B {result['wan']['resolution']} "
                         f"({result['wan']['tokens']} tokens): {result['wan'].get('label_why')}.")
        for why in flux.get("dropped") or ():
            lines.append(f"- Dropped: {why}.")
    rss = result.get("host_rss_child")
    if rss and "peak_rss" in rss:
        lines.append(f"- Host RSS of a process that only made the streamed Flux and called it "
                     f"once: peak {_gib(rss['peak_rss'])}, at the end {_gib(rss['rss'])}, for "
                     f"a host store of {_gib(rss['host_store_bytes'])} (peak - store "
                     f"{_gib(rss['peak_rss_over_store'])}); streaming took "
                     f"{_f(rss['offload_s'], '{:.1f} s')}, the first call "
                     f"{_f(rss['first_call_s'], '{:.1f} s')} in that fresh process.")
    fails = result.get("failures") or []
    lines.append(f"- Checks and targets: {'all met' if not fails else '; '.join(fails)}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

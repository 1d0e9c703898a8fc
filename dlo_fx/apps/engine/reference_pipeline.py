"""The reference pipeline: a flow-matching Euler sampler over the reference DiT.

It lets the engine, the CLI and the showcase run without downloading anything: prompts
become text conditioning deterministically (a hash of the prompt seeds the generator of
the text tensor), the seed fixes the initial noise, and the output is the final latents
[num_outputs_per_prompt, C, height / 8, width / 8] in float32. ``build`` is the factory
the engine calls in every worker (``"dlo_fx.apps.engine.reference_pipeline:build"``);
``resident`` builds the same pipeline without dlo, for single-process reference runs.
The pipeline keeps a forward clock (see [Note: the forward clock of a wave] in clock.py), so
requests of any size, step count and guidance share a wave, and declares its `Limits`.

[Note: the reference pipeline's guidance on two ranks]
In an engine worker of ``cfg_size == 2`` the model is made CFG-parallel over the rank's
pair (`dlo_fx.cfg_parallel`, a batched call split): a guided step is one call of the batch
``[cond; uncond]`` (latents and timestep twice, the prompt's text then the negative
prompt's), rank 0 computing the conditional half and rank 1 the unconditional one, each a
call of the request's own batch, which is what the pipeline without CFG parallel calls
twice. An unguided step, and the warm-up, are one call computed whole on both ranks
(`computed_whole`: an even batch is never split into rows computed apart). The text of
every call is contiguous (a prompt's embedding repeated over the batch, not a stride-0
view): a half cut from the batch of both branches is then the very tensor the pipeline
without CFG parallel passes (with a stride-0 text, a batch of two outputs computed other
bits than its contiguous copy), and every call, split or whole, runs the graph the
warm-up compiled. A guided request takes one forward per step on the clock, not two.

Fault hooks, for fault-injection tests only and off unless the factory is called with
``fault_hooks=True`` (``Engine(..., pipeline_kwargs={"fault_hooks": True})``): then
``extra_args`` may hold ``{"fault": "raise" | "exit" | "hang", "fault_rank": R,
"fault_step": S}``; global rank ``R`` (default 1) raises, exits with code 3, or sleeps
forever just before the Euler update of step ``S`` (default 1), i.e. between two forwards
of a wave while its peers run theirs. Without the switch ``extra_args`` are ignored.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch

from ..models.reference_dit import DiTConfig, ReferenceDiT, reference_dit
from .clock import ForwardClock
from .limits import Limits
from .progress import steps as denoising_steps
from .request import Request
from .topology import worker_cfg_group

VAE_SCALE = 8
"""Pixels per latent cell along each side, as with common image autoencoders."""

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


MAX_SIZE = 2048
"""Largest height and width in pixels the reference pipeline serves."""
MAX_STEPS = 1000
"""Most Euler steps it runs."""
MAX_OUTPUTS = 16
"""Most outputs per prompt (the batch of one forward)."""
MAX_PROMPT_BYTES = 64 << 10
"""Largest prompt it hashes, in UTF-8 bytes."""


class ReferencePipeline:
    """``pipeline(request) -> latents``: Euler steps of a flow-matching sampler."""

    def __init__(self, model: Callable[..., torch.Tensor], config: DiTConfig,
                 module: torch.nn.Module, dump_dir: Optional[str] = None,
                 fault_hooks: bool = False, cfg: Optional[torch.nn.Module] = None) -> None:
        self.clock = ForwardClock(model)
        """What computes the velocity (the compiled DiT, or the module itself), counted."""
        self.cfg = cfg
        """``model`` where `dlo_fx.cfg_parallel` splits its guidance over two ranks, else
        None (see [Note: the reference pipeline's guidance on two ranks])."""
        self.config = config
        self.module = module
        self.dump_dir = dump_dir
        self.fault_hooks = fault_hooks
        self.limits = Limits(max_height=MAX_SIZE, max_width=MAX_SIZE,
                             size_multiple=VAE_SCALE * config.patch_size, max_frames=1,
                             max_inference_steps=MAX_STEPS, max_outputs_per_prompt=MAX_OUTPUTS,
                             max_prompt_bytes=MAX_PROMPT_BYTES)
        """What it serves; the engine refuses anything else before a wave starts."""

    def __call__(self, request: Request) -> torch.Tensor:
        with torch.inference_mode():
            return sample(self.clock, self.config, request,
                          fault_hook=_fault_hook if self.fault_hooks else None, cfg=self.cfg)

    def forwards(self, request: Request) -> int:
        """Model forwards of ``request``: one per step, two with guidance (one where the
        guidance is split over two ranks: one call of both branches)."""
        twice = request.guidance_scale > 1.0 and self.cfg is None
        return request.num_inference_steps * (2 if twice else 1)

    def graph_key(self, request: Request) -> str:
        """The compiled graph ``request`` runs: its latent batch and size."""
        return f"{request.num_outputs_per_prompt}x{request.height}x{request.width}"

    def warmup(self, request: Request) -> None:
        """One forward at ``request``'s shapes on zeros (compiles its graph)."""
        count = request.num_outputs_per_prompt
        cell = request.height // VAE_SCALE, request.width // VAE_SCALE
        with torch.inference_mode(), _whole(self.cfg):
            text = torch.zeros(1, self.config.text_len, self.config.text_dim,
                               dtype=self.config.dtype)  # as `sample` makes it
            self.clock(torch.zeros(count, self.config.in_channels, *cell),
                       torch.zeros(count), text.expand(count, -1, -1).contiguous())

    def describe(self) -> dict:
        """Memory figures of this rank's model (see `dlo_fx.memory_report`)."""
        from ...model.cfg_parallel import cfg_ranks
        from ...model.memory import memory_report

        report = asdict(memory_report(self.module))
        report["dump_dir"] = self.dump_dir
        report["cfg_parallel"] = [] if self.cfg is None else list(cfg_ranks(self.cfg) or ())
        return report


def latent_shape(request: Request, config: DiTConfig) -> tuple[int, int, int, int]:
    """``(num_outputs_per_prompt, C, height / 8, width / 8)``; ``ValueError`` when the
    request does not fit the reference DiT."""
    cell = VAE_SCALE * config.patch_size
    if request.height % cell or request.width % cell:
        raise ValueError(f"Request height={request.height} and width={request.width} must "
                         f"be multiples of {cell} for the reference pipeline (latent cell "
                         f"{VAE_SCALE} px x patch_size {config.patch_size})")
    if request.num_frames != 1:
        raise ValueError(f"Request num_frames={request.num_frames} is not allowed: the "
                         "reference DiT makes images, so num_frames must be 1")
    if request.lora_id is not None:
        raise NotImplementedError(f"Request lora_id={request.lora_id!r}: the reference "
                                  "pipeline has no LoRA adapters")
    return (request.num_outputs_per_prompt, config.in_channels,
            request.height // VAE_SCALE, request.width // VAE_SCALE)


def prompt_embedding(prompt: str, config: DiTConfig) -> torch.Tensor:
    """Text conditioning [1, text_len, text_dim] of ``prompt``: normal noise from a
    generator seeded with the prompt's SHA-256, so equal prompts condition equally."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    text = torch.randn(1, config.text_len, config.text_dim, generator=generator)
    return text.to(config.dtype)


def initial_noise(request: Request, config: DiTConfig) -> torch.Tensor:
    """The float32 noise the sampler starts from, fixed by ``request.seed``."""
    generator = torch.Generator().manual_seed(request.seed)
    return torch.randn(latent_shape(request, config), generator=generator)


def _whole(cfg: Optional[torch.nn.Module]) -> Any:
    """Where ``cfg`` splits guidance: its calls computed whole on both ranks."""
    from ...model.cfg_parallel import computed_whole

    return contextlib.nullcontext() if cfg is None else computed_whole(cfg)


def sample(model: Callable[..., torch.Tensor], config: DiTConfig, request: Request,
           fault_hook: Optional[Callable[[Request, int], None]] = None,
           cfg: Optional[torch.nn.Module] = None) -> torch.Tensor:
    """Integrate the flow from noise (sigma 1) to data (sigma 0) in
    ``num_inference_steps`` Euler steps. With ``guidance_scale > 1`` each step also runs
    the negative prompt and mixes the two velocities (classifier-free guidance),
    rescaled to the conditional velocity's norm when ``cfg_normalize``. ``cfg``: the
    CFG-parallel model (see [Note: the reference pipeline's guidance on two ranks])."""
    x = initial_noise(request, config)
    count = x.shape[0]
    # contiguous rows: see [Note: the reference pipeline's guidance on two ranks]
    text = prompt_embedding(request.prompt, config).expand(count, -1, -1).contiguous()
    guided = request.guidance_scale > 1.0
    if guided:
        negative = (prompt_embedding(request.negative_prompt, config)
                    .expand(count, -1, -1).contiguous())
    steps = request.num_inference_steps
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    for step in denoising_steps(steps):
        timestep = torch.full((count,), float(sigmas[step]) * 1000.0)
        if guided and cfg is not None:  # both branches in one call, one per rank
            both = model(torch.cat([x, x]), torch.cat([timestep, timestep]),
                         torch.cat([text, negative]))
            velocity, uncond = (half.float() for half in both.chunk(2))
        else:
            with _whole(cfg):
                velocity = model(x, timestep, text).float()
                if guided:
                    uncond = model(x, timestep, negative).float()
        if guided:
            mixed = uncond + request.guidance_scale * (velocity - uncond)
            if request.cfg_normalize:
                norm = velocity.flatten(1).norm(dim=1) / mixed.flatten(1).norm(dim=1)
                mixed = mixed * norm.clamp_max(1.0)[:, None, None, None]
            velocity = mixed
        if fault_hook is not None:
            fault_hook(request, step)
        x = x + float(sigmas[step + 1] - sigmas[step]) * velocity
    return x


def _fault_hook(request: Request, step: int) -> None:
    """The fault hooks of the module docstring."""
    fault = request.extra_args.get("fault")
    if fault is None or step != int(request.extra_args.get("fault_step", 1)):
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank != int(request.extra_args.get("fault_rank", 1)):
        return
    if fault == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if fault == "exit":
        os._exit(3)
    if fault == "hang":
        while True:
            time.sleep(1.0)
    raise ValueError(f"extra_args fault={fault!r} is not allowed: expected 'raise', 'exit' "
                     "or 'hang'")


# -- building the pipeline ---------------------------------------------------------------
def build(options: Optional[Mapping[str, Any]] = None, *,
          checkpoint: Optional[Union[str, os.PathLike]] = None, width: int = 256,
          depth: int = 4, heads: int = 4, seed: int = 0,
          fault_hooks: bool = False) -> ReferencePipeline:
    """The engine's factory: the reference DiT compiled with ``backend="dlo"``.

    With ``checkpoint`` (a folder written by `write_checkpoint`, or its weights file)
    the model is loaded from it with ``dlo_fx.load``, and ``width``/``depth``/``heads``/
    ``seed`` are ignored; otherwise it is built in memory from ``seed``, identically on
    every rank. ``options`` are the dlo options (the engine adds this rank's DP group as
    ``shard_group``: AllGather mode when dp > 1), each half given where it belongs: the
    runtime's to `dlo_fx.load` or `dlo_fx.offload`, the compile's to ``torch.compile``.
    ``fault_hooks`` turns the test hooks of the module docstring on.
    """
    from ...config import split_options
    from ...loading.offload import offload

    runtime_options, compile_options = split_options(options, "the engine's reference DiT")
    if checkpoint is not None:
        model = load_dit(checkpoint, runtime_options)
    else:
        model = offload(reference_dit(width=width, depth=depth, heads=heads, seed=seed),
                        runtime_options)
    compiled = torch.compile(model, backend="dlo", options=compile_options, fullgraph=True,
                             dynamic=False)
    pair = worker_cfg_group()
    if pair is not None:  # see [Note: the reference pipeline's guidance on two ranks]
        from ...config import DLOConfig
        from ...model.cfg_parallel import cfg_parallel

        timeout = DLOConfig.from_options(runtime_options).collective_timeout_s
        cfg_parallel(compiled, pair, timeout_s=timeout)
    return ReferencePipeline(compiled, model.config, model,
                             dump_dir=compile_options.get("dump_dir"), fault_hooks=fault_hooks,
                             cfg=compiled if pair is not None else None)


def resident(*, checkpoint: Optional[Union[str, os.PathLike]] = None, width: int = 256,
             depth: int = 4, heads: int = 4, seed: int = 0) -> ReferencePipeline:
    """The same pipeline without dlo: every weight in memory, the module called eagerly
    (the reference that dlo outputs must equal bit for bit)."""
    if checkpoint is not None:
        model = _load_state_dict(checkpoint)
    else:
        model = reference_dit(width=width, depth=depth, heads=heads, seed=seed)
    return ReferencePipeline(model, model.config, model)


# -- checkpoints ------------------------------------------------------------------------
def write_checkpoint(folder: Union[str, os.PathLike], *, width: int = 256, depth: int = 4,
                     heads: int = 4, seed: int = 0) -> Path:
    """Write the seeded reference DiT as ``folder/model.safetensors`` + ``config.json``
    (atomically: a reader never sees half a file). Returns ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = reference_dit(width=width, depth=depth, heads=heads, seed=seed)
    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    config = {f.name: getattr(model.config, f.name) for f in fields(model.config)}
    config["dtype"] = str(model.config.dtype).removeprefix("torch.")
    tmp = folder / f".tmp-{os.getpid()}"
    save_file(tensors, str(tmp))
    os.replace(tmp, folder / WEIGHTS_FILE)
    (folder / f".tmp-{os.getpid()}.json").write_text(json.dumps(config, indent=1))
    os.replace(folder / f".tmp-{os.getpid()}.json", folder / CONFIG_FILE)
    return folder


def _paths(checkpoint: Union[str, os.PathLike]) -> tuple[Path, DiTConfig]:
    path = Path(checkpoint)
    weights = path / WEIGHTS_FILE if path.is_dir() else path
    config_path = weights.parent / CONFIG_FILE
    if not weights.is_file() or not config_path.is_file():
        raise ValueError(f"checkpoint={str(checkpoint)!r} is not a reference DiT checkpoint: "
                         f"expected {WEIGHTS_FILE} and {CONFIG_FILE} in one folder "
                         "(dlo_fx.apps.engine.reference_pipeline.write_checkpoint writes them)")
    raw = json.loads(config_path.read_text())
    known = {f.name for f in fields(DiTConfig)}
    raw = {k: v for k, v in raw.items() if k in known}
    raw["dtype"] = getattr(torch, raw.get("dtype", "bfloat16"))
    return weights, DiTConfig(**raw)


def _load_state_dict(checkpoint: Union[str, os.PathLike]) -> ReferenceDiT:
    from safetensors.torch import load_file

    weights, config = _paths(checkpoint)
    model = ReferenceDiT(config)
    model.load_state_dict(load_file(str(weights)), strict=True)
    return model.eval().requires_grad_(False)


def load_dit(checkpoint: Union[str, os.PathLike],
             options: Optional[Mapping[str, Any]] = None) -> ReferenceDiT:
    """Load a reference DiT checkpoint with ``dlo_fx.load`` (meta init, mmap, this rank's
    shard only)."""
    from ...loading.loader import load

    weights, config = _paths(checkpoint)
    model = load(functools.partial(ReferenceDiT, config), str(weights),
                 options=dict(options or {}))
    return model.eval().requires_grad_(False)

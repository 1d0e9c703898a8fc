"""Serve a saved diffusers pipeline: the engine factory behind ``dlo-fx generate --diffusers``.

    dlo-fx generate --diffusers ROOT --dp 2 --requests r.jsonl --out results/
    Engine("dlo_fx.apps.engine.diffusers_pipeline:build", 2, pipeline_kwargs={"path": ROOT})

``ROOT`` is a folder written by ``pipeline.save_pretrained`` (``model_index.json`` and one
subfolder per component). Every rank loads the pipeline's transformer(s) (``transformer``,
``transformer_2``, or a ``unet``) with `dlo_fx.load` (meta init, mmap, this rank's shard of
every block), the other components with their own ``from_pretrained``, and compiles the
transformer(s) (and, with ``text_encoders=True``, the text encoders) with ``backend="dlo"``
through `dlo_fx.compile_pipeline`.

[Note: Request fields as pipeline arguments]
A `Request` becomes one pipeline call: ``prompt``; ``negative_prompt`` (when not empty);
``height``, ``width``, ``num_inference_steps``; ``guidance_scale`` and ``true_cfg_scale``
when the pipeline takes them; ``num_frames`` (a pipeline without it accepts only 1);
``num_outputs_per_prompt`` as ``num_images_per_prompt`` / ``num_videos_per_prompt``;
``seed`` as a CPU ``torch.Generator`` (the noise is drawn on the CPU whatever the device, so
every device gets the same noise); ``fps`` and ``extra_args`` (e.g.
``{"max_sequence_length": 128}``) as further keyword arguments the pipeline must accept. A
field the pipeline cannot honour is a ``ValueError`` naming it, never silently dropped. The
decoded output becomes 8-bit RGB exactly as diffusers' ``numpy_to_pil`` rounds it
(``round(x * 255)``): ``{"images": uint8 [N, H, W, 3]}`` or, for a video pipeline,
``{"frames": uint8 [N, F, H, W, 3]}``; ``dlo-fx generate`` writes one PNG per image or frame.

[Note: what a diffusers pipeline declares]
The factory declares the pipeline's `Limits` from what it loaded, so the front end refuses
a request it cannot serve before any wave, naming the field (`pipeline_limits`): an image
pipeline (no ``num_frames`` argument) serves one frame, a video pipeline ``k *
vae_scale_factor_temporal + 1``; height and width are multiples of the VAE's spatial factor
times the denoiser's patch (at least 2 where the pipeline packs 2x2 latents, as Flux
does), and at most ``pos_embed_max_size`` patches where the denoiser has that table (SD3);
its ``sample_size`` is the size it was trained at, not a bound, so it bounds nothing; the
pixels of a request (outputs x frames x height x width) at most what memory holds
(`memory_limits`, [Note: sizes that cannot fit]); steps
up to the scheduler's ``num_train_timesteps``; a Request field the call does not take
(``true_cfg_scale``, ``negative_prompt``, ...) must keep its default; ``extra_args`` keys
are the call's other arguments. A request that passes those can still fail in the
pipeline's own ``check_inputs`` (``max_sequence_length`` too large): `DiffusersPipeline.
check` runs it, and ``call_arguments``, on every rank for every request of a wave before
any forward, so such a request fails alone and its rank runs a peer's request in its
place (see [Note: refused requests fail alone] in worker.py).

[Note: sizes that cannot fit]
A request whose size the memory cannot hold is refused before any worker computes it,
never after the model loaded (minutes at real size), and no request that fits is refused.
`memory_limits` bounds a request's pixels by what it certainly allocates, lower bounds
only: the decoded RGB images as float32 on the host (``output_type="pt"``, copied to the
CPU by `to_uint8`: 12 bytes a pixel, whatever the device), the same in at least 2 bytes a
channel on the device (6 bytes a pixel), and, where the denoiser's config gives its width
(``num_attention_heads * attention_head_dim``), its hidden states: one token of at least 2
bytes a channel per ``(spatial factor x patch)**2`` pixels (and per
``vae_scale_factor_temporal`` frames). ``dlo-fx generate --diffusers`` checks the first two
against the host's RAM and the device's memory before any worker starts
(`check_up_front`); each worker's `Limits` (from the pipeline it loaded, on its device)
adds the third before any wave. The check computes in Python integers: a number that would
overflow a shape (``height=10**30``) is refused, not wrapped.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from .limits import Limits
from .progress import shows_progress
from .request import Request

DENOISER_PREFIXES = ("transformer", "unet")
"""Components loaded with `dlo_fx.load`: the denoiser(s)."""


class DiffusersPipeline:
    """``pipeline(request) -> {"images": ...}`` or ``{"frames": ...}`` around a diffusers
    pipeline (see [Note: Request fields as pipeline arguments])."""

    def __init__(self, pipe: Any, streamed: Sequence[str] = (), device: str = "cpu") -> None:
        self.pipe = pipe
        self.streamed = tuple(streamed)
        """Components compiled with backend="dlo"."""
        self._params = inspect.signature(type(pipe).__call__).parameters
        self.limits = pipeline_limits(pipe, self._params, device)
        """What it serves (see [Note: what a diffusers pipeline declares])."""

    def check(self, request: Request) -> None:
        """Raise what the pipeline would raise for ``request`` before its first forward:
        a field it cannot honour (`call_arguments`), or its own ``check_inputs``."""
        kwargs = call_arguments(request, self._params, type(self.pipe).__name__)
        check_inputs = getattr(self.pipe, "check_inputs", None)
        if not callable(check_inputs):
            return
        arguments = {}
        for name, param in inspect.signature(check_inputs).parameters.items():
            if name in kwargs:
                arguments[name] = kwargs[name]
            elif name in self._params and self._params[name].default is not param.empty:
                arguments[name] = self._params[name].default
            elif param.default is param.empty and param.kind not in (param.VAR_POSITIONAL,
                                                                     param.VAR_KEYWORD):
                return  # an argument only the call computes: its own check runs then
        check_inputs(**arguments)

    def __call__(self, request: Request) -> dict:
        kwargs = call_arguments(request, self._params, type(self.pipe).__name__)
        with torch.inference_mode(), self._unguided_whole(kwargs):
            out = self.pipe(**kwargs)
        return to_uint8(out)

    def _unguided_whole(self, kwargs: dict) -> Any:
        """Where the pipeline calls its denoiser once per guidance branch and ``kwargs``
        turn guidance off (one call a step, nothing to pair): its CFG-parallel denoisers
        compute every call whole on both ranks (`computed_whole`), as diffusers decides
        (``guidance_scale > 1``; with ``true_cfg_scale``: above 1 and a negative prompt)."""
        import contextlib

        from ...model.cfg_parallel import calls_per_branch, computed_whole

        if not calls_per_branch(type(self.pipe)):
            return contextlib.nullcontext()
        if "true_cfg_scale" in self._params:
            guided = (float(kwargs.get("true_cfg_scale", 1.0)) > 1.0
                      and bool(kwargs.get("negative_prompt")))
        else:
            default = self._params.get("guidance_scale")
            scale = kwargs.get("guidance_scale", None if default is None else default.default)
            guided = scale is not None and float(scale) > 1.0
        if guided:
            return contextlib.nullcontext()
        return computed_whole([getattr(self.pipe, n) for n in self.streamed
                               if n.startswith(DENOISER_PREFIXES)])

    def describe(self) -> dict:
        """Memory figures of this rank's streamed components, ``"context_parallel"``: the
        ranks each denoiser splits its sequence over (1 where it does not), and
        ``"cfg_parallel"``: the global ranks each denoiser splits its guidance calls over
        (empty where it does not), ``"cfg_pairs"``: how many guidance pairs of two calls
        each denoiser deferred and computed whole so far (empty where none)."""
        from dataclasses import asdict

        from ...model.cfg_parallel import cfg_pair_counts, cfg_ranks
        from ...model.memory import memory_report

        out: dict = {name: asdict(memory_report(getattr(self.pipe, name)))
                     for name in self.streamed}
        out["context_parallel"] = {name: _context_parallel_degree(getattr(self.pipe, name))
                                   for name in self.streamed if name.startswith(DENOISER_PREFIXES)}
        out["cfg_parallel"] = {name: list(cfg_ranks(getattr(self.pipe, name)) or ())
                               for name in self.streamed if name.startswith(DENOISER_PREFIXES)}
        out["cfg_pairs"] = {name: cfg_pair_counts(getattr(self.pipe, name))
                            for name in self.streamed if name.startswith(DENOISER_PREFIXES)}
        return out


RESERVED = ("generator", "output_type", "return_dict", "latents")
"""Call arguments the factory sets itself, never from ``extra_args``."""

PER_PROMPT = ("num_images_per_prompt", "num_videos_per_prompt")
REQUEST_ARGUMENTS = ("prompt", "height", "width", "num_inference_steps", "negative_prompt",
                     "guidance_scale", "true_cfg_scale", "num_frames", *PER_PROMPT)
"""Call arguments set from the request's own fields."""


def pipeline_limits(pipe: Any, params: Mapping[str, inspect.Parameter],
                    device: str = "cpu") -> Limits:
    """The `Limits` of ``pipe`` computing on ``device`` (see [Note: what a diffusers
    pipeline declares])."""
    fixed = [f for f in ("negative_prompt", "guidance_scale", "true_cfg_scale")
             if f not in params] + ["cfg_normalize"]
    video = "num_frames" in params
    spatial = (getattr(pipe, "vae_scale_factor_spatial", None)
               or getattr(pipe, "vae_scale_factor", None) or 8)
    config = _denoiser_config(pipe)
    patch = config.get("patch_size") or 1
    patch = int(patch[-1] if isinstance(patch, (list, tuple)) else patch)
    cell = patch if not callable(getattr(pipe, "_pack_latents", None)) else max(patch, 2)
    largest = config.get("pos_embed_max_size")
    largest = int(largest) * patch * int(spatial) if largest else None
    scheduler = getattr(getattr(pipe, "scheduler", None), "config", {}) or {}
    extra = sorted(n for n, p in params.items() if n != "self" and n not in REQUEST_ARGUMENTS
                   and n not in RESERVED and _from_json(p))
    temporal = int(getattr(pipe, "vae_scale_factor_temporal", 1) or 1) if video else 1
    limits = Limits(max_height=largest, max_width=largest, size_multiple=int(spatial) * cell,
                    max_frames=None if video else 1, frames_multiple=temporal,
                    max_inference_steps=scheduler.get("num_train_timesteps"),
                    max_outputs_per_prompt=None if any(a in params for a in PER_PROMPT) else 1,
                    fixed_fields=fixed, extra_args=extra)
    pixels = memory_limits(device).max_pixels
    width = _denoiser_width(config)
    if width:  # its hidden states: 2 bytes a channel per token at least
        tokens = _device_bytes(device) // (2 * width)
        pixels = min(pixels, tokens * (int(spatial) * cell) ** 2 * temporal)
    return dataclasses.replace(limits, max_pixels=max(pixels, 1))


HOST_BYTES_PER_PIXEL = 12
"""The decoded RGB images as float32 on the host (`to_uint8`): a lower bound of what a
request's pixel takes there (see [Note: sizes that cannot fit])."""
DEVICE_BYTES_PER_PIXEL = 6
"""The decoded RGB images on the device, at least 2 bytes a channel."""


def memory_limits(device: str = "cpu") -> Limits:
    """`Limits` bounding a request's pixels by what the host and ``device`` hold (see
    [Note: sizes that cannot fit])."""
    from ...runtime import host_ram_bytes

    pixels = min(host_ram_bytes() // HOST_BYTES_PER_PIXEL,
                 _device_bytes(device) // DEVICE_BYTES_PER_PIXEL)
    return Limits(max_pixels=max(pixels, 1))


def _device_bytes(device: str) -> int:
    """The memory of ``device``: the host's RAM for the CPU (or where it cannot be read)."""
    from ...runtime import device_memory_bytes
    from ...runtime import host_ram_bytes

    return device_memory_bytes(torch.device(device)) or host_ram_bytes()


def _denoiser_width(config: Mapping[str, Any]) -> Optional[int]:
    """Channels of the denoiser's hidden states, where its config says (a transformer)."""
    heads, dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    if isinstance(heads, int) and isinstance(dim, int) and heads > 0 and dim > 0:
        return heads * dim
    return None


def check_up_front(requests: Sequence[Request], options: Mapping[str, Any]) -> None:
    """``ValueError`` naming the first request, and its field, whose images could not fit
    the host or the device the workers would compute on (`memory_limits`): checked before
    any worker starts."""
    limits = memory_limits(str(options.get("device") or "cpu"))
    for index, request in enumerate(requests):
        limits.check(request, f"request {index}")


NOT_FROM_JSON = ("Tensor", "Image", "Callable", "Generator")
"""Words in a call argument's annotation that JSON cannot give (embeddings, images,
callbacks): not ``extra_args`` keys."""


def _from_json(param: inspect.Parameter) -> bool:
    return param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD) and not any(
        word in str(param.annotation) for word in NOT_FROM_JSON)


def _denoiser_config(pipe: Any) -> Mapping[str, Any]:
    for name in ("transformer", "transformer_2", "unet"):
        config = getattr(getattr(pipe, name, None), "config", None)
        if isinstance(config, Mapping):
            return config
    return {}


def call_arguments(request: Request, params: Mapping[str, inspect.Parameter],
                   name: str = "the pipeline") -> dict:
    """The keyword arguments of the pipeline call for ``request``; ``ValueError`` naming a
    field the pipeline cannot honour."""
    def takes(arg: str) -> bool:
        return arg in params

    def refuse(field: str, value: Any, why: str) -> ValueError:
        return ValueError(f"Request {field}={value!r} is not allowed for {name}: {why}")

    if request.lora_id is not None:
        raise NotImplementedError(f"Request lora_id={request.lora_id!r}: the diffusers "
                                  "pipeline factory loads no LoRA adapters")
    if request.cfg_normalize:
        raise refuse("cfg_normalize", True, "diffusers pipelines have no such option")
    kwargs: dict[str, Any] = dict(prompt=request.prompt, height=request.height,
                                  width=request.width,
                                  num_inference_steps=request.num_inference_steps,
                                  generator=torch.Generator("cpu").manual_seed(request.seed),
                                  output_type="pt", return_dict=True)
    if request.negative_prompt:
        kwargs["negative_prompt"] = request.negative_prompt
    for field in ("guidance_scale", "true_cfg_scale"):
        value = getattr(request, field)
        if takes(field):
            kwargs[field] = float(value)
        elif value != 1.0:
            raise refuse(field, value, f"it takes no {field}")
    if takes("num_frames"):
        kwargs["num_frames"] = request.num_frames
    elif request.num_frames != 1:
        raise refuse("num_frames", request.num_frames, "it makes images (num_frames must be 1)")
    per_prompt = next((a for a in PER_PROMPT if takes(a)), None)
    if per_prompt is not None:
        kwargs[per_prompt] = request.num_outputs_per_prompt
    elif request.num_outputs_per_prompt != 1:
        raise refuse("num_outputs_per_prompt", request.num_outputs_per_prompt,
                     "it makes one output per prompt")
    extra = dict(request.extra_args)
    for key, value in extra.items():
        if key in kwargs or key in RESERVED:
            raise refuse(f"extra_args[{key!r}]", value, "set by the request's own fields")
        if not takes(key):
            raise refuse(f"extra_args[{key!r}]", value, "it takes no such argument")
        kwargs[key] = value
    return kwargs


def to_uint8(out: Any) -> dict:
    """The pipeline's ``output_type="pt"`` output as 8-bit RGB, channels last, rounded as
    diffusers' ``numpy_to_pil`` does."""
    frames = getattr(out, "frames", None)
    if frames is not None:
        video = torch.as_tensor(frames)  # [N, F, C, H, W] in [0, 1]
        return {"frames": _rgb8(video.permute(0, 1, 3, 4, 2))}
    images = torch.as_tensor(out.images)  # [N, C, H, W] in [0, 1]
    return {"images": _rgb8(images.permute(0, 2, 3, 1))}


def _rgb8(x: torch.Tensor) -> torch.Tensor:
    return (x.float().cpu() * 255).round().clamp(0, 255).to(torch.uint8).contiguous()


# -- sequence parallelism ------------------------------------------------------------------
def check_context_parallel(path: Union[str, os.PathLike], sp_size: int) -> None:
    """``ValueError`` naming the component and its class where a denoiser of the pipeline
    in ``path`` cannot split its sequence over ``sp_size`` ranks with diffusers' context
    parallelism (Ulysses): no context-parallel plan, or attention heads that ``sp_size``
    does not divide. Read from ``model_index.json`` and the denoisers' ``config.json``:
    before any worker starts."""
    if sp_size == 1:
        return
    import diffusers

    from .context_parallel import context_parallel_refusal

    for name, (library, cls_name) in denoisers(read_model_index(path)).items():
        cls = getattr(diffusers, cls_name, None)
        why = ("this diffusers does not have" if cls is None
               else context_parallel_refusal(cls, sp_size))
        if why is None:
            config = Path(path) / name / "config.json"
            heads = json.loads(config.read_text()).get("num_attention_heads") \
                if config.is_file() else None
            if isinstance(heads, int) and heads % sp_size:
                why = (f"has num_attention_heads={heads}, which sp_size={sp_size} does not "
                       "divide (Ulysses hands each rank heads / sp_size of them)")
        if why is not None:
            raise ValueError(f"{os.fspath(path)}/model_index.json: component {name!r} is a "
                             f"{library}.{cls_name}, which {why}; serve it with sp_size=1 "
                             "(--sp 1) and more replicas (--dp)")


def check_cfg_parallel(path: Union[str, os.PathLike], cfg_size: int) -> None:
    """``ValueError`` naming the pipeline class of ``path`` where its guidance branches
    cannot be put on ``cfg_size`` ranks (`cfg_refusal`: a third denoiser call per step, or
    two without the ``cache_context`` names that pair them). Read from
    ``model_index.json``: before any worker starts."""
    if cfg_size == 1:
        return
    import diffusers

    from ...model.cfg_parallel import cfg_refusal

    name = read_model_index(path).get("_class_name", "")
    cls = getattr(diffusers, name, None)
    why = "is not a class this diffusers has" if cls is None else cfg_refusal(cls)
    if why is not None:
        raise ValueError(f"{os.fspath(path)}/model_index.json: the pipeline {name} {why}; "
                         f"serve it with cfg_size=1 (--cfg 1) and use the ranks as replicas "
                         "(--dp) or to split the sequence (--sp)")


def denoiser_bytes(path: Union[str, os.PathLike]) -> int:
    """Bytes of the safetensors files of the denoisers of the pipeline in ``path``: what
    the host store of every rank shares out (the engine's gather choice weighs it)."""
    total = 0
    for name in denoisers(read_model_index(path)):
        total += sum(f.stat().st_size for f in (Path(path) / name).glob("*.safetensors"))
    return total


def _context_parallel_degree(model: Any) -> int:
    """How many ranks ``model`` splits its sequence over (diffusers' parallel config)."""
    config = getattr(getattr(model, "_parallel_config", None), "context_parallel_config", None)
    return 1 if config is None else int(config.ring_degree) * int(config.ulysses_degree)


def _split_sequence(models: Mapping[str, torch.nn.Module]) -> None:
    """Inside an engine worker of ``sp_size > 1``: split every denoiser's sequence over
    the replica's ranks (see context_parallel.py); nothing elsewhere."""
    from .context_parallel import enable_context_parallel
    from .topology import worker_context

    context = worker_context()
    if context is None or context.topology.sp_size == 1:
        return
    mesh = context.sp_mesh
    for model in models.values():
        enable_context_parallel(model, mesh)


# -- building ----------------------------------------------------------------------------
def read_model_index(path: Union[str, os.PathLike]) -> dict:
    """``model_index.json`` of a saved pipeline; ``ValueError`` naming what is missing."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise ValueError(f"--diffusers {os.fspath(path)!r}: no model_index.json there; pass the "
                         "folder a diffusers pipeline's save_pretrained(...) wrote")
    return json.loads(index.read_text())


def denoisers(model_index: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Component name -> (library, class) of the transformer(s) / unet present."""
    out = {}
    for name, value in model_index.items():
        if (name.startswith(DENOISER_PREFIXES) and isinstance(value, list) and len(value) == 2
                and value[0] is not None and value[1] is not None):
            out[name] = (value[0], value[1])
    return out


def absent(model_index: Mapping[str, Any]) -> dict[str, None]:
    """The components saved as absent (``[null, null]``: an SD3 without its T5), passed as
    ``None``: diffusers' ``from_pretrained`` drops them from what it loads and then finds
    a required component missing."""
    return {name: None for name, value in model_index.items()
            if not name.startswith("_") and isinstance(value, list) and len(value) == 2
            and value[0] is None and value[1] is None}


def _dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype name "
                         "(e.g. 'bfloat16')")
    return value


def _dtype_keyword() -> str:
    """``from_pretrained``'s dtype keyword: ``dtype`` where diffusers deprecated
    ``torch_dtype`` (it then warns on every pipeline a worker builds), ``torch_dtype``
    before that (where ``dtype=`` is not read)."""
    from diffusers.utils import deprecation_utils

    return "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"


def build(options: Optional[Mapping[str, Any]] = None, *, path: Union[str, os.PathLike],
          dtype: Union[str, torch.dtype, None] = None, text_encoders: bool = False,
          resident: Sequence[str] = ()) -> DiffusersPipeline:
    """The engine's factory for a saved diffusers pipeline (see the module docstring).
    Inside an engine of ``sp_size > 1`` the denoisers split each request's sequence over
    their SP group (diffusers' context parallelism, Ulysses: context_parallel.py); of
    ``cfg_size == 2``, the guidance branches over their CFG pair (`dlo_fx.cfg_parallel`:
    a batched call split, the two calls of a step paired).

    Args:
        options: the dlo options (the engine adds this rank's gather group as
            ``shard_group`` and its ``device``).
        path: the pipeline folder (``model_index.json`` and the component subfolders).
        dtype: dtype of every component (``torch_dtype`` of ``from_pretrained``, ``dtype=``
            of `dlo_fx.load`), as a torch dtype or its name; default: as saved / built.
        text_encoders: also stream the text encoders (compile them with backend="dlo").
        resident: passed to `dlo_fx.load` for every transformer.
    """
    import diffusers

    from ...config import DLOConfig, split_options
    from ...dynamo.pipelines import compile_pipeline
    from ...loading.loader import load
    from ...loading.offload import compute_device
    from .topology import worker_cfg_group

    options = dict(options or {})
    runtime_options = split_options(options, "the engine's diffusers pipeline")[0]
    torch_dtype = _dtype(dtype)
    index = read_model_index(path)
    found = denoisers(index)
    if not found:
        raise ValueError(f"{os.fspath(path)}/model_index.json names no transformer or unet "
                         "component to stream")
    loaded = {}
    for name, (library, cls_name) in found.items():
        cls = getattr(diffusers, cls_name, None)
        if cls is None:
            raise ValueError(f"{os.fspath(path)}/model_index.json: component {name!r} is a "
                             f"{library}.{cls_name}, which this diffusers does not have")
        loaded[name] = load(cls, path, subfolder=name, dtype=torch_dtype, options=runtime_options,
                            resident=resident)
    _split_sequence(loaded)
    pipeline_cls = getattr(diffusers, index.get("_class_name", ""), diffusers.DiffusionPipeline)
    kwargs: dict[str, Any] = {**absent(index), **loaded}
    if torch_dtype is not None:
        kwargs[_dtype_keyword()] = torch_dtype
    pipe = pipeline_cls.from_pretrained(os.fspath(path), **kwargs)
    streamed = list(loaded)
    if text_encoders:
        streamed += [n for n, m in pipe.components.items()
                     if n.startswith("text_encoder") and isinstance(m, torch.nn.Module)]
    pipe.set_progress_bar_config(disable=not shows_progress(), leave=False,
                                 desc="denoising steps")
    # Offloads the text encoders from host memory and moves the rest (the VAE) to the
    # compute device: the pipeline executes there
    compile_pipeline(pipe, options=options, components=streamed,
                     cfg_group=worker_cfg_group())
    device = compute_device(DLOConfig.from_options(runtime_options))
    return DiffusersPipeline(pipe, streamed, str(device))


def resident(path: Union[str, os.PathLike]) -> DiffusersPipeline:
    """The same pipeline without dlo, every weight in memory: the reference the engine's
    outputs equal bit for bit. The transformer(s) are built from their config.json and
    filled with ``load_state_dict`` from their safetensors (diffusers' own loader needs
    ``accelerate`` for models with ``_keep_in_fp32_modules``)."""
    import diffusers

    index = read_model_index(path)
    denoiser = {}
    for name, (_, cls_name) in denoisers(index).items():
        denoiser[name] = load_state_dict(getattr(diffusers, cls_name), Path(path) / name)
    pipeline_cls = getattr(diffusers, index.get("_class_name", ""), diffusers.DiffusionPipeline)
    pipe = pipeline_cls.from_pretrained(os.fspath(path), **absent(index), **denoiser)
    pipe.set_progress_bar_config(disable=True)
    return DiffusersPipeline(pipe)


def load_state_dict(cls: type, folder: Path) -> torch.nn.Module:
    """``cls`` from ``folder/config.json`` (diffusers' ``load_config``), every weight from
    its safetensors files."""
    from safetensors.torch import load_file

    model = cls.from_config(cls.load_config(folder))
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    model.load_state_dict(state, strict=True)
    return model.eval().requires_grad_(False)

"""``dlo-fx plan --model``: plan a diffusers transformer from its config for a hardware
target, without its weights (the model is built on the meta device).

    dlo-fx plan --model diffusers:FluxTransformer2DModel --config flux/transformer \\
        --hardware h200 --height 1024 --width 1024 [--frames 81] [--dp 2] \\
        [--device-memory 24GiB] [--out plan-dump]

The inputs are those the class's pipeline passes its transformer at that resolution
(`INPUTS`: FLUX, Wan); byte options take a number of bytes or a size with a unit
(``24GiB``, ``80GB``, ``512MiB``), as accelerate's ``max_memory`` does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, TextIO

import torch

from .hardware import HARDWARE

__all__ = ["INPUTS", "add_model_arguments", "build_from_config", "parse_bytes",
           "run_model_plan"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_bytes(text: str, flag: str = "bytes") -> int:
    """``"24GiB"`` -> 25769803776; ``"80GB"`` -> 80e9; ``"1024"`` -> 1024."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{flag} {text!r} is not a size: give bytes or a number with a unit "
                         "(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 24GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the model mode (``--model``) of ``dlo-fx plan``."""
    g = parser.add_argument_group(
        "a model from its config (--model: plan its real blocks, FLOPs and memory; "
        "--dp and --num-slots apply too)")
    g.add_argument("--model", dest="model", default=None, metavar="PKG:CLASS",
                   help="the transformer class, e.g. diffusers:FluxTransformer2DModel or "
                        "diffusers:WanTransformer3DModel")
    g.add_argument("--config", dest="config", default=None, metavar="PATH",
                   help="its config.json, or a model folder holding it (or transformer/config.json)")
    g.add_argument("--hardware", dest="hardware", default=None,
                   help=f"the target (default: h200; choices: {', '.join(HARDWARE)})")
    g.add_argument("--height", dest="height", type=int, default=None,
                   help="image height, px (default: 1024)")
    g.add_argument("--width", dest="width", type=int, default=None,
                   help="image width, px (default: 1024)")
    g.add_argument("--frames", dest="frames", type=int, default=None,
                   help="video frames (video models; default: 81)")
    g.add_argument("--text-tokens", dest="text_tokens", type=int, default=None,
                   help="prompt tokens the text encoder gives (default: 512)")
    g.add_argument("--dtype", dest="dtype", default=None,
                   help="the model's dtype (default: bfloat16)")
    g.add_argument("--device-memory", dest="device_memory", default=None, metavar="SIZE",
                   help="device memory to plan for instead of the hardware's, e.g. 24GiB")
    g.add_argument("--device-budget", dest="device_budget", default=None, metavar="SIZE",
                   help="bytes the weights may use on the device ('auto', the default; "
                        "'none': stream every block)")
    g.add_argument("--out", dest="out", default=None, metavar="DIR",
                   help="also write the plan's dump (blocks.md, schedule.txt, timeline.svg)")


# -- the inputs a pipeline hands its transformer ------------------------------------------
def _flux(config: Mapping[str, Any], args: argparse.Namespace, dtype: torch.dtype) -> dict:
    # FluxPipeline: VAE latents at 1/8, packed 2x2 into tokens of in_channels
    h, w, text = args.height // 16, args.width // 16, args.text_tokens
    meta = {"device": "meta"}
    out = dict(
        hidden_states=torch.empty(1, h * w, config["in_channels"], dtype=dtype, **meta),
        encoder_hidden_states=torch.empty(1, text, config["joint_attention_dim"], dtype=dtype,
                                          **meta),
        pooled_projections=torch.empty(1, config["pooled_projection_dim"], dtype=dtype, **meta),
        timestep=torch.empty(1, **meta), img_ids=torch.empty(h * w, 3, **meta),
        txt_ids=torch.empty(text, 3, **meta), return_dict=False)
    if config.get("guidance_embeds"):
        out["guidance"] = torch.empty(1, **meta)
    return out


def _wan(config: Mapping[str, Any], args: argparse.Namespace, dtype: torch.dtype) -> dict:
    # WanPipeline: VAE latents at 1/8 in space, (frames - 1) / 4 + 1 in time
    frames = args.frames if args.frames is not None else 81
    latent = (frames - 1) // 4 + 1
    meta = {"device": "meta"}
    return dict(
        hidden_states=torch.empty(1, config["in_channels"], latent, args.height // 8,
                                  args.width // 8, dtype=dtype, **meta),
        timestep=torch.empty(1, **meta),
        encoder_hidden_states=torch.empty(1, args.text_tokens, config["text_dim"], dtype=dtype,
                                          **meta),
        return_dict=False)


INPUTS: Mapping[str, Callable[[Mapping[str, Any], argparse.Namespace, torch.dtype], dict]] = {
    "FluxTransformer2DModel": _flux,
    "WanTransformer3DModel": _wan,
}
"""The transformer classes whose inputs ``dlo-fx plan --model`` knows; any other is planned
from Python with ``dlo_fx.plan(model, inputs, hardware=...)``."""


def _class(spec: str) -> type:
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--model {spec!r} is not of the form 'package:Class', e.g. "
                         "diffusers:FluxTransformer2DModel")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {spec!r}: cannot import {name} from {module} ({exc})") from exc
    if name not in INPUTS:
        raise ValueError(f"--model {spec!r}: no inputs are known for {name} (known: "
                         f"{', '.join(INPUTS)}); plan it from Python with dlo_fx.plan(model, "
                         "inputs, hardware=...)")
    return cls


def _config_file(path: str) -> Path:
    p = Path(path)
    for candidate in (p, p / "config.json", p / "transformer" / "config.json"):
        if candidate.is_file():
            return candidate
    raise ValueError(f"--config {path!r}: no such file, and no config.json in it or in its "
                     "transformer/ folder")


MODEL_DEFAULTS = {"hardware": "h200", "height": 1024, "width": 1024, "text_tokens": 512,
                  "dtype": "bfloat16"}
MODEL_ONLY = ("config", "hardware", "height", "width", "frames", "text_tokens", "dtype",
              "device_memory", "device_budget", "out")
"""The options that mean something only with ``--model`` (given without it: refused)."""


def model_only_given(args: argparse.Namespace) -> list[str]:
    """The ``--model``-only options given (their flags)."""
    return ["--" + name.replace("_", "-") for name in MODEL_ONLY
            if getattr(args, name, None) is not None]


def build_from_config(args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    """The model of ``--model``/``--config`` on the meta device, and its inputs."""
    for name, value in MODEL_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.config is None:
        raise ValueError("--model needs --config (the model's config.json or its folder)")
    cls = _class(args.model)
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {args.dtype!r} is not a torch dtype (bfloat16, float16, "
                         "float32)")
    path = _config_file(args.config)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--config {str(path)!r}: cannot read it as JSON ({exc})") from exc
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    try:
        with torch.device("meta"):
            model = cls.from_config(kwargs).to(dtype)
    except Exception as exc:
        raise ValueError(f"--config {str(path)!r}: {cls.__name__} cannot be built from it "
                         f"({type(exc).__name__}: {exc})") from exc
    return model, INPUTS[cls.__name__](model.config, args, dtype)


def _options(args: argparse.Namespace) -> dict:
    options: dict = {}
    if getattr(args, "num_slots", None) is not None:
        options["num_slots"] = args.num_slots
    if args.device_memory is not None:
        options["device_memory"] = parse_bytes(args.device_memory, "--device-memory")
    if args.device_budget is not None:
        text = args.device_budget.lower()
        options["device_budget"] = (None if text == "none" else "auto" if text == "auto"
                                    else parse_bytes(args.device_budget, "--device-budget"))
    return options


def run_model_plan(args: argparse.Namespace, out: TextIO) -> int:
    """Plan ``--model`` for ``--hardware`` and print it; 0, or 1 where it does not fit."""
    from .planner import plan

    model, inputs = build_from_config(args)
    planned = plan(model, inputs, hardware=args.hardware, options=_options(args),
                   dp=getattr(args, "dp", None) or 1)
    out.write(str(planned) + "\n")
    if args.out is not None:
        out.write(f"dump written to {planned.write(args.out)}\n")
    return 0 if planned.fits else 1


def uses_model(args: Optional[argparse.Namespace]) -> bool:
    return getattr(args, "model", None) is not None

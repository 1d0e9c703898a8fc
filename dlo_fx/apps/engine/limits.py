"""`Limits`: what a pipeline accepts, declared by the pipeline and checked by the front end
before any wave starts.

A request a worker would reject deterministically (a size its model cannot patchify, more
frames than it makes, a prompt larger than it reads) is refused up front with a
``ValueError`` naming the field, instead of failing inside a wave. A pipeline declares its
limits as a ``limits`` attribute (a `Limits` or a dict of its fields); the workers report
them when they are ready, and `Engine.generate` / `Engine.run_wave` check every request
against them first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional, Sequence

from ...config import did_you_mean
from .request import Request


@dataclass(frozen=True)
class Limits:
    """Bounds of the requests a pipeline serves. ``None`` means unbounded."""

    max_height: Optional[int] = None
    """Largest ``height`` in pixels. Default: ``None``."""
    max_width: Optional[int] = None
    """Largest ``width`` in pixels. Default: ``None``."""
    size_multiple: int = 1
    """``height`` and ``width`` must be multiples of it. Default: ``1``."""
    max_frames: Optional[int] = None
    """Largest ``num_frames``. Default: ``None``."""
    frames_multiple: int = 1
    """``num_frames - 1`` must be a multiple of it (video VAEs compress time 4x: 4k + 1
    frames). Default: ``1``."""
    max_inference_steps: Optional[int] = None
    """Largest ``num_inference_steps``. Default: ``None``."""
    max_outputs_per_prompt: Optional[int] = None
    """Largest ``num_outputs_per_prompt``. Default: ``None``."""
    max_pixels: Optional[int] = None
    """Largest ``num_outputs_per_prompt * num_frames * height * width`` of one request:
    what the memory its outputs, latents and activations need holds (a size whose
    allocation would fail, or overflow, in a worker is refused up front). Default:
    ``None``."""
    max_prompt_bytes: Optional[int] = None
    """Largest UTF-8 size of ``prompt`` and of ``negative_prompt``. Default: ``None``."""
    lora_ids: Optional[Sequence[Any]] = ()
    """The ``lora_id`` values served; ``None`` for any. Default: ``()`` (no LoRA)."""
    fixed_fields: Sequence[str] = ()
    """`Request` fields the pipeline does not take: each must keep its default (a
    pipeline without ``true_cfg_scale`` serves ``true_cfg_scale=1.0`` only). Default:
    ``()``."""
    extra_args: Optional[Sequence[str]] = None
    """The ``extra_args`` keys the pipeline reads; ``None`` for any. Default: ``None``."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _NAMES:
                if value is not None:
                    names = (value,) if isinstance(value, str) else tuple(value)
                    if f.name != "lora_ids" and not all(isinstance(n, str) for n in names):
                        raise ValueError(f"Limits.{f.name}={value!r} is not allowed: expected "
                                         "names (strings)")
                    object.__setattr__(self, f.name, names)
                continue
            minimum = 1
            if value is None and f.name.startswith("max_"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"Limits.{f.name}={value!r} is not allowed: expected an "
                                 f"integer >= {minimum}" + (" or None" if f.name.startswith(
                                     "max_") else ""))

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in _NAMES:
            value = getattr(self, name)
            out[name] = None if value is None else list(value)
        return out

    @classmethod
    def from_value(cls, value: Any) -> "Limits":
        """A `Limits`, a dict of its fields, or ``None`` (no limits)."""
        if value is None:
            return cls(lora_ids=None)
        if isinstance(value, Limits):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {f.name for f in fields(cls)})
            if unknown:
                allowed = [f.name for f in fields(cls)]
                raise ValueError(f"unknown pipeline limit(s) {unknown}; "
                                 f"{did_you_mean(unknown, allowed)}allowed: {allowed}")
            return cls(**value)
        raise ValueError(f"pipeline limits must be a dlo_fx.apps.engine.Limits or a dict, not "
                         f"{type(value).__name__}")

    def check(self, request: Request, where: str = "request") -> None:
        """``ValueError`` naming the first field of ``request`` outside these limits."""

        def refuse(name: str, why: str) -> None:
            raise ValueError(f"{where}: Request.{name}={getattr(request, name)!r} is not "
                             f"allowed: {why}")

        for name, bound in (("height", self.max_height), ("width", self.max_width),
                            ("num_frames", self.max_frames),
                            ("num_inference_steps", self.max_inference_steps),
                            ("num_outputs_per_prompt", self.max_outputs_per_prompt)):
            if bound is not None and getattr(request, name) > bound:
                refuse(name, f"this pipeline serves at most {bound}")
        for name in ("height", "width"):
            if getattr(request, name) % self.size_multiple:
                refuse(name, f"this pipeline needs a multiple of {self.size_multiple}")
        if (request.num_frames - 1) % self.frames_multiple:
            refuse("num_frames", f"this pipeline needs {self.frames_multiple}k + 1 frames")
        if self.max_pixels is not None:
            self._check_pixels(request, refuse)
        if self.max_prompt_bytes is not None:
            for name in ("prompt", "negative_prompt"):
                size = len(getattr(request, name).encode("utf-8"))
                if size > self.max_prompt_bytes:
                    raise ValueError(f"{where}: Request.{name} is {size} bytes of UTF-8; this "
                                     f"pipeline reads at most {self.max_prompt_bytes}")
        if self.lora_ids is not None and request.lora_id is not None \
                and request.lora_id not in self.lora_ids:
            served = list(self.lora_ids) if self.lora_ids else "none"
            refuse("lora_id", f"this pipeline serves the LoRA adapters {served}")
        defaults = {f.name: f.default for f in fields(Request)}
        for name in self.fixed_fields:
            if name in defaults and getattr(request, name) != defaults[name]:
                refuse(name, f"this pipeline takes no {name} (leave it at "
                             f"{defaults[name]!r})")
        if self.extra_args is not None:
            for key in request.extra_args:
                if key not in self.extra_args:
                    raise ValueError(
                        f"{where}: Request.extra_args[{key!r}] is not allowed: this pipeline "
                        f"reads the extra_args {', '.join(map(repr, self.extra_args)) or 'none'}")

    def _check_pixels(self, request: Request, refuse: Any) -> None:
        """Refuse a request of more than ``max_pixels``, naming the larger of its height
        and width and the largest value that fits with the other fields as given."""
        n, f, h, w = (request.num_outputs_per_prompt, request.num_frames, request.height,
                      request.width)
        pixels = n * f * h * w  # Python integers: no overflow
        if pixels <= self.max_pixels:
            return
        name, other = ("height", w) if h >= w else ("width", h)
        fits = self.max_pixels // (n * f * other)
        refuse(name, f"{n} output(s) of {f} frame(s) of {h}x{w} pixels are {pixels} pixels, "
                     f"and this pipeline serves at most {self.max_pixels} per request "
                     "(outputs x frames x height x width: what the memory of its device and "
                     f"host holds); with the other fields as given, {name} at most {fits}")


_NAMES = ("lora_ids", "fixed_fields", "extra_args")
"""The fields of `Limits` that hold names (or values), not bounds."""

"""`Request`: one generation request, the wave key, and how requests are packed into waves.

[Note: the wave key]
The ranks of a wave gather the same weights in lock-step, one AllGather per block per
forward, so a request field that changes how many forwards run, or their shapes, or which
weights they read, would make one rank issue a different sequence of collectives than its
peers and hang them. A pipeline that keeps a forward clock (see [Note: the forward clock of
a wave] in clock.py) pads every rank to the same forwards and compiles every shape on every
rank at once, so any requests may share a wave. For any other pipeline those fields form
the *wave key*: every request of a wave must agree on all of them. ``extra_args`` is
pipeline-specific and may change the forward schedule, so it is part of the key, compared
as canonical JSON. The request-local fields (prompt, negative prompt, seed) only change
values, never the schedule, and may differ, with one exception: with ``true_cfg_scale >
1`` a pipeline runs its negative pass only when given a negative prompt (diffusers' Flux,
QwenImage and HunyuanVideo do), so whether the negative prompt is empty is in the key
there (a request with one runs twice the forwards of one without), and its text is not.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence, Union

from ...config import did_you_mean

LOCAL_FIELDS = ("prompt", "negative_prompt", "seed")
"""Fields that may differ between the requests of one wave."""

WAVE_KEY_FIELDS = (
    "height", "width", "num_frames", "num_inference_steps", "guidance_scale",
    "true_cfg_scale", "negative_prompt", "cfg_normalize", "lora_id", "num_outputs_per_prompt",
    "extra_args",
)
"""Fields every request of one wave must agree on when the pipeline keeps no forward
clock (see [Note: the wave key]); of ``negative_prompt``, only whether it is empty, and only
with ``true_cfg_scale > 1``."""

MAX_SEED = 2**64 - 1
"""Largest seed a torch generator takes."""

MAX_TEXT_BYTES = 1 << 20
"""Largest UTF-8 size of a prompt, and of ``extra_args`` as JSON, whatever the pipeline
(pipelines declare tighter limits, see `Limits`)."""


def canonical_json(value: Any) -> str:
    """``value`` as JSON with sorted keys and no whitespace (how ``extra_args`` compare)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class Request:
    """One generation request. Construction validates every field (``ValueError``)."""

    prompt: str
    """What to generate; must contain a non-blank character."""
    negative_prompt: str = ""
    """What to steer away from when classifier-free guidance runs. Default: ``""``."""
    seed: int = 0
    """Seed of the initial noise. Default: ``0``."""
    height: int = 256
    """Output height in pixels. Default: ``256``."""
    width: int = 256
    """Output width in pixels. Default: ``256``."""
    num_frames: int = 1
    """Frames of a video; ``1`` for an image. Default: ``1``."""
    num_inference_steps: int = 8
    """Denoising steps. Default: ``8``."""
    guidance_scale: float = 1.0
    """Classifier-free guidance scale; ``<= 1`` runs no unconditional pass. Default: ``1.0``."""
    true_cfg_scale: float = 1.0
    """"True CFG" scale of pipelines that tell it apart from a distilled guidance
    embedding. Default: ``1.0``."""
    cfg_normalize: bool = False
    """Rescale the guided prediction to the norm of the conditional one. Default: ``False``."""
    lora_id: Optional[Union[str, int]] = None
    """Which LoRA adapter to apply; ``None`` for none. Default: ``None``."""
    num_outputs_per_prompt: int = 1
    """Outputs generated for this prompt (the batch of one forward). Default: ``1``."""
    extra_args: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Pipeline-specific arguments, JSON-serialisable; stored read-only. Default: ``{}``."""

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError(f"Request.prompt={self.prompt!r} is not allowed: a request needs "
                             "a non-empty prompt")
        if not isinstance(self.negative_prompt, str):
            raise ValueError(f"Request.negative_prompt={self.negative_prompt!r} is not "
                             "allowed: expected a string")
        for name in ("prompt", "negative_prompt"):
            _check_text(name, getattr(self, name))
        _check_int("seed", self.seed, minimum=0)
        if self.seed > MAX_SEED:
            raise ValueError(f"Request.seed={self.seed!r} is not allowed: expected an integer "
                             f"from 0 to 2**64 - 1")
        for name in ("height", "width", "num_frames", "num_inference_steps",
                     "num_outputs_per_prompt"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("guidance_scale", "true_cfg_scale"):
            _check_number(name, getattr(self, name))
        if not isinstance(self.cfg_normalize, bool):
            raise ValueError(f"Request.cfg_normalize={self.cfg_normalize!r} is not allowed: "
                             "expected True or False")
        if self.lora_id is not None and (isinstance(self.lora_id, bool)
                                         or not isinstance(self.lora_id, (str, int))):
            raise ValueError(f"Request.lora_id={self.lora_id!r} is not allowed: expected a "
                             "string, an int or None")
        if not isinstance(self.extra_args, Mapping) or not all(
                isinstance(k, str) for k in self.extra_args):
            raise ValueError(f"Request.extra_args={self.extra_args!r} is not allowed: "
                             "expected a dict with string keys")
        try:
            canonical = canonical_json(dict(self.extra_args))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"Request.extra_args={self.extra_args!r} is not allowed: it "
                             f"must be JSON-serialisable ({exc})") from None
        if len(canonical) > MAX_TEXT_BYTES:
            raise ValueError(f"Request.extra_args is {len(canonical)} bytes as JSON; at most "
                             f"{MAX_TEXT_BYTES} are allowed")
        # A private deep copy, read-only: a frozen request cannot change under the engine.
        object.__setattr__(self, "extra_args", types.MappingProxyType(json.loads(canonical)))

    def __reduce__(self):  # the read-only extra_args view does not pickle by itself
        return (Request.from_dict, (self.to_dict(),))

    def wave_key(self) -> tuple:
        """The values that must agree across a wave (see [Note: the wave key])."""
        return tuple(self._key_value(name) for name in WAVE_KEY_FIELDS)

    def _key_value(self, name: str) -> Any:
        value = getattr(self, name)
        if name == "negative_prompt":  # see [Note: the wave key]
            return ("given" if value else "empty") if self.true_cfg_pass_possible else None
        return canonical_json(dict(value)) if name == "extra_args" else value

    @property
    def true_cfg_pass_possible(self) -> bool:
        """Whether the negative prompt decides a pass of its own (``true_cfg_scale > 1``)."""
        return self.true_cfg_scale > 1.0

    def to_dict(self) -> dict:
        """Every field as plain JSON-serialisable values."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["extra_args"] = dict(self.extra_args)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Request":
        """Build a request from a mapping (e.g. one line of a JSONL file); unknown keys
        raise ``ValueError`` naming them."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a request must be a JSON object, not {type(data).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown request field(s) {', '.join(map(repr, unknown))}; "
                             f"{did_you_mean(unknown, allowed)}allowed fields: "
                             f"{', '.join(sorted(allowed))}")
        if "prompt" not in data:
            raise ValueError("a request needs a 'prompt'")
        return cls(**data)


def wave_mismatch(requests: Sequence[Request]) -> Optional[str]:
    """``None`` when all ``requests`` may share a wave, else a message naming every
    differing field and the values of the first request that differs."""
    first = requests[0]
    for index, other in enumerate(requests[1:], start=1):
        differing = [n for n in WAVE_KEY_FIELDS if first._key_value(n) != other._key_value(n)]
        if differing:
            ours = ", ".join(f"{n}={first._key_value(n)!r}" for n in differing)
            theirs = ", ".join(f"{n}={other._key_value(n)!r}" for n in differing)
            return (f"requests of one wave must agree on {', '.join(differing)}: request 0 "
                    f"has {ours}, request {index} has {theirs}")
    return None


def check_wave(requests: Sequence[Request], dp_size: int, *, mixed: bool) -> list[Request]:
    """Validate one wave before anything is sent to a worker; return it as a list."""
    requests = list(requests)
    if not requests:
        raise ValueError("a wave needs at least one request")
    for index, request in enumerate(requests):
        if not isinstance(request, Request):
            raise ValueError(f"request {index} of the wave is a {type(request).__name__}; "
                             "expected dlo_fx.apps.engine.Request (Request.from_dict builds one)")
    if len(requests) > dp_size:
        raise ValueError(f"a wave holds at most dp_size={dp_size} requests, got "
                         f"{len(requests)}; use Engine.generate(...) to split them into waves")
    mismatch = None if mixed else wave_mismatch(requests)
    if mismatch is not None:
        raise ValueError(f"{mismatch}. Run them in separate waves, or call "
                         "Engine.generate(...), which groups compatible requests (this "
                         "pipeline keeps no forward clock, so it cannot mix them)")
    return requests


def cost(request: Request) -> int:
    """Relative work of ``request``: forwards (steps, twice with guidance or a true-CFG
    negative pass) x latent size."""
    guided = request.guidance_scale > 1.0 or (request.true_cfg_pass_possible
                                              and bool(request.negative_prompt))
    forwards = request.num_inference_steps * (2 if guided else 1)
    return (forwards * request.height * request.width * request.num_frames
            * request.num_outputs_per_prompt)


def plan_waves(requests: Sequence[Request], dp_size: int, *, mixed: bool) -> list[list[int]]:
    """Indices of ``requests`` grouped into waves of at most ``dp_size``.

    ``mixed`` (the pipeline keeps a forward clock): any requests may share a wave, so the
    fewest waves are ``ceil(n / dp_size)``; requests are sorted by `cost`, largest first,
    so that the requests of one wave take about as long and the ranks pad little.
    Otherwise requests with equal wave keys, in order of first appearance."""
    if mixed:
        order = sorted(range(len(requests)), key=lambda i: -cost(requests[i]))
        return [order[i : i + dp_size] for i in range(0, len(order), dp_size)]
    groups: dict[tuple, list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(request.wave_key(), []).append(index)
    return [indices[i : i + dp_size] for indices in groups.values()
            for i in range(0, len(indices), dp_size)]


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Request.{name}={value!r} is not allowed: expected an integer "
                         f">= {minimum}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"Request.{name}={value!r} is not allowed: expected a number")


def _check_text(name: str, value: str) -> None:
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"Request.{name} is not valid text: {exc.reason} at character "
                         f"{exc.start} ({value[exc.start:exc.end]!r})") from None
    if size > MAX_TEXT_BYTES:
        raise ValueError(f"Request.{name} is {size} bytes of UTF-8; at most {MAX_TEXT_BYTES} "
                         "are allowed")

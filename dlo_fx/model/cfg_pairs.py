"""Two-call CFG parallel: a pipeline that calls its denoiser once per guidance branch.

[Note: two-call CFG parallel]
Wan, Flux's ``true_cfg_scale``, Qwen-Image, HunyuanVideo and most of diffusers' newer
pipelines call the denoiser twice per step, each call one branch of batch B, the first in
``cache_context("cond")``, the second in ``cache_context("uncond")``::

    with transformer.cache_context("cond"):
        noise_pred = transformer(latents, prompt_embeds, ...)[0]
    with transformer.cache_context("uncond"):
        noise_uncond = transformer(latents, negative_prompt_embeds, ...)[0]
    noise_pred = noise_uncond + scale * (noise_pred - noise_uncond)

No call holds both branches, so there is nothing to split; the first call is deferred
instead, to the second:

1. The first call of a pair computes nothing. Its arguments are kept by reference (their
   containers copied: Flux changes ``joint_attention_kwargs`` between the two calls), each
   tensor's ``_version`` noted (an inference tensor, made under ``torch.inference_mode``
   as the engine calls a pipeline, has no version counter: it is copied, a copy of the
   latents and prompt embeddings, no more), and it returns a `Pending` prediction of the right shape,
   dtype and device in the module's own output structure ([Note: a pending prediction] in
   pending.py): any use of it before the second call raises.
2. At the second call both ranks compute in lock-step, the first rank of the pair (sorted)
   the first call's arguments, the second rank the second call's, so the weight gathers
   over the pair pair up. Before computing, the two exchange one word row (the step, a
   digest of each call's argument names, shapes and dtypes, whether the first call's
   tensors are unchanged and whether the two calls match) and raise together where any
   differs: a first-call tensor written in place since (``_version`` moved) is a
   ``RuntimeError`` naming the argument, two calls whose batch argument, timestep or
   argument names differ a ``RuntimeError`` naming them. The predictions are then
   all-gathered (the pair's exchange group and its timeout), the pending prediction filled
   in place with the first, and the second returned.

Exact: each branch is computed at batch B from the same arguments as the pipeline without
CFG parallel computes it, one rank each, and the gather copies bytes: the pipeline's output
equals the same pipeline run single-rank without `cfg_parallel` (resident, or streamed),
bit for bit (tests/test_cfg_pairs.py), where the batched scheme can differ in the last
bits (B rows instead of 2B per matrix product).

Why deferral: it needs no change to the pipeline's loop (the user's own ``pipe(...)``), and
the second call is the first moment both branches' inputs exist. Why not a rewritten loop
or a batch of two: either is a copy of every pipeline's ``__call__``.

The pending prediction's shape is not known before computing it: it is learnt. The first
pair of each argument signature (the names, shapes and dtypes of the first call's tensor
arguments and its plain values: a new resolution, a new prompt length) is computed whole
on both ranks, both calls, as without `cfg_parallel` (exact, and in lock-step), and its
output's structure is kept; later pairs of that signature are deferred. On a 50-step
request that is one step of the first request at each resolution.

How pairs are found (``pairs=``): ``"context"`` (the default) reads the name of the call's
``cache_context`` from diffusers' hook registry (a stateful hook of dlo's,
`ContextProbe`, to which diffusers hands each context as it does to its cache hooks):
"cond" and "uncond" calls pair, whichever comes first; any other call (no context,
"cond_uncond") is a batched call (the batched scheme, [Note: a CFG-parallel call]).
``"order"`` pairs every two calls, for a loop without ``cache_context``; it is asked for,
never a fallback: a module without the names may be a batched pipeline's, whose calls are
one per step, and pairing two steps would defer a prediction the scheduler reads at once. A "cond" call while
a pair is open (guidance off: one call per step) starts a new pair; the open one's pending
prediction is never filled, and its first use raised already. diffusers' cache hooks
(FirstBlockCache, ...) decide per call from the call's own earlier activations, so with
deferral they would see the branches in another order on each rank: a module with one is
refused by name (at `cfg_parallel` and at each first call).

A rank whose forward raises at a second call marks the pair failed (both then refuse every
later call, `ShardGroup.failed`); its peer raises in the prediction exchange within the
pair's timeout.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from .pending import Pending

log = logging.getLogger(__name__)

__all__ = ["BATCH_ARGUMENTS", "PAIR_CONTEXTS", "Pairs", "cache_refusal", "install_probe",
           "map_tensors", "remove_probe"]

PAIR_CONTEXTS = ("cond", "uncond")
"""diffusers' ``cache_context`` names of the two calls of a guidance pair."""

PROBE = "dlo_fx_cfg_context"
"""The name of dlo's hook in a denoiser's diffusers hook registry."""

BATCH_ARGUMENTS = ("hidden_states", "sample")
"""The argument whose dim 0 is the batch (transformers, UNets); else the first tensor."""

TIMESTEP_ARGUMENTS = ("timestep", "t")


def install_probe(module: nn.Module) -> Optional[Any]:
    """Register `ContextProbe` in ``module``'s diffusers hook registry where the module has
    ``cache_context``; returns it (None for a module without one)."""
    if not callable(getattr(module, "cache_context", None)):
        return None
    from diffusers.hooks.hooks import BaseState, HookRegistry, ModelHook, StateManager

    class ContextProbe(ModelHook):
        """Holds the context diffusers' ``cache_context`` sets on stateful hooks; changes
        nothing of the call."""

        _is_stateful = True

        def __init__(self) -> None:
            super().__init__()
            self.state = StateManager(BaseState)

        def name(self) -> Optional[str]:
            try:
                return self.state.context.name
            except ValueError:  # no context set
                return None

        def reset_state(self, module: nn.Module) -> nn.Module:
            self.state.set_context(None)
            return module

    registry = HookRegistry.check_if_exists_or_initialize(module)
    remove_probe(module)
    probe = ContextProbe()
    registry.register_hook(probe, PROBE)
    return probe


def remove_probe(module: nn.Module) -> None:
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None and registry.get_hook(PROBE) is not None:
        registry.remove_hook(PROBE, recurse=False)


def cache_refusal(module: nn.Module) -> Optional[str]:
    """A sentence naming the diffusers cache enabled on ``module``, or None."""
    if not getattr(module, "is_cache_enabled", False):
        return None
    config = getattr(module, "_cache_config", None)
    return (f"{type(module).__name__} has diffusers' cache enabled "
            f"({type(config).__name__}): its hooks decide from each call's own earlier "
            "activations, and with the guidance branches split over two ranks each rank "
            "would decide differently; call module.disable_cache() first")


@dataclass
class Call:
    """A call of a pair: its context name and arguments (containers copied)."""

    name: Optional[str]
    args: tuple
    kwargs: dict
    versions: list = field(default_factory=list)  # (argument, tensor, its _version)
    whole: bool = False  # the pair's signature was new: computed whole on both ranks
    pending: list = field(default_factory=list)  # the first call's Pending leaves

    @property
    def signature(self) -> int:
        return signature(self.args, self.kwargs)


class Pairs:
    """The deferral of one CFG-parallel module (see [Note: two-call CFG parallel])."""

    def __init__(self, owner: Any, pairs: str, probe: Optional[Any]) -> None:
        self.owner = owner  # the CFGParallel: its group, exchange and failure state
        self.pairs = pairs
        self.probe = probe
        self.open: Optional[Call] = None
        self.templates: dict[int, Any] = {}  # signature -> the output, its leaves as meta
        self.counts = {"deferred": 0, "whole": 0}  # pairs of each kind, for the tests and logs
        self.off = False  # `computed_whole`: every call whole on both ranks

    def role(self) -> Optional[str]:
        """"first", "second", "whole" (`computed_whole`) or None (a batched call) for the
        call now starting."""
        if self.off:
            return "whole"
        if self.pairs == "order":
            return "first" if self.open is None else "second"
        name = self.probe.name() if self.probe is not None else None
        if name not in PAIR_CONTEXTS:
            if self.open is not None:
                log.warning("dlo_fx.cfg_parallel: a call outside a guidance pair while the "
                            "pair of call %r was open: its prediction stays pending",
                            self.open.name)
                self.open = None
            return None
        if self.open is None or self.open.name == name:
            return "first"
        return "second"

    def call(self, module: nn.Module, role: str, inner: Callable, args: tuple,
             kwargs: dict) -> Any:
        if role == "whole":
            return self.owner.whole(inner, args, kwargs)
        if role == "first":
            return self._first(module, inner, args, kwargs)
        return self._second(module, inner, args, kwargs)

    def _first(self, module: nn.Module, inner: Callable, args: tuple, kwargs: dict) -> Any:
        why = cache_refusal(module)
        if why is not None:
            raise ValueError(f"dlo_fx.cfg_parallel: {why}")
        name = self.probe.name() if self.probe is not None and self.pairs == "context" else None
        call = Call(name, *_copied(args, kwargs))
        call.whole = call.signature not in self.templates
        self._agree(module, [1, call.signature, int(call.whole)], "the first call of a pair")
        self.open = call
        self.counts["whole" if call.whole else "deferred"] += 1
        if call.whole:
            out = self.owner.whole(inner, args, kwargs)
            devices: list = []

            def meta(leaf_name: str, t: torch.Tensor) -> torch.Tensor:
                devices.append(t.device)
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

            self.templates[call.signature] = (map_tensors("output", out, meta), devices)
            return out
        call.args, call.kwargs = _copied(call.args, call.kwargs, inference=True)
        for argument, t in _tensors(call.args, call.kwargs):
            if not t.is_inference():  # an inference tensor was copied: no one else writes it
                call.versions.append((argument, t, t._version))
        what = (f"the prediction of {type(module).__name__}'s call "
                f"{name or 'first of its pair'!r}")
        template, devices = self.templates[call.signature]
        devices = iter(devices)

        def promise(leaf_name: str, like: torch.Tensor) -> Pending:
            call.pending.append(Pending(like, what, device=next(devices)))
            return call.pending[-1]

        return map_tensors("output", template, promise)

    def _second(self, module: nn.Module, inner: Callable, args: tuple, kwargs: dict) -> Any:
        first, self.open = self.open, None
        if first.whole:
            self._agree(module, [2, first.signature, signature(args, kwargs), 1, 1],
                        "the second call of a pair")
            return self.owner.whole(inner, args, kwargs)
        moved = [a for a, t, v in first.versions if t._version != v]
        differ = _differ(first, args, kwargs)
        self._agree(module, [2, first.signature, signature(args, kwargs), int(not moved),
                             int(not differ)], "the second call of a pair")
        if moved:
            raise RuntimeError(
                f"dlo_fx.cfg_parallel: {', '.join(moved)} of {type(module).__name__}'s first "
                "call of a guidance pair changed in place before the second call, which "
                "computes the first; keep the first call's tensors unchanged until the second "
                "call (or run without cfg_parallel)")
        if differ:
            raise RuntimeError(
                f"dlo_fx.cfg_parallel: the two calls of a guidance pair of "
                f"{type(module).__name__} differ in {differ}: they are not the two branches "
                "of one step, so neither can stand for the other; pass both branches the "
                "same latents and timestep (or run without cfg_parallel)")
        mine = first if self.owner.group.rank == 0 else Call(None, args, kwargs)
        out = self.owner.compute(inner, mine.args, mine.kwargs)
        both = self.owner.exchange_outputs(out)  # [(first leaf, second leaf)] in leaf order
        if len(both) != len(first.pending):
            raise RuntimeError(
                f"dlo_fx.cfg_parallel: {type(module).__name__} returned {len(both)} tensors "
                f"at the second call of a pair, {len(first.pending)} at its first")
        for p, (a, _) in zip(first.pending, both):
            p.fill(a)
        seconds = iter(b for _, b in both)
        return map_tensors("output", out, lambda n, t: next(seconds))

    def _agree(self, module: nn.Module, words: list, what: str) -> list:
        rows = self.owner._exchange(words, what)
        if any(row != rows[0] for row in rows):
            self.open = None
            ranks = self.owner.group.ranks
            raise RuntimeError(
                f"dlo_fx.cfg_parallel: the ranks {list(ranks)} reached different calls of "
                f"{type(module).__name__} at {what} (step, digests, unchanged, matching: "
                + "; ".join(f"rank {r}: {row}" for r, row in zip(ranks, rows))
                + "); both ranks of a CFG pair must run the same pipeline call")
        return rows


def _differ(first: Call, args: tuple, kwargs: dict) -> str:
    """What tells the two calls of a pair apart that must be equal: the argument names,
    the batch argument's and the timestep's shape and dtype; "" where nothing."""
    if len(first.args) != len(args) or set(first.kwargs) != set(kwargs):
        return (f"their arguments ({len(first.args)} positional and {sorted(first.kwargs)} "
                f"against {len(args)} and {sorted(kwargs)})")
    for name in (*BATCH_ARGUMENTS, *TIMESTEP_ARGUMENTS):
        a, b = first.kwargs.get(name), kwargs.get(name)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
                (a.shape, a.dtype) != (b.shape, b.dtype)):
            return (f"{name} ({tuple(a.shape)} {a.dtype} against {tuple(b.shape)} "
                    f"{b.dtype})")
    return ""


def _copied(args: tuple, kwargs: dict, inference: bool = False) -> tuple[tuple, dict]:
    """The arguments with their containers copied and their tensors the same objects; with
    ``inference``, inference tensors copied (they keep no ``_version`` to check)."""
    def same(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.clone() if inference and t.is_inference() else t

    return (tuple(map_tensors(str(i), a, same) for i, a in enumerate(args)),
            {k: map_tensors(k, v, same) for k, v in kwargs.items()})


def _tensors(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    found: list = []

    def note(name: str, t: torch.Tensor) -> torch.Tensor:
        found.append((name, t))
        return t

    for i, a in enumerate(args):
        map_tensors(f"argument {i}", a, note)
    for k in sorted(kwargs):
        map_tensors(k, kwargs[k], note)
    return found


PLAIN = (int, float, bool, str, type(None))


def signature(args: tuple, kwargs: dict) -> int:
    """63 bits of a hash of every tensor argument's name, shape and dtype and every plain
    value (numbers, strings, their tuples): what a prediction's shape can depend on."""
    rows: list = []

    def walk(name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            rows.append((name, tuple(value.shape), str(value.dtype)))
        elif isinstance(value, PLAIN):
            rows.append((name, repr(value)))
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{name}.{k}", value[k])
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk(f"{name}[{i}]", v)

    for i, a in enumerate(args):
        walk(str(i), a)
    for k in sorted(kwargs):
        walk(k, kwargs[k])
    return int.from_bytes(hashlib.sha256(repr(rows).encode()).digest()[:8], "big") >> 1



def map_tensors(name: str, value: Any, fn: Callable[[str, Any], Any]) -> Any:
    """``value`` with ``fn(name, tensor)`` applied to every tensor in it (tuples, lists,
    dicts and diffusers' output dataclasses, rebuilt as their own type)."""
    if isinstance(value, torch.Tensor):
        return fn(name, value)
    if isinstance(value, dict):
        mapped = {k: map_tensors(str(k), v, fn) for k, v in value.items()}
        if type(value) is dict:
            return mapped
        try:
            return type(value)(**mapped)  # a BaseOutput dataclass
        except TypeError:
            return type(value)(mapped)
    if isinstance(value, (tuple, list)):
        items = [map_tensors(name, v, fn) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*items)
        return type(value)(items)
    return value

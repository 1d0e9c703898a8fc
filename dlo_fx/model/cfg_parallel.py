"""`cfg_parallel`: the two guidance branches of a denoiser on two ranks (a batched call
split here; two calls per step paired in cfg_pairs.py).

A diffusers pipeline with classifier-free guidance in one batched call (SD3, PixArt, Sana,
CogVideoX, LTX, HunyuanDiT, ...) calls its denoiser once per step with the batch
``[uncond; cond]`` and splits the noise prediction with ``noise_pred.chunk(2)``.
``dlo_fx.cfg_parallel(transformer, group)`` puts that call on the two ranks of ``group``:
each computes one half of the batch, and the halves are gathered back into the whole
batch, so the pipeline's own guidance arithmetic runs unchanged on every rank::

    dlo_fx.cfg_parallel(pipe.transformer, [0, 1])       # on ranks 0 and 1, each
    dlo_fx.compile_pipeline(pipe, options={"shard_group": [0, 1]})  # 1/2 of every block
    image = pipe(prompt, guidance_scale=7.0).images[0]  # the same image on both ranks

[Note: a CFG-parallel call]
A forward pre-hook and a forward hook (torch's own, with keyword arguments) sit around the
module's call, outside its compiled graph (`torch.compiler.disable`: the exchange runs
eagerly, the forward is compiled as before, its graph sees the half batch). For each call:

1. The batch is dim 0 of ``hidden_states`` (else ``sample``, else the first tensor
   argument). The two ranks exchange one small word row (batch, split, a digest of every
   tensor argument's name, shape and dtype) on a process group of their own
   (`collectives.exchange_group`, timeout ``timeout_s``); rows that differ raise
   ``RuntimeError`` on both ranks, naming both, before either computes: two ranks that
   are not running the same call never pair their halves.
2. An even batch is split: every tensor argument whose dim 0 is the batch (hidden
   states, encoder states, timestep, pooled projections, masks, also inside a dict such
   as PixArt's ``added_cond_kwargs``) is narrowed to this rank's half (rank ``i`` of the
   group, sorted, takes half ``i``: the uncond half on the first rank), except arguments
   whose name says they are positional tables shared by the whole batch (`UNBATCHED`:
   rotary embeddings, ``img_ids``/``txt_ids``), whose length can equal the batch by
   coincidence. Every output tensor whose dim 0 is the half batch is all-gathered along
   dim 0 into the whole batch.
3. An odd batch (a call with guidance off, batch 1) is not split: both ranks compute it
   whole, the same forward, so the weight gathers stay in lock-step and the output is
   the one of the same module without `cfg_parallel`.

Exact: a call returns, bit for bit, what the same CFG-parallel module returns resident
(every rank computes its half with the same kernels; the gather copies bytes). Against
one rank computing the batch of two it is exact only where the kernels do not depend on
the batch: a matrix product of M = B rows instead of 2B may block its sums differently
(docs/architecture.md, "CFG parallel", gives what the suite measures).

A pipeline that calls the denoiser twice per step (Wan's ``cache_context("cond")`` then
``("uncond")``, Flux's ``true_cfg_scale``) gives each call one branch of batch B: there is
nothing to split, and the first call of each pair is deferred to the second instead
([Note: two-call CFG parallel] in cfg_pairs.py). `cfg_parallel` installs both: the
pairing around the module's call, the split inside it. `cfg_refusal` names the
pipelines neither serves (a third call per step) before anything changes.

A rank whose forward raises never reaches the gather of its outputs; its peer's gather
raises within ``timeout_s`` (both ranks then refuse every later call on the group:
`ShardGroup.failed`), never waiting longer.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .. import torch_private
from ..config import DLOConfig
from .cfg_pairs import (BATCH_ARGUMENTS, PAIR_CONTEXTS, Pairs, cache_refusal, install_probe,
                        map_tensors as _map, remove_probe)
from .state import peek, state_of

log = logging.getLogger(__name__)

__all__ = ["calls_per_branch", "cfg_parallel", "cfg_refusal", "computed_whole", "UNBATCHED"]

UNBATCHED = ("rotary", "freqs", "img_ids", "txt_ids")
"""Words in an argument's name that mark a table shared by the whole batch (positions,
rotary embeddings): never split, whatever its length (see [Note: a CFG-parallel call])."""

PAIR_MARKERS = tuple(f'cache_context({q}{name}{q}' for name in PAIR_CONTEXTS for q in "\"'")
"""Source text of a pipeline that calls its denoiser once per guidance branch, naming each
call as two-call CFG parallel pairs them ([Note: two-call CFG parallel])."""

CONTEXT_NAME = re.compile(r"""cache_context\(\s*["']([A-Za-z0-9_]+)["']""")
"""A ``cache_context`` name in a pipeline's source."""

BATCHED_CONTEXTS = ("cond_uncond",)
"""``cache_context`` names of a batched guidance call (both branches in one call)."""


def cfg_refusal(pipeline_cls: type) -> Optional[str]:
    """Why a pipeline of class ``pipeline_cls`` cannot put its guidance branches on two
    ranks (a clause to follow its name), or ``None``. Covered: one batched call per step
    (split, [Note: a CFG-parallel call]) and two calls per step named "cond" and "uncond"
    (deferred, [Note: two-call CFG parallel]). Refused: a third call per step (a
    ``cache_context`` of another name: LTX-2's "uncond_stg", "uncond_modality"), or a
    ``true_cfg_scale`` loop without the names that tell its two calls apart."""
    import inspect

    call = getattr(pipeline_cls, "__call__", None)
    if call is None:
        return None
    try:
        source = inspect.getsource(inspect.unwrap(call))
        params = inspect.signature(call).parameters
    except (OSError, TypeError, ValueError):
        return None
    names = sorted(set(CONTEXT_NAME.findall(source)) - set(PAIR_CONTEXTS) - set(BATCHED_CONTEXTS))
    if names:
        return (f"calls its denoiser more than twice per step (cache_context "
                f"{', '.join(repr(n) for n in names)} besides 'cond' and 'uncond'), and CFG "
                "parallel pairs two branches")
    if "true_cfg_scale" in params and not any(m in source for m in PAIR_MARKERS):
        return ("calls its denoiser once per guidance branch without diffusers' "
                "cache_context('cond'/'uncond') names that tell the two calls of a step apart")
    return None


PAIRS = ("context", "order")
"""How two-call CFG parallel finds the two calls of a guidance pair (`cfg_parallel`'s
``pairs=``)."""


def calls_per_branch(pipeline_cls: type) -> bool:
    """Whether a pipeline of class ``pipeline_cls`` calls its denoiser once per guidance
    branch, naming the calls "cond" and "uncond" (two-call CFG parallel pairs them)."""
    import inspect

    try:
        source = inspect.getsource(inspect.unwrap(pipeline_cls.__call__))
    except (AttributeError, OSError, TypeError):
        return False
    return any(m in source for m in PAIR_MARKERS)


def cfg_parallel(module: nn.Module, group: Any, *, timeout_s: Optional[float] = None,
                 pairs: str = "context") -> nn.Module:
    """Compute the two guidance branches of ``module``'s calls on the two ranks of
    ``group`` and return ``module``: a batched call of batch 2B split, half each, the
    outputs gathered ([Note: a CFG-parallel call]); the two calls of a step of a pipeline
    that calls its denoiser once per branch, the first deferred to the second, which
    computes one branch per rank ([Note: two-call CFG parallel] in cfg_pairs.py).

    Args:
        module: the denoiser (a diffusers transformer or UNet, or any module called with
            its batch in dim 0). Offloaded, loaded with `dlo_fx.load`, compiled, with
            diffusers' context parallelism, or plain: the hooks sit outside all of them.
        group: the two ranks: a list of two global ranks, a ``ProcessGroup`` or a 1-D
            ``DeviceMesh`` of two; this process must be one of them. ``None`` removes
            what an earlier call installed.
        timeout_s: the longest a rank waits for its peer's half; default the
            ``collective_timeout_s`` default of `DLOConfig` (300 s).
        pairs: how the two calls of a guidance pair are found: ``"context"`` (default) by
            diffusers' ``cache_context("cond")`` / ``("uncond")`` around them (every
            other call is a batched call), ``"order"``: every two calls are a pair (a
            loop of one's own without ``cache_context``).

    Raises ValueError naming the argument before anything changes: not a module, a group
    that is not two ranks or does not hold this rank, torch.distributed not initialised,
    an unknown ``pairs``, diffusers' cache enabled on the module. Call it on both ranks of
    the group, at the same point (its process group is made then), after the module is
    compiled (``module.compile`` replaces what it installs)."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"dlo_fx.cfg_parallel: module={type(module).__name__} is not a torch "
                         "module (pass the pipeline's denoiser, e.g. pipe.transformer)")
    if group is None:
        _remove(module)
        return module
    timeout = DLOConfig.collective_timeout_s if timeout_s is None else timeout_s
    DLOConfig(collective_timeout_s=timeout)  # the same bounds, the same message
    if pairs not in PAIRS:
        raise ValueError(f"dlo_fx.cfg_parallel: pairs={pairs!r} is not allowed: expected one "
                         f"of {', '.join(map(repr, PAIRS))}")
    why = cache_refusal(module)
    if why is not None:
        raise ValueError(f"dlo_fx.cfg_parallel: {why}; nothing was changed")
    ranks = group_ranks(group)
    from ..runtime import exchange_group

    installed = CFGParallel(exchange_group(ranks, float(timeout)))
    _remove(module)
    probe = install_probe(module) if pairs == "context" else None
    installed.pairs = Pairs(installed, pairs, probe)
    installed.handles = [
        module.register_forward_pre_hook(installed.pre, with_kwargs=True),
        module.register_forward_hook(installed.post, with_kwargs=True)]
    installed.install_call(module)
    state_of(module).cfg_parallel = installed
    return module


@contextlib.contextmanager
def computed_whole(modules: Any) -> Iterator[None]:
    """Within the block, every call of the CFG-parallel ``modules`` (one or several) is
    computed whole on both ranks of its pair, neither split nor deferred: exact, in
    lock-step, no gain. For a request whose pipeline calls its denoiser once per step
    (guidance off), which deferral cannot serve ([Note: two-call CFG parallel])."""
    found = [peek(m) for m in ([modules] if isinstance(modules, nn.Module) else modules)]
    pairs = [s.cfg_parallel.pairs for s in found if s is not None and s.cfg_parallel is not None]
    before = [p.off for p in pairs]
    for p in pairs:
        p.off = True
    try:
        yield
    finally:
        for p, was in zip(pairs, before):
            p.off = was


def cfg_ranks(module: nn.Module) -> Optional[tuple[int, ...]]:
    """The global ranks ``module``'s calls are split over, or ``None``."""
    state = peek(module)
    installed = None if state is None else state.cfg_parallel
    return None if installed is None else installed.group.ranks


def cfg_pair_counts(module: nn.Module) -> dict:
    """How many guidance pairs of two calls ``module`` deferred and computed whole (see
    [Note: two-call CFG parallel]); empty where it is not CFG-parallel."""
    state = peek(module)
    installed = None if state is None else state.cfg_parallel
    return {} if installed is None else dict(installed.pairs.counts)


def _remove(module: nn.Module) -> None:
    state = peek(module)
    if state is not None and state.cfg_parallel is not None:
        for handle in state.cfg_parallel.handles:
            handle.remove()
        state.cfg_parallel.remove_call(module)
        remove_probe(module)
        state.cfg_parallel = None


def group_ranks(group: Any) -> tuple[int, ...]:
    """The two global ranks ``group`` names, sorted; ``ValueError`` naming it otherwise."""
    import torch.distributed as dist

    from ..config import _is_device_mesh, _is_process_group

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("dlo_fx.cfg_parallel: torch.distributed is not initialised; call "
                         "torch.distributed.init_process_group(...) on both ranks first")
    if _is_device_mesh(group):
        ranks = tuple(int(r) for r in group.mesh.flatten().tolist())
    elif _is_process_group(group):
        ranks = tuple(dist.get_process_group_ranks(group))
    elif isinstance(group, (list, tuple)) and all(
            isinstance(r, int) and not isinstance(r, bool) for r in group):
        ranks = tuple(group)
    else:
        raise ValueError(f"dlo_fx.cfg_parallel: group={group!r} is not allowed: expected a "
                         "list of two global ranks, a ProcessGroup or a DeviceMesh")
    ranks = tuple(sorted(ranks))
    if len(ranks) != 2 or len(set(ranks)) != 2:
        raise ValueError(f"dlo_fx.cfg_parallel: group={list(ranks)!r} is not allowed: "
                         "expected two distinct ranks, one per guidance branch")
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"dlo_fx.cfg_parallel: group={list(ranks)!r} does not contain this "
                         f"process (global rank {me}); give each rank the pair it is in")
    return ranks


class CFGParallel:
    """The hooks of one CFG-parallel module and the group they exchange on."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.handles: list = []
        self.pairs: Optional[Pairs] = None
        self._split = False
        self._whole_noted = False
        self._inside = False  # a pair's call runs: the hooks leave it as it is

    def install_call(self, module: nn.Module) -> None:
        """Put the pairs' deferral around the module's call, outside its compiled graph:
        a deferred call never reaches the module's forward nor its hooks."""
        pairs = self.pairs

        def call(*args: Any, **kwargs: Any) -> Any:
            inner = call.__wrapped__ or module._call_impl
            role = pairs.role()
            if role is None:
                return inner(*args, **kwargs)
            return pairs.call(module, role, inner, args, kwargs)

        call.__wrapped__ = torch_private.compiled_call(module)
        call.dlo_cfg_parallel = self
        torch_private.set_compiled_call(module, call)

    def remove_call(self, module: nn.Module) -> None:
        current = torch_private.compiled_call(module)
        if getattr(current, "dlo_cfg_parallel", None) is self:
            torch_private.set_compiled_call(module, current.__wrapped__)

    def whole(self, inner: Callable, args: tuple, kwargs: dict) -> Any:
        """The call computed whole on this rank, as without `cfg_parallel`."""
        return self.compute(inner, args, kwargs)

    def compute(self, inner: Callable, args: tuple, kwargs: dict) -> Any:
        """A pair's call on this rank; a rank whose forward raises marks the pair failed."""
        self._check("a guidance pair's call")
        self._inside = True
        try:
            return inner(*args, **kwargs)
        except BaseException as exc:
            self.group.failed = (f"the forward raised on global rank "
                                 f"{self.group.ranks[self.group.rank]}: "
                                 f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._inside = False

    def exchange_outputs(self, out: Any) -> list:
        """Each tensor of this rank's ``out`` and its peer's: ``[(first rank's, second
        rank's)]`` in leaf order, after both ranks agreed on their shapes."""
        leaves: list = []
        _map("output", out, lambda n, t: leaves.append((n, t)) or t)
        words = [3, len(leaves), _digest((), {str(i): t for i, (_, t) in enumerate(leaves)})]
        rows = self._exchange(words, "the predictions' shapes")
        if any(row != rows[0] for row in rows):
            raise RuntimeError(
                f"dlo_fx.cfg_parallel: the ranks {list(self.group.ranks)} computed predictions "
                "of different shapes for the two calls of a guidance pair (count, digest: "
                + "; ".join(f"rank {r}: {row}" for r, row in zip(self.group.ranks, rows))
                + ")")
        both = []
        for name, t in leaves:
            whole = self._gather(t.unsqueeze(0), name)
            both.append((whole[0], whole[1]))
        return both

    @torch.compiler.disable
    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        self._split = False
        if self._inside:
            return args, kwargs
        if self.pairs is not None and self.pairs.probe is not None \
                and self.pairs.probe.name() in PAIR_CONTEXTS:
            raise RuntimeError(
                f"dlo_fx.cfg_parallel: a call of {type(module).__name__} in cache_context "
                f"{self.pairs.probe.name()!r} reached its forward without the pairing "
                "cfg_parallel put around its call: the module was compiled (module.compile) "
                "after cfg_parallel, which replaced it. Call dlo_fx.cfg_parallel(module, "
                "group) again after compiling (compile_pipeline(cfg_group=) does)")
        batch = _batch(args, kwargs)
        split = batch is not None and batch % 2 == 0
        words = [batch or 0, int(split), _digest(args, kwargs)]
        rows = self._exchange(words, "the call's batch and argument shapes")
        if any(row != rows[0] for row in rows):
            raise RuntimeError(
                f"dlo_fx.cfg_parallel: the ranks {list(self.group.ranks)} reached different "
                f"calls of {type(module).__name__} (batch, split, argument digest: "
                + "; ".join(f"rank {r}: {row}" for r, row in zip(self.group.ranks, rows))
                + "); both ranks of a CFG pair must run the same pipeline call")
        if not split:
            if not self._whole_noted:
                self._whole_noted = True
                log.info("dlo_fx.cfg_parallel: %s called with batch %s: computed whole on "
                         "both ranks %s (nothing to split in two)", type(module).__name__,
                         batch, list(self.group.ranks))
            return args, kwargs
        half, me = batch // 2, self.group.rank

        def take(name: str, value: Any) -> Any:
            if (isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch
                    and not any(w in name for w in UNBATCHED)):
                return value.narrow(0, me * half, half)
            return value

        self._split = True
        return (tuple(_map(str(i), a, take) for i, a in enumerate(args)),
                {k: _map(k, v, take) for k, v in kwargs.items()})

    @torch.compiler.disable
    def post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if not self._split:
            return out
        self._split = False
        half = _batch(args, kwargs)

        def gather(name: str, value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == half:
                return self._gather(value, name)
            return value

        return _map("output", out, gather)

    def _exchange(self, words: list, what: str) -> list:
        from ..runtime import all_gather_single, exchange_device

        group = self.group
        self._check(what)
        mine = torch.tensor(words, dtype=torch.int64, device=exchange_device(group.pg))
        every = torch.empty(group.dp * len(words), dtype=torch.int64, device=mine.device)
        self._run(lambda: all_gather_single(every, mine, group=group.pg), what)
        return every.view(group.dp, len(words)).tolist()

    def _gather(self, half: torch.Tensor, name: str) -> torch.Tensor:
        from ..runtime import all_gather_single

        half = half.contiguous()
        whole = half.new_empty((half.shape[0] * self.group.dp, *half.shape[1:]))
        self._check(f"the halves of {name}")
        if half.device.type == "meta":  # shapes only: nothing to exchange
            return whole
        self._run(lambda: all_gather_single(whole, half, group=self.group.pg),
                  f"the halves of {name}")
        return whole

    def _check(self, what: str) -> None:
        group = self.group
        if group.failed is not None:
            raise RuntimeError(
                f"dlo_fx.cfg_parallel: {what} is not exchanged over the CFG pair "
                f"{list(group.ranks)} on global rank {group.ranks[group.rank]}: an exchange "
                f"failed before ({group.failed}), so the pair is out of step; start both "
                "ranks afresh")

    def _run(self, collective: Callable[[], Any], what: str) -> None:
        group = self.group
        try:
            collective()
        except Exception as exc:  # the peer raised, died, or the timeout passed
            group.failed = f"{type(exc).__name__}: {exc}"
            raise RuntimeError(
                f"dlo_fx.cfg_parallel: exchanging {what} over the CFG pair {list(group.ranks)} "
                f"failed on global rank {group.ranks[group.rank]}: {exc} (its peer raised, "
                "died or did not reach the same call in time)") from exc


def _batch(args: tuple, kwargs: dict) -> Optional[int]:
    for name in BATCH_ARGUMENTS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


def _digest(args: tuple, kwargs: dict) -> int:
    """63 bits of a hash of every tensor argument's name, shape and dtype."""
    rows: list = []

    def note(name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            rows.append((name, tuple(value.shape), str(value.dtype)))
        return value

    for i, a in enumerate(args):
        _map(str(i), a, note)
    for k in sorted(kwargs):
        _map(k, kwargs[k], note)
    return int.from_bytes(hashlib.sha256(repr(rows).encode()).digest()[:8], "big") >> 1


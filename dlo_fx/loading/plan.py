"""What `dlo_fx.load` will do, decided before it does anything: every model tensor matched
to its checkpoint tensor (keys, shapes, dtypes validated), and the parameters split into
resident ones (`dlo_fx.planning.residency`) and blocks (`dlo_fx.planning.blocks`), the same decisions the
passes make at compile time, over the parameters in registration order.

`plan_load` raises one ValueError listing every mismatch and registers nothing.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .checkpoint import Checkpoint, TensorInfo
from ..config import DLOConfig, did_you_mean
from .gguf import shape_text
from ..planning.blocks import Unit, partition
from ..planning.residency import Candidate, decide_residency
from ..runtime import Fact, storage_choice, storage_span, stored_tensor
from ..model.storage_dtype import mark_storage

log = logging.getLogger(__name__)

__all__ = ["KeyMap", "LoadPlan", "Target", "agree_on_plan", "block_rows", "load_facts",
           "map_keys", "model_targets", "resident_fact", "settle_mode",
           "plan_load", "split_params"]

KeyMap = Union[Mapping[str, str], Callable[[str], Optional[str]]]


@dataclass(eq=False)
class Target:
    """One model tensor (a parameter or a buffer) and where its bytes come from."""

    kind: str  # "param" or "buffer"
    tensor: torch.Tensor  # the meta parameter, or the buffer as built
    dtype: torch.dtype  # the dtype it will have
    persistent: bool = True
    names: list[tuple[nn.Module, str, str]] = field(default_factory=list)  # (module, attr, fqn)
    info: Optional[TensorInfo] = None

    @property
    def fqn(self) -> str:
        return self.names[0][2]

    @property
    def stored_as(self) -> Optional[torch.dtype]:
        """The dtype a parameter is stored in when it differs from its own (``storage_dtype``:
        see [Note: storing weights in another dtype] in storage_dtype.py), else None."""
        choice = storage_choice(self.tensor)
        return (choice.dtype if self.kind == "param" and choice is not None
                and choice.dtype != self.dtype else None)

    @property
    def stored_dtype(self) -> torch.dtype:
        return self.stored_as or self.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of its storage span in the model's layout and final dtype, as stored."""
        return storage_span(self.tensor) * _itemsize(self.stored_dtype)


@dataclass(eq=False)
class LoadPlan:
    """The module, its checkpoint, and where every parameter goes: materialised on the
    device (``resident``) or streamed (``blocks``, in registration order)."""

    module: nn.Module
    ckpt: Checkpoint
    params: list[Target]
    buffers: list[Target]
    resident: list[Target]
    blocks: list[list[Target]]
    named: list[Target] = field(default_factory=list)  # named in ``resident=``: every graph too
    ends: list[str] = field(default_factory=list)  # why each block ends where it does
    budget: int = 0

    def rows(self) -> list[tuple]:
        """One (parameter count, bytes, first FQN) row per block, compared across ranks."""
        return block_rows(self.blocks)


def block_rows(blocks: Sequence[Sequence[Target]]) -> list[tuple]:
    """One (parameter count, bytes, first FQN) row per block, compared across ranks."""
    return [(len(b), sum(t.nbytes for t in b), b[0].fqn) for b in blocks]


def settle_mode(runtime: Any, blocks: Sequence[Sequence[Target]]) -> None:
    """``mode="auto"``, still undecided: choose it from the blocks' bytes and the machine's
    measured figures (a collective probe), before anything is stored
    (`dlo_fx.planning.settle.settle_mode`): the one place a runtime's mode is settled."""
    if not blocks:
        return
    from ..planning.settle import settle_mode as choose_open_mode
    from ..runtime import machine_figures
    from ..runtime import store_view

    group, device = runtime.group, runtime.device
    choice = choose_open_mode(store_view(runtime), [sum(t.nbytes for t in b) for b in blocks],
                              lambda: machine_figures(device, group))
    if choice is not None:
        runtime.set_mode(*choice)


def resident_fact(resident: Sequence[Target]) -> Fact:
    """The resident parameters, which every rank must have alike (load and offload)."""
    return Fact("resident parameters", sorted(t.fqn for t in resident),
                "Every rank must load or offload with the same resident= and resident_bytes")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _keep_fp32(fqn: str, keep: Sequence[str]) -> bool:
    parts = fqn.split(".")
    return any(m in parts for m in keep)


def model_targets(module: nn.Module, dtype: Optional[torch.dtype]
                  ) -> tuple[list[Target], list[Target]]:
    """Parameters (registration order, tied ones once; of a tensor-parallel parameter, its
    local tensor) and buffers of ``module``."""
    keep = tuple(getattr(type(module), "_keep_in_fp32_modules", None) or ())
    params: dict[int, Target] = {}
    buffers: dict[int, Target] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, p in mod._parameters.items():
            if p is None:
                continue
            target = params.get(id(p))
            if target is None:
                final = p.dtype
                if dtype is not None and p.dtype.is_floating_point:
                    final = torch.float32 if _keep_fp32(dot + name, keep) else dtype
                # a DTensor's local tensor (see [Note: a tensor-parallel parameter streams
                # its local shard])
                target = params[id(p)] = Target("param", stored_tensor(p), final)
            target.names.append((mod, name, dot + name))
        for name, b in mod._buffers.items():
            if b is None:
                continue
            target = buffers.get(id(b))
            if target is None:
                persistent = name not in mod._non_persistent_buffers_set
                target = buffers[id(b)] = Target("buffer", b, b.dtype, persistent=persistent)
            target.names.append((mod, name, dot + name))
    return list(params.values()), list(buffers.values())


def map_keys(ckpt: Checkpoint, key_map: Optional[KeyMap]) -> dict[str, TensorInfo]:
    """The checkpoint's tensors by model FQN, through ``key_map``."""
    if key_map is not None and not (isinstance(key_map, Mapping) or callable(key_map)):
        raise ValueError(f"dlo_fx.load: key_map={key_map!r} must be a dict or a callable")
    out: dict[str, TensorInfo] = {}
    for key, info in ckpt.tensors.items():
        if key_map is None:
            name: Optional[str] = key
        elif isinstance(key_map, Mapping):
            name = key_map.get(key, key)
        else:
            name = key_map(key)
        if name is None:
            continue
        if not isinstance(name, str):
            raise ValueError(f"dlo_fx.load: key_map turned checkpoint key {key!r} into "
                             f"{name!r}; it must return a str (or None to drop the key)")
        if name in out:
            raise ValueError(f"dlo_fx.load: checkpoint keys {out[name].key!r} and {key!r} both "
                             f"map to {name!r}; fix key_map")
        out[name] = info
    return out


MAX_REPORT_LINES = 40
"""A mismatch report never exceeds this many lines, whatever the model's size."""


def _summary(sections: Sequence[tuple[str, Sequence[str]]], limit: int = 10) -> str:
    """One line per kind (its count), then the first ``limit`` details of it; at most
    `MAX_REPORT_LINES` lines in all."""
    lines = []
    for head, details in sections:
        lines.append("  " + head)
        lines += [f"    {d}" for d in details[:limit]]
        if len(details) > limit:
            lines.append(f"    ... and {len(details) - limit} more")
    if len(lines) > MAX_REPORT_LINES:
        lines = lines[:MAX_REPORT_LINES - 1] + [f"  ... ({len(lines) - MAX_REPORT_LINES + 1} "
                                                "more lines)"]
    return "\n".join(lines)


def _config_hint(module: nn.Module, wrong: int, total: int) -> str:
    """Most tensors missing or misshapen: the model was built from another config."""
    if total == 0 or wrong < max(2, total // 4):
        return ""
    return (f"\n  {wrong} of the model's {total} parameters are missing or misshapen: was "
            f"{type(module).__name__} built from this checkpoint's configuration? Pass "
            "config= (or put the model's config.json next to the weights)")


def _casts_text(casts: Sequence[tuple[torch.dtype, torch.dtype]], dtype: Optional[torch.dtype],
                module: nn.Module) -> str:
    """The floating-point casts a load makes, and why (see [Note: the dtype rule]): to the
    model's own dtype (no ``dtype=``), to ``dtype=``, or to float32 for the modules the
    class keeps in float32 (``_keep_in_fp32_modules``, whatever ``dtype=`` says)."""
    def pairs(group: Sequence[tuple[torch.dtype, torch.dtype]]) -> str:
        return ", ".join(sorted({f"{a} -> {b}".replace("torch.", "") for a, b in group}))

    if dtype is None:
        return (f"cast {len(casts)} checkpoint tensor(s) to the model's dtype while copying "
                f"({pairs(casts)}); pass dtype= to choose the model's dtype")
    given = [c for c in casts if c[1] == dtype]
    kept = [c for c in casts if c[1] != dtype]  # float32: _keep_in_fp32_modules
    parts = [f"{len(given)} to dtype={str(dtype).removeprefix('torch.')} ({pairs(given)})"] \
        if given else []
    if kept:
        keep = list(getattr(type(module), "_keep_in_fp32_modules", None) or ())
        parts.append(f"{len(kept)} to float32, kept so by {type(module).__name__}."
                     f"_keep_in_fp32_modules {keep} ({pairs(kept)})")
    return f"cast {len(casts)} checkpoint tensor(s) while copying: " + "; ".join(parts)


def _listing(names: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    more = f" (first {limit} of {len(names)})" if len(names) > limit else ""
    return f"{shown}{more}"


def plan_load(module: nn.Module, ckpt: Checkpoint, cfg: DLOConfig, *,
              dtype: Optional[torch.dtype], key_map: Optional[KeyMap], strict: bool,
              resident: Sequence[str] = ()) -> LoadPlan:
    """Match the checkpoint to the module and split the parameters into blocks.

    Raises ValueError listing every mismatch; registers nothing.
    """
    if cfg.storage_dtype is not None:
        mark_storage(module, cfg.storage_dtype)
    params, buffers = model_targets(module, dtype)
    by_name = map_keys(ckpt, key_map)
    what = f"{type(module).__name__} from checkpoint {ckpt.source!r}"
    missing, kept = [], []
    shapes, dtypes, casts = [], [], []
    claimed: set[str] = set()
    for t in params + [b for b in buffers if b.persistent]:
        found = next((fqn for _, _, fqn in t.names if fqn in by_name), None)
        if found is None:
            if t.kind == "param" or strict or t.tensor.is_meta:
                missing.append(t.fqn)
            else:
                kept.append(t.fqn)
            continue
        claimed.update(fqn for _, _, fqn in t.names)
        t.info = info = by_name[found]
        where = "the checkpoint" if info.key == t.fqn else f"checkpoint key {info.key!r}"
        if tuple(t.tensor.shape) != info.shape:
            expects = shape_text(tuple(t.tensor.shape), getattr(t.tensor, "quant_type", None),
                                 getattr(t.tensor, "quant_shape", None))  # a GGUFParameter's
            holds = shape_text(info.shape, info.quant_type, info.quant_shape)
            shapes.append(f"{t.fqn!r}: the model expects {expects}, {where} holds {holds}")
        elif info.dtype != t.dtype:
            if info.dtype.is_floating_point and t.dtype.is_floating_point:
                casts.append((info.dtype, t.dtype))  # See [Note: the dtype rule]
            else:
                dtypes.append(f"{t.fqn!r}: the model expects {t.dtype}, {where} holds "
                              f"{info.dtype}; only floating-point tensors are cast")
    unexpected = [k for k in by_name if k not in claimed]
    computed = [b.fqn for b in buffers if b.tensor.is_meta and not b.persistent]
    sections = []
    if missing:
        sections.append((f"{len(missing)} missing key(s) (in the model, not in the "
                         f"checkpoint): {_listing(missing)}", []))
    if shapes:
        sections.append((f"{len(shapes)} shape mismatch(es):", shapes))
    if dtypes:
        sections.append((f"{len(dtypes)} dtype mismatch(es):", dtypes))
    if unexpected and strict:
        sections.append((f"{len(unexpected)} unexpected key(s) (in the checkpoint, not in the "
                         f"model): {_listing(unexpected)}; pass strict=False to ignore them or "
                         "key_map= to rename them", []))
    if computed:
        sections.append((f"{len(computed)} non-persistent buffer(s) computed from a parameter "
                         f"in __init__ (on the meta device) that no checkpoint holds: "
                         f"{_listing(computed)}", []))
    if sections:
        raise ValueError(f"dlo_fx.load: {what} does not match "
                         f"({ckpt.describe_files()}):\n" + _summary(sections)
                         + _config_hint(module, len(missing) + len(shapes), len(params)))
    if casts:
        log.info("dlo_fx.load: %s: %s", what, _casts_text(casts, dtype, module))
    if (unexpected or kept) and not strict:
        warnings.warn(f"dlo_fx.load: {what}: ignoring {len(unexpected)} unexpected key(s) "
                      f"[{_listing(unexpected, 20)}]; {len(kept)} buffer(s) keep their "
                      f"constructed values [{_listing(kept, 20)}]", UserWarning, stacklevel=3)
    split = split_params(params, cfg, resident, "dlo_fx.load")
    return LoadPlan(module=module, ckpt=ckpt, params=params, buffers=buffers, **split)


def split_params(params: list[Target], cfg: DLOConfig, resident: Sequence[str],
                 caller: str) -> dict[str, Any]:
    """Split ``params`` into resident ones and blocks, as the passes do at compile time
    (`dlo_fx.planning.residency`, `dlo_fx.planning.blocks`): the `LoadPlan` fields
    ``resident``, ``blocks``, ``named``, ``ends`` and ``budget``."""
    keep = _resident_set(params, resident, caller)
    cands = [Candidate(t.fqn, 0 if t.tensor.numel() == 0 else t.nbytes, named=id(t) in keep)
             for t in params]
    decision = decide_residency(cands, resident_bytes=cfg.resident_bytes,
                                block_bytes=cfg.block_bytes, num_slots=cfg.num_slots)
    streamed = [params[i] for i in decision.streamed_in_use_order(cands)]
    cuts = partition([Unit(t.fqn, t.nbytes) for t in streamed], decision.budget,
                     decision.layers)
    if decision.layers.refined:
        log.info("%s: %s", caller, decision.layers.describe())
    for i, c in enumerate(cuts):
        log.debug("%s: block %d: %s .. %s, %d bytes, ends: %s", caller, i,
                  streamed[c.start].fqn, streamed[c.stop - 1].fqn, c.nbytes, c.reason)
    return dict(resident=[t for t, r in zip(params, decision.reasons) if r is not None],
                blocks=[streamed[c.start:c.stop] for c in cuts],
                named=[t for t in params if id(t) in keep],
                ends=[c.reason for c in cuts], budget=decision.budget)


def _resident_set(params: list[Target], names: Sequence[str], caller: str) -> set[int]:
    """Targets named (by FQN or module prefix) in ``names``; an unmatched name is an error."""
    if isinstance(names, str):
        names = (names,)
    keep: set[int] = set()
    for name in names:
        hits = [t for t in params if any(fqn == name or fqn.startswith(name + ".")
                                         for _, _, fqn in t.names)]
        if not hits:
            fqns = {fqn for t in params for _, _, fqn in t.names}
            prefixes = {f.rsplit(".", i)[0] for f in fqns for i in range(1, f.count(".") + 1)}
            raise ValueError(f"{caller}: resident={name!r} names no parameter of the model; "
                             f"{did_you_mean(name, fqns | prefixes)}give parameter FQNs or "
                             "module prefixes such as 'patch_embed'")
        keep.update(id(t) for t in hits)
    return keep


def load_facts(plan: LoadPlan, shards: Any) -> list[Fact]:
    """What the ranks compare when `dlo_fx.load` stores its blocks, beside the runtime's
    facts and the blocks' layouts and fingerprints (see [Note: storing blocks] in
    runtime/runtime.py): the `dlo-fx shard` run and the resident parameters."""
    return [
        Fact("`dlo-fx shard` run (the shard id in its manifest)",
             shards.manifest["shard_id"] if shards is not None else None,
             "Every rank must load the files of one `dlo-fx shard` run: copy that run's folder "
             "to every rank (a folder of another run, or a stale copy, holds other weights), "
             "or rerun `dlo-fx shard` once and copy its output"),
        resident_fact(plan.resident),
    ]


def agree_on_plan(runtime: Any, rows: Optional[list], error: Optional[BaseException],
                  caller: str) -> None:
    """In allgather mode (or ``"auto"``, still undecided), every rank of the shard group
    learns whether any rank failed to plan its load or offload, and that all planned the
    same blocks (``rows``, one per block): all raise together, none hangs in a later
    collective."""
    group = runtime.group
    if runtime.mode == "rank_local" or group.dp == 1:
        if error is not None:
            raise error
        return
    from ..runtime import exchange_json, plan_digest

    mine = (f"{type(error).__name__}: {error}" if error is not None else None,
            plan_digest(rows) if rows is not None else None)
    every = exchange_json(mine, group, "the load plans")
    if error is not None:
        raise error
    failed = [(group.ranks[i], e) for i, (e, _) in enumerate(every) if e is not None]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"{caller} failed on global rank {rank} of the "
                         f"{group.describe()} ({message}); no rank stored anything")
    if len({d for _, d in every}) > 1:  # every rank sees it: the rows, to name the block
        from ..runtime import differing, plan_fact

        plans = exchange_json([list(r) for r in rows], group, "the differing load plans")
        fact = plan_fact(plans[group.rank], "Give every rank the same model and the same "
                         "options")
        raise ValueError(differing(group, fact, plans, f"the plan of {caller}"))

"""Byte layout of a block: tensors flattened in storage order, each aligned, then sharded.

[Note: block layout]
A block is the flat byte image of its parameters, each at its own strides and aligned.
Each parameter contributes the span of its storage that its view covers (``storage_offset``
to the last element it can reach), so a non-contiguous parameter (a transposed weight)
keeps its strides: it is rebuilt in the slot with ``as_strided`` over the same bytes, never
re-ordered by element. Every tensor starts at a multiple of ``alignment`` bytes, so dtype
views are legal and kernels see the same pointer alignment as on a resident tensor. A block
may mix dtypes.

[Note: a storage dtype]
Bytes are stored in the storage dtype; the parameter and every value read from it keep
the parameter's own dtype. A parameter may be stored in another dtype than its own
(``storage_dtype``: fp8 bytes of a bf16 layer): its entry's ``dtype`` is then the stored
one and ``compute_dtype`` the parameter's. The block, the shards, the files and the slots
hold the stored bytes, and the parameter's value is ``view_of(...).to(compute_dtype)``,
cast on the device: in the graph by a node right after the slot view, elsewhere by
`Entry.value_of`. The parameter itself (a `StoredWeight`) keeps its own dtype, which is
what Dynamo traced the graph with.

[Note: a quantized weight is its inner tensors]
A parameter that is a traceable tensor subclass (torchao's ``Int8Tensor``, ``Float8Tensor``,
...: ``__tensor_flatten__`` names the plain tensors it is made of, ``qdata`` and ``scale``)
is laid out as those inner tensors, each aligned like a parameter of its own (`Entry.parts`,
recursively for a subclass inside a subclass). Its value is rebuilt from their views with
``__tensor_unflatten__`` and the flatten context kept at store time (`Entry.view_of`), in
the slot as anywhere else, so the graph's ``linear(x, weight)`` runs the subclass's own
kernel on the streamed quantized bytes: what the resident quantized model runs.

Sharding over ``dp`` ranks pads the block to ``dp * S`` bytes with
``S = roundup(ceil(nbytes / dp), alignment)``; rank ``r`` keeps bytes ``[r*S, (r+1)*S)``,
zero-padded at the tail, and an in-place AllGather of the ``dp`` shards rebuilds the block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...torch_private import is_traceable_wrapper_subclass


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def storage_span(t: torch.Tensor) -> int:
    """Elements of storage a view reaches from its storage offset (0 for empty tensors)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def span_bytes(t: torch.Tensor) -> int:
    return storage_span(t) * t.element_size()


@dataclass(frozen=True)
class StorageChoice:
    """How one parameter is to be stored when not in its own dtype (``storage_dtype``, or
    diffusers' layerwise casting taken over: see [Note: storing weights in another dtype]
    in model/storage_dtype.py)."""

    dtype: torch.dtype
    """The dtype its bytes are stored in."""
    rounded: bool = False
    """It holds the values ``dtype`` holds, in its own dtype (`round_to_storage`)."""
    from_hook: bool = False
    """Taken over from diffusers' layerwise casting: the model's own choice, which
    `dlo_fx.release` keeps (an ``options["storage_dtype"]`` choice is forgotten)."""


_CHOICES = WeakIdKeyDictionary()  # parameter -> its StorageChoice (by identity, weakly)


def storage_choice(param: torch.Tensor) -> Optional[StorageChoice]:
    """``param``'s storage choice, or None (stored in its own dtype)."""
    return _CHOICES.get(param)


def choose_storage(param: torch.Tensor, choice: Optional[StorageChoice]) -> None:
    """Record (None: forget) how ``param`` is to be stored. A record, not an attribute:
    a copy of the parameter (``_apply``, a loader's new parameter) is stored in its own
    dtype unless chosen again."""
    if choice is None:
        _CHOICES.pop(param, None)
    else:
        _CHOICES[param] = choice


def storage_dtype_of(param: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype ``param`` is to be stored in when it differs from its own, else None."""
    choice = _CHOICES.get(param)
    return choice.dtype if choice is not None and choice.dtype != param.dtype else None


def stored_span_bytes(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> int:
    """Bytes of ``t``'s storage span stored as ``dtype`` (default: its own)."""
    if dtype is None or dtype == t.dtype:
        return span_bytes(t)
    return storage_span(t) * torch.empty((), dtype=dtype).element_size()


def stored_bytes(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The flat bytes ``t``'s storage span is stored as: its own (a view), or, stored as
    another ``dtype``, those of a cast copy with its shape and strides."""
    if dtype is None or dtype == t.dtype:
        return span_as_bytes(t)
    out = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t.detach())
    return span_as_bytes(out)


def span_as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s storage span as a flat uint8 tensor (a view, no copy)."""
    span = storage_span(t)
    flat = t.detach().as_strided((span,), (1,), t.storage_offset())
    return flat.view(torch.uint8)


@dataclass(frozen=True)
class Entry:
    """Where one parameter lives inside its block's flat bytes."""

    uid: int
    fqn: str
    block: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype  # the dtype of the stored bytes
    compute_dtype: Optional[torch.dtype] = None  # the parameter's, when stored in another
    # A tensor subclass: the entries of its inner tensors, and (class, flatten context,
    # inner names) to rebuild it (see [Note: a quantized weight is its inner tensors])
    parts: tuple["Entry", ...] = ()
    wrapper: Any = field(default=None, compare=False)

    @property
    def leaves(self) -> list["Entry"]:
        """The entries that hold bytes: itself, or its inner tensors' (recursively)."""
        return [self] if not self.parts else [x for p in self.parts for x in p.leaves]

    def value_of(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameter's value from a block's flat bytes: `view_of`, cast to the
        parameter's dtype when it is stored in another (see [Note: a storage dtype])."""
        view = self.view_of(flat)
        return view if self.compute_dtype is None else view.to(self.compute_dtype)

    def span_of(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameter's storage span from a block's flat bytes, as a 1-D tensor of the
        parameter's dtype (cast when stored in another): element ``i`` is the element at
        storage offset ``storage_offset + i`` of the parameter's own storage. Plain
        entries only (a tensor subclass has no one span)."""
        if self.parts:
            raise TypeError("dlo: internal error: span_of of a tensor subclass's entry")
        typed = flat[self.offset : self.offset + self.nbytes].view(self.dtype)
        return typed if self.compute_dtype is None else typed.to(self.compute_dtype)

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        """Rebuild the parameter's view over a block's flat uint8 bytes."""
        if self.parts:
            cls, ctx, names = self.wrapper
            inner = {n: p.view_of(flat) for n, p in zip(names, self.parts)}
            return cls.__tensor_unflatten__(inner, ctx, self.shape, self.stride)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        if self.nbytes == 0:
            return torch.empty(self.shape, dtype=self.dtype, device=flat.device)
        typed = flat[self.offset : self.offset + self.nbytes].view(self.dtype)
        assert typed.storage_offset() * itemsize == flat.storage_offset() + self.offset
        return typed.as_strided(self.shape, self.stride, typed.storage_offset())


@dataclass(frozen=True)
class ShardSpec:
    """How a block of ``nbytes`` is split over ``dp`` ranks."""

    nbytes: int
    dp: int
    shard_bytes: int

    @classmethod
    def of(cls, nbytes: int, dp: int, alignment: int) -> "ShardSpec":
        shard = round_up(-(-nbytes // dp), alignment) if nbytes else 0
        return cls(nbytes=nbytes, dp=dp, shard_bytes=shard)

    @property
    def padded_bytes(self) -> int:
        return self.shard_bytes * self.dp

    def rank_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_bytes
        return start, start + self.shard_bytes


def plan_offsets(sizes: list[int], alignment: int) -> tuple[list[int], int]:
    """Aligned byte offsets for tensors of ``sizes`` bytes, and the total (aligned)."""
    offsets, cursor = [], 0
    for size in sizes:
        offsets.append(cursor)
        cursor = round_up(cursor + size, alignment)
    return offsets, cursor


def copy_into_shard(
    shard: torch.Tensor, entries: list[Entry], sources: list[torch.Tensor], start: int
) -> None:
    """Copy the bytes of ``sources`` (one flat uint8 tensor per entry) that fall in
    ``[start, start + shard.numel())`` of the block into ``shard``; the rest stays as is."""
    end = start + shard.numel()
    for entry, src in zip(entries, sources):
        lo, hi = max(entry.offset, start), min(entry.offset + entry.nbytes, end)
        if lo < hi:
            shard[lo - start : hi - start].copy_(src[lo - entry.offset : hi - entry.offset])


_OWN_WRAPPERS: tuple[type, ...] = ()
"""dlo's own wrapper subclass (`StoredWeight`), which weights/stored.py registers when it defines
it (`own_wrapper`): layout sits below weights/stored.py and imports nothing from it."""


def own_wrapper(cls: type) -> type:
    """Register ``cls`` as dlo's own wrapper subclass: never laid out as inner tensors."""
    global _OWN_WRAPPERS
    _OWN_WRAPPERS += (cls,)
    return cls


def is_composite(t: Any) -> bool:
    """Whether ``t`` is a tensor subclass made of inner tensors (torchao's quantized
    weights) that dlo lays out as those tensors, not dlo's own `StoredWeight`."""
    return is_traceable_wrapper_subclass(t) and not isinstance(t, _OWN_WRAPPERS)


def inner_tensors(t: torch.Tensor) -> tuple[list[str], Any, list[torch.Tensor]]:
    """The names, flatten context and tensors of a composite ``t``'s inner tensors."""
    names, ctx = t.__tensor_flatten__()
    return list(names), ctx, [getattr(t, n) for n in names]


def leaf_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes, in layout order."""
    if not is_composite(t):
        return [t]
    return [x for inner in inner_tensors(t)[2] for x in leaf_tensors(inner)]


def param_bytes(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> int:
    """Bytes a parameter is stored as: its storage span (in ``dtype``), or its inner
    tensors' spans (unaligned)."""
    if is_composite(t):
        return sum(span_bytes(x) for x in leaf_tensors(t))
    return stored_span_bytes(t, dtype)


def lay_out(t: torch.Tensor, fqn: str, cursor: int, alignment: int, uid: int, block: int,
            stored_as: Optional[torch.dtype] = None) -> tuple[Entry, int]:
    """The entry of ``t`` starting at byte ``cursor`` of its block (aligned up), and the
    aligned cursor after it. A composite's inner tensors follow each other, each aligned."""
    if is_composite(t):
        names, ctx, inner = inner_tensors(t)
        parts = []
        start = round_up(cursor, alignment)
        for name, x in zip(names, inner):
            part, cursor = lay_out(x, f"{fqn}.{name}", cursor, alignment, uid, block)
            parts.append(part)
        end = max((p.offset + p.nbytes for p in parts), default=start)
        return Entry(uid=uid, fqn=fqn, block=block, offset=start, nbytes=end - start,
                     shape=tuple(t.shape), stride=tuple(t.stride()), dtype=t.dtype,
                     parts=tuple(parts), wrapper=(type(t), ctx, tuple(names))), cursor
    offset = round_up(cursor, alignment)
    size = stored_span_bytes(t, stored_as)
    entry = Entry(uid=uid, fqn=fqn, block=block, offset=offset, nbytes=size,
                  shape=tuple(t.shape), stride=tuple(t.stride()), dtype=stored_as or t.dtype,
                  compute_dtype=t.dtype if stored_as is not None else None)
    return entry, round_up(offset + size, alignment)


def leaf_entries(entries: Sequence[Entry]) -> list[Entry]:
    return [x for e in entries for x in e.leaves]

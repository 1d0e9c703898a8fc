"""Byte layout of a block: tensors flattened in storage order, each aligned, then sharded.

[Note: block layout]
A block is the flat byte image of its parameters. Each parameter contributes the span of
its storage that its view covers (``storage_offset`` to the last element it can reach), so
a non-contiguous parameter (a transposed weight) keeps its strides: it is rebuilt in the
slot with ``as_strided`` over the same bytes, never re-ordered by element. Every tensor
starts at a multiple of ``alignment`` bytes, so dtype views are legal and kernels see the
same pointer alignment as on a resident tensor. A block may mix dtypes.

Sharding over ``dp`` ranks pads the block to ``dp * S`` bytes with
``S = roundup(ceil(nbytes / dp), alignment)``; rank ``r`` keeps bytes ``[r*S, (r+1)*S)``,
zero-padded at the tail, and an in-place AllGather of the ``dp`` shards rebuilds the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def storage_span(t: torch.Tensor) -> int:
    """Elements of storage a view reaches from its storage offset (0 for empty tensors)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def span_bytes(t: torch.Tensor) -> int:
    return storage_span(t) * t.element_size()


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
    dtype: torch.dtype

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        """Rebuild the parameter's view over a block's flat uint8 bytes."""
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

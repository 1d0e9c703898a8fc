"""Blocks from ``(name, bytes)`` units: natural layers, the default budget, and the cuts.

One partition serves both planners: the `partition_blocks` pass (graph parameters in
first-use order) and `dlo_fx.load` (model parameters in registration order). Neither
hands in anything but names and byte counts, and both get back `Cut`s: slices of the
units they gave, each with the reason it ends where it does.

[Note: blocks by footprint]
Blocks follow the model's layers, whatever its modules are called: a DiT of N similar
layers gets about N blocks. A block is the unit of streaming, and the slots are as large as
the largest block.

1. *Natural layers.* A parameter's layer is its prefix up to the outermost numeric
   component (``blocks.3.attn.qkv.weight`` -> ``blocks.3``, a ``ModuleList`` or
   ``Sequential`` index), else its top-level module (``patch_embed``).
2. *Footprint refinement.* When one module that is not such an indexed layer holds more
   than half of the streamed bytes (a ``ModuleDict`` with word keys, ``blocks.first``,
   ``blocks.second``; layers kept as named attributes of one container; the whole model
   wrapped in one module), it is no layer: its children become the layers, and so on
   down while one child still holds more than half. A numeric layer is never refined
   (a depth-1 model keeps its one layer), and inside a refined module an indexed
   container still gives one layer per index.
3. *Budget.* ``block_bytes``, or by default the largest layer.
4. *Packing.* Consecutive layers are packed whole into a block while it stays within
   the budget; a layer larger than the budget is split at its leaf modules (a parameter
   larger than the budget gets a block of its own, and the slots grow to it).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Callable, Sequence

__all__ = ["Cut", "Layering", "Unit", "default_budget", "layer_key", "layering", "partition"]


@dataclass(frozen=True)
class Unit:
    """A parameter as the partition sees it: its FQN and the bytes it takes in a block."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class Cut:
    """A block: ``units[start:stop]`` of the partitioned sequence, and why it ends there."""

    start: int
    stop: int
    nbytes: int
    reason: str


def layer_key(fqn: str) -> str:
    """``blocks.3.ffn.net.0.weight`` -> ``blocks.3``; ``patch_embed.weight`` -> ``patch_embed``.

    The outermost numeric component marks a layer of a ModuleList (inner ones are
    Sequential indices inside the layer).
    """
    parts = fqn.split(".")
    for i in range(1, len(parts) - 1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def leaf_key(fqn: str) -> str:
    """The module that owns the parameter: ``blocks.3.attn.qkv.weight`` -> ``blocks.3.attn.qkv``."""
    return fqn.rsplit(".", 1)[0] if "." in fqn else fqn


@dataclass(frozen=True)
class Layering:
    """How parameter names map to layers: `layer_key`, except under ``refined`` modules.

    See [Note: blocks by footprint].
    """

    refined: tuple[tuple[str, float], ...] = ()  # (module, share of the streamed bytes)

    def key(self, fqn: str) -> str:
        parts = fqn.split(".")
        split = {name for name, _ in self.refined}
        if parts[0] not in split:
            return layer_key(fqn)
        i = 1
        while i < len(parts) and ".".join(parts[:i]) in split:
            i += 1
        if i == len(parts):  # a parameter held directly by a refined module
            return fqn
        if i + 1 < len(parts) and parts[i].isdigit():  # an indexed container: one layer per index
            return ".".join(parts[: i + 1])
        return ".".join(parts[:i])

    def describe(self) -> str:
        """One line for ``blocks.md``: which modules were refined, and why."""
        if not self.refined:
            return ""
        return "; ".join(f"`{name}` holds {share:.0%} of the streamed bytes and is not an "
                         "indexed layer: its submodules are the layers"
                         for name, share in self.refined)


def layering(units: Sequence[Unit]) -> Layering:
    """Find the modules to refine (see [Note: blocks by footprint])."""
    total = sum(u.nbytes for u in units)
    if total <= 0:
        return Layering()
    size: dict[str, int] = {}
    for u in units:
        parts = u.name.split(".")
        for i in range(1, len(parts)):  # every module that holds it (not the name itself)
            prefix = ".".join(parts[:i])
            size[prefix] = size.get(prefix, 0) + u.nbytes
    refined: list[tuple[str, float]] = []
    parent = ""
    while True:
        depth = parent.count(".") + 1 if parent else 0
        children = [m for m in size if m.count(".") == depth and
                    (not parent or m.startswith(parent + "."))]
        big = [m for m in children if 2 * size[m] > total and not _indexed(m)]
        if not big:
            break
        parent = big[0]  # at most one child can hold more than half
        inner = {m.rsplit(".", 1)[-1] for m in size if m.startswith(parent + ".")
                 and m.count(".") == parent.count(".") + 1}
        if not inner or all(part.isdigit() for part in inner):
            break  # a leaf module, or a ModuleList / Sequential: its indices are the layers
        refined.append((parent, size[parent] / total))
    return Layering(tuple(refined))


def _indexed(module: str) -> bool:
    """``blocks.3`` is an indexed layer (of a ModuleList or Sequential); ``blocks`` is not."""
    return module.rsplit(".", 1)[-1].isdigit()


def _runs(units: Sequence[tuple[int, Unit]], key: Callable[[str], str]) -> list[list[tuple[int, Unit]]]:
    return [list(g) for _, g in groupby(units, key=lambda iu: key(iu[1].name))]


def default_budget(units: Sequence[Unit], layers: Layering | None = None) -> int:
    """Bytes of the largest layer (the default block budget)."""
    layers = layering(units) if layers is None else layers
    indexed = list(enumerate(units))
    return max((sum(u.nbytes for _, u in run) for run in _runs(indexed, layers.key)), default=0)


def _b(n: int) -> str:
    return f"{n:,} B"


def partition(units: Sequence[Unit], budget: int, layers: Layering | None = None) -> list[Cut]:
    """Blocks of ``units`` (already in the order they are streamed) within ``budget`` bytes."""
    layers = layering(units) if layers is None else layers
    cuts: list[Cut] = []
    cur: list[tuple[int, Unit]] = []

    def close(reason: str) -> None:
        nonlocal cur
        if cur:
            cuts.append(Cut(cur[0][0], cur[-1][0] + 1, sum(u.nbytes for _, u in cur), reason))
            cur = []

    def pack(runs: list[list[tuple[int, Unit]]], what: str) -> None:
        """Greedy packing of whole runs, splitting a run only when it exceeds the budget."""
        size = sum(u.nbytes for _, u in cur)
        for run in runs:
            run_bytes = sum(u.nbytes for _, u in run)
            name = _label(run, what, layers)
            if run_bytes > budget:
                close(f"next {name} ({_b(run_bytes)}) is larger than the budget")
                if len(run) == 1:
                    cur.extend(run)
                    close("one parameter larger than the budget")
                else:
                    leaves = _runs(run, leaf_key)  # split at leaf modules, else per parameter
                    if len(leaves) > 1:
                        pack(leaves, "module")
                    else:
                        pack([[iu] for iu in run], "parameter")
                    close(f"end of {name}, split to fit the budget")
                size = 0
                continue
            if cur and size + run_bytes > budget:
                close(f"next {name} does not fit ({size:,} + {run_bytes:,} > {budget:,} B)")
                size = 0
            cur.extend(run)
            size += run_bytes

    pack(_runs(list(enumerate(units)), layers.key), "layer")
    close("last streamed parameter")
    return cuts


def _label(run: list[tuple[int, Unit]], what: str, layers: Layering) -> str:
    name = run[0][1].name
    if what == "layer":
        return f"layer `{layers.key(name)}`"
    if what == "module":
        return f"module `{leaf_key(name)}`"
    return f"parameter `{name}`"

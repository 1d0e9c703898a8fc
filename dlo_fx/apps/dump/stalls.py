"""Stall summary of a traced run: how long compute waited on each block, and who caused it.

A *stall* is the time a ``wait`` node blocked compute because its block was not yet in
its slot (the ``wait`` spans of `dlo_fx.runtime.device.trace.Tracer`). `stall_summary(model)`
sums them per host block over every traced call; ``str()`` of the result is a table that
ends with the few blocks that caused most of the total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from ...runtime import Span

#: `StallSummary.culprits` returns the fewest blocks that caused this share of the total.
CULPRIT_SHARE = 0.8


@dataclass(frozen=True)
class BlockStall:
    """Stalls of one block over every traced call."""

    block: int
    """Block index (host block in `stall_summary`, graph block in a dump's blocks.md)."""
    label: str
    """Its first and last parameter, ``first .. last``."""
    waits: int
    """Number of ``wait`` nodes that ran for it."""
    stall_ns: int
    """Total time those waits blocked compute, in nanoseconds."""


@dataclass(frozen=True)
class StallSummary:
    """Stalls per block, largest first."""

    total_ns: int
    waits: int
    blocks: tuple[BlockStall, ...]

    def culprits(self, share: float = CULPRIT_SHARE) -> tuple[BlockStall, ...]:
        """The fewest blocks whose stalls add up to ``share`` of the total."""
        out, acc = [], 0
        for b in self.blocks:
            if acc >= share * self.total_ns or b.stall_ns == 0:
                break
            out.append(b)
            acc += b.stall_ns
        return tuple(out)

    def lines(self, *, block_word: str = "block", top: Optional[int] = None) -> list[str]:
        """Markdown table rows (``top`` limits the rows) and the culprit sentence."""
        total = self.total_ns or 1
        rows = [f"| {block_word} | parameters | waits | stall (ms) | share |",
                "| ---: | --- | ---: | ---: | ---: |"]
        for b in self.blocks[:top]:
            rows.append(f"| {b.block} | {b.label} | {b.waits} | {b.stall_ns / 1e6:.3f} | "
                        f"{100 * b.stall_ns / total:.0f}% |")
        rows.append(f"| total | | {self.waits} | {self.total_ns / 1e6:.3f} | |")
        culprits = self.culprits()
        if culprits:
            names = ", ".join(str(b.block) for b in culprits)
            share = sum(b.stall_ns for b in culprits) / total
            rows.append("")
            rows.append(f"{len(culprits)} of {len(self.blocks)} {block_word}s ({names}) "
                        f"caused {100 * share:.0f}% of the stall time.")
        return rows

    def __str__(self) -> str:
        head = (f"dlo stalls: compute waited {self.total_ns / 1e6:.3f} ms in "
                f"{self.waits} waits on {len(self.blocks)} blocks")
        return "\n".join([head, ""] + self.lines())


def summarize(spans: Iterable[Span], label: Callable[[int], tuple[int, str]]) -> StallSummary:
    """Sum the ``wait`` spans; ``label(host block) -> (block shown, its label)``."""
    totals: dict[int, list] = {}
    waits = total = 0
    for s in spans:
        if s.kind != "wait" or s.block is None:
            continue
        block, text = label(s.block)
        entry = totals.setdefault(block, [text, 0, 0])
        entry[1] += 1
        entry[2] += s.duration_ns
        waits += 1
        total += s.duration_ns
    rows = [BlockStall(b, text, n, ns) for b, (text, n, ns) in totals.items()]
    rows.sort(key=lambda r: (-r.stall_ns, r.block))
    return StallSummary(total_ns=total, waits=waits, blocks=tuple(rows))

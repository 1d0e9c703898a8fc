"""Pass 3: decide which parameters stay on the device (resident) and which stream.

A parameter is resident when it is empty, unused, smaller than ``resident_bytes``, read
by the graph's output (a view of it escapes), or used far apart: more than one block
budget of other parameters is first used between its first and last use (a modulation
table shared by every layer, a tied embedding). Streaming it would pin a slot across
the blocks in between. Also fixes the block budget (``block_bytes`` or the largest
natural layer).

Before/after: no graph change; fills ``ctx.resident``, ``ctx.streamed``, ``ctx.budget``.
"""

from __future__ import annotations

import bisect
from itertools import accumulate

from torch import fx

from .context import ParamInfo, PassContext
from .partition_blocks import natural_layer_bytes


def _far_apart(candidates: list[ParamInfo], budget: int) -> set[int]:
    ordered = sorted(candidates, key=lambda p: p.first)
    firsts = [p.first for p in ordered]
    prefix = [0, *accumulate(p.nbytes for p in ordered)]
    far = set()
    for p in ordered:
        lo = bisect.bisect_right(firsts, p.first)
        hi = bisect.bisect_right(firsts, p.last)
        if prefix[hi] - prefix[lo] > budget:
            far.add(id(p))
    return far


def resident_set(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    threshold = ctx.config.resident_bytes
    candidates = []
    for p in ctx.params:
        if p.nbytes == 0:
            p.reason = "empty"
        elif p.first < 0:
            p.reason = "unused by this graph"
        elif p.nbytes < threshold:
            p.reason = f"smaller than resident_bytes={threshold}"
        elif p.node in ctx.escaping:
            p.reason = "returned by the graph"
        else:
            candidates.append(p)
    candidates.sort(key=lambda p: (p.first, p.last))
    ctx.budget = ctx.config.block_bytes or natural_layer_bytes(candidates)
    far = _far_apart(candidates, ctx.budget)
    for p in candidates:
        if id(p) in far:
            p.reason = "used far apart"
    ctx.streamed = [p for p in candidates if p.reason is None]
    ctx.resident = [p for p in ctx.params if p.reason is not None]
    return gm

"""Pass 3: decide which parameters stay on the device (resident) and which stream.

The decision itself lives in one function, `dlo_fx.residency.decide_residency`, shared
with `dlo_fx.load`: empty, unused, smaller than ``resident_bytes``, returned by the graph,
used far apart (a modulation table every layer reads, a tied embedding), or still read
when ``num_slots`` later blocks are live. The last check needs the blocks, so this pass
forms them (`PassContext.form_blocks`) as often as it takes; `partition_blocks` then
forms them once more from the final streamed set. Also fixes the block budget
(``block_bytes`` or the largest layer) and how FQNs map to layers.

Before/after: no graph change; fills ``ctx.resident``, ``ctx.streamed``, ``ctx.budget``,
``ctx.layers`` and each resident parameter's ``reason``.
"""

from __future__ import annotations

from torch import fx

from ..partition import Layering
from ..residency import Candidate, decide_residency
from .context import PassContext


def resident_set(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    params = ctx.params
    cands = [Candidate(p.fqn, p.nbytes, first=p.first, last=p.last,
                       escapes=p.node in ctx.escaping) for p in params]

    def blocks_of(streamed: list[int], budget: int, layers: Layering) -> list[list[int]]:
        index = {id(params[i]): i for i in streamed}
        return [[index[id(p)] for p in b.params]
                for b in ctx.form_blocks([params[i] for i in streamed], budget, layers)]

    decision = decide_residency(cands, resident_bytes=ctx.config.resident_bytes,
                                block_bytes=ctx.config.block_bytes,
                                num_slots=ctx.config.num_slots, blocks_of=blocks_of)
    for p, reason in zip(params, decision.reasons):
        p.reason = reason
    ctx.budget, ctx.layers = decision.budget, decision.layers
    ctx.streamed = [params[i] for i in decision.streamed_in_use_order(cands)]
    ctx.resident = [p for p in params if p.reason is not None]
    return gm

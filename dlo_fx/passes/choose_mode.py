"""Pass 5: settle the streaming mode before the schedule is written.

With ``mode="auto"`` the runtime measures H2D and AllGather bandwidth on the shard group
and decides through the policy model, using this plan's block sizes (see
`dlo_fx.policy.measured`). Every other mode was fixed when the runtime was made. The
choice decides whether `insert_schedule` writes ``allgather`` nodes.

Before/after: no graph change; the runtime's ``mode`` and ``mode_reason`` are set.
"""

from __future__ import annotations

from torch import fx

from .context import PassContext


def choose_mode(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.runtime is not None:
        ctx.runtime.decide_mode([b.nbytes for b in ctx.blocks])
    return gm

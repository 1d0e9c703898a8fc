"""Pass 5: settle the streaming mode before the schedule is written.

With ``mode="auto"`` this pass measures H2D and AllGather bandwidth on the shard group
and simulates both modes on this plan's blocks (see
`dlo_fx.planning.measured`), before anything is stored. Every other mode was fixed when
the runtime was made (or by the loader, which decides ``"auto"`` the same way). The
choice decides whether `insert_schedule` writes ``allgather`` nodes. The runtime never
decides it: it stores blocks and never reaches into the planning.

Before/after: no graph change; the runtime's ``mode`` and ``mode_reason`` are set.
"""

from __future__ import annotations

from torch import fx

from .context import PassContext


def choose_mode(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    runtime = ctx.runtime
    if runtime is not None and runtime.mode is None:
        from ..planning.measured import choose_mode as decide  # a collective probe on every rank

        runtime.set_mode(*decide(runtime.device, runtime.group, [b.nbytes for b in ctx.blocks],
                                 runtime.slots.num_slots))
    return gm

"""``schedule.py``: the scheduled graph's Python code, each schedule node annotated.

The code is ``gm.code`` as FX generates it, with two edits for reading: the statements
that free intermediate values early (``;  x = y = None``) are dropped, and every node
that carries ``node.meta["dlo"]`` follows a ``# dlo: ...`` comment line of its own (kind,
block, slot, bytes; the parameters it covers for ``wait``), in the words of
`dlo_fx.apps.dump.schedule_text.describe`: a prefetch of a FLUX.1-dev block names its
parameters in a statement of thousands of characters, and a comment at its end is out of
sight.
"""

from __future__ import annotations

import re

from torch import fx

from .schedule_text import describe
from .record import GraphDump

_FREE = re.compile(r";  (?:\w+ = )+None$")
_ASSIGN = re.compile(r"^\s+(\w+) = ")


def annotated_code(gm: fx.GraphModule, dump: GraphDump) -> str:
    """The text of ``schedule.py`` for ``gm``."""
    metas = {node.name: node.meta["dlo"] for node in gm.graph.nodes if "dlo" in node.meta}
    mode = dump.mode + (f", dp {dump.dp}" if dump.mode == "allgather" else "")
    lines = [
        f"# dlo schedule of graph {dump.index}: {len(dump.blocks)} blocks, "
        f"{dump.num_slots} slots, mode {mode}.",
        "# Each schedule node follows a line '# dlo: <kind> block=<graph block> slot=<slot> "
        "bytes=<block bytes>';",
        "# a wait also lists the parameters it covers. dlo_fx_runtime_graph_ops_<kind> is",
        "# dlo_fx.runtime.graph.ops.<kind>; _dlo is the graph's schedule. Statements that only free",
        "# values early ('x = None') are left out. Blocks, slots and bytes: blocks.md.",
    ]
    for line in gm.code.strip("\n").splitlines():
        line = _FREE.sub("", line.rstrip())
        match = _ASSIGN.match(line)
        if match is not None and match.group(1) in metas:
            indent = line[:len(line) - len(line.lstrip())]
            lines.append(f"{indent}# dlo: {describe(metas[match.group(1)])}")
        lines.append(line)
    return "\n".join(lines) + "\n"

"""Schedule dumps: see, time and tune what the `dlo` backend scheduled.

With ``options={"dump_dir": D}`` (or ``DLO_FX_DUMP_DIR=D``) every scheduled graph gets a
folder ``D/graph_<n>/`` (``D/rank_<r>/graph_<n>/`` with several ranks) holding

- ``schedule.py``: the graph's code, each schedule node with a ``# dlo: ...`` comment;
- ``blocks.md``: blocks, resident set and, after a traced run, stalls per block;
- ``timeline.svg``: the predicted compute / H2D / AllGather lanes, stalls in red;
- ``trace.json``: with ``trace=True``, the measured spans (Chrome trace-event format).

Spans exist only after the model ran: `flush(model)` (also run at process exit) writes
``trace.json`` and refreshes the rest. `stall_summary(model)` and
`write_trace(model, path)` cover every traced call of a model. ``dlo-fx dump`` writes the
folders without code (`dlo_fx.apps.dump.cli`). How to read and tune: docs/schedule.md.

| file | what it holds |
| --- | --- |
| writer.py | write_dump (called by the backend), flush, write_trace, stall_summary |
| record.py | GraphDump: what a dump keeps of its graph after compilation |
| schedule_code.py | schedule.py: annotated ``gm.code`` |
| blocks_md.py | blocks.md |
| measure.py | per-block times measured by a traced run |
| timeline.py | predicted timeline (simulation of the schedule nodes) |
| svg.py | timeline.svg |
| stalls.py | StallSummary |
| chrome_trace.py | trace.json |
| cli.py | ``dlo-fx dump`` |
"""

from .record import GraphDump
from .stalls import BlockStall, StallSummary
from .timeline import Assumptions
from .writer import dumps, flush, stall_summary, write_dump, write_trace

__all__ = ["Assumptions", "BlockStall", "GraphDump", "StallSummary", "dumps", "flush",
           "stall_summary", "write_dump", "write_trace"]

"""The runtime as a compiled graph sees it.

`ops` holds the schedule nodes' targets and `GraphSchedule`; `graph_call` runs one graph at
a time per runtime, behind the collective clock; `forward_log` notes the collective steps
of a forward (for gather-only replays); `trace` is the `Tracer` of measured spans per block
and lane.
"""

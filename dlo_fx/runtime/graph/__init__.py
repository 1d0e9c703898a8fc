"""The runtime as a compiled graph sees it.

`ops` holds the schedule nodes' targets and `GraphSchedule`; `graph_call` runs one graph at
a time per runtime, behind the collective clock, and replays a graph's schedule alone
(gather-only forwards, noted in ranks/forward_log.py). The top subpackage: it imports the
`Runtime` and the `SlotMachine` it drives.
"""

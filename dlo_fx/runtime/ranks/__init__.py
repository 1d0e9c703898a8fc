"""What the ranks of a shard group say to each other.

`collectives` resolves the shard group (made once and kept) and wraps its in-place
AllGather and JSON exchanges; `agreement` is the one agreement before the first gather
(settings, layouts, fingerprints); `clock` is the collective clock, the words the ranks
exchange before each collective step; `forward_log` notes the collective steps of a forward
(for gather-only replays).
"""

"""Device side of the runtime: the slots weights stream into, and the machine under them.

`SlotPool` holds the device buffers, `SharedSlots` what the models on one device share,
`SlotMachine` the slot state machine the schedule nodes drive, and `executor` the copy
worker (CPU) or streams and events (accelerator). `platform` is the only module that names
accelerators; `procfs` reads memory figures from /proc and cgroups; `probes` measures
bandwidths and the matmul rate (agreed over the shard group).
"""

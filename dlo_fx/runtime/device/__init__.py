"""Device side of the runtime: the slots weights stream into, and the machine under them.

`SlotPool` holds the device buffers, `SharedSlots` what the models on one device share,
and `executor` the copy worker (CPU) or streams and events (accelerator); `trace` is the
`Tracer` of their measured spans per block and lane. `platform` is the only module that
names accelerators; `procfs` reads memory figures from /proc and cgroups. The lowest
subpackage: it imports no other (see the Layout in docs/architecture.md).
"""

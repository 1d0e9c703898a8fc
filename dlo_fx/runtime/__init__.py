"""Runtime: host store, slots, executors and the schedule nodes' targets.

`runtime.py` (the `Runtime` class) composes the subpackages: `device/` (the slots and the
machine under them), `host/` (where the weights live off the device), `ranks/` (what the
ranks of a shard group say to each other), `weights/` (the parameters whose weights it
holds) and `graph/` (the runtime as a compiled graph sees it). `slot_machine.py` is the slot
state machine the schedule nodes drive, `probes.py` what a run measures of its machine for
planning, `view.py` the frozen `StoreView` the planning takes, `store_view.py` its builder,
`lifecycle.py` whether a runtime may run (its process, its lock, failed or released), and
`interrupts.py` defers Ctrl-C.

The subpackages are layered, bottom up: device/, host/, ranks/, weights/, graph/. A module
of one imports none of a subpackage above it; the modules beside runtime.py sit between
weights/ and graph/, except `view.py`, `lifecycle.py` and `interrupts.py`, which import
nothing of the runtime and sit below device/ (tests/test_ownership.py checks the order).

The runtime never imports the passes.
"""

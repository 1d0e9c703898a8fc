"""Runtime: host store, slots, executors and the schedule nodes' targets.

`runtime.py` (the `Runtime` class) composes the subpackages: `host/` (where the weights live
off the device), `device/` (the slots and the machine under them), `ranks/` (what the ranks
of a shard group say to each other), `graph/` (the runtime as a compiled graph sees it) and
`weights/` (the parameters whose weights it holds). `view.py` is the frozen `StoreView` the
planning takes, `store_view.py` builds it, `lifecycle.py` is whether a runtime may run
(its process, its lock, failed or released), `interrupts.py` defers Ctrl-C.

The runtime never imports the passes.
"""

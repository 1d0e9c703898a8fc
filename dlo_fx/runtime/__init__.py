"""Runtime: host store, slots, executors and the schedule nodes' targets.

The runtime never imports the passes.
"""

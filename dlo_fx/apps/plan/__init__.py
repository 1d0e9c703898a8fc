"""`dlo_fx.plan`: a model planned for hardware one does not have, from its config, in
seconds: its blocks, slots, host and device bytes, resident blocks and predicted step time
on a hardware preset or declared figures (`planner`, [Note: a plan is the run's own
decisions on the target's numbers]); the meta forward it counts FLOPs and activations on
(`forward`); the presets (`hardware`); the table and the dump (`report`); the ``dlo-fx
plan --model`` command (`cli`)."""

from .hardware import HARDWARE, Hardware, cpu_copies_overlap, hardware_of
from .planner import Plan, plan

__all__ = ["HARDWARE", "Hardware", "Plan", "cpu_copies_overlap", "hardware_of", "plan"]

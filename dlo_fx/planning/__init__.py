"""Planning: blocks, residency, the schedule simulator, the device budget, FLOPs and the mode
choice; arithmetic on sizes and rates. Imports no application and no sympy."""

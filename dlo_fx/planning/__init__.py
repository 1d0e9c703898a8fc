"""Planning: blocks, residency, the device budget, FLOPs and the mode choice; arithmetic on sizes and rates."""

"""Planning: the decisions. Blocks, residency, the schedule simulator, the device budget,
FLOPs and the mode choice (arithmetic on sizes and rates); the mode and the budget settled
for the loader and the compiler alike (`settle`); a graph's planning stages (`stages`).
Planning never holds a runtime: it reads the runtime's frozen `StoreView` (`view.py`, the
type the runtime builds), and imports nothing of `dlo_fx.runtime`. Imports no application
and no sympy."""

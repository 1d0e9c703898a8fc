"""Planning: the decisions. Blocks, residency, the schedule simulator, the device budget,
FLOPs and the mode choice (arithmetic on sizes and rates); the mode and the budget settled
for the loader and the compiler alike (`settle`); a graph's planning stages (`stages`).
Planning never holds a runtime: it reads the runtime's frozen `StoreView`
(dlo_fx/runtime/view.py), the one module of `dlo_fx.runtime` it imports. Imports no
application and no sympy."""

"""How a block reaches the device: the mode choice, and the planning study behind it.

| module | what it holds |
| --- | --- |
| constants.py | every figure the models use that is not a user input, each with its source: the study's, and the bandwidths the dump's timeline assumes |
| measured.py | what ``mode="auto"`` and `memory_report` run: probe the bandwidths on the real group, choose the mode, predict the weight bytes |
| study/ | the capacity-planning study: symbolic model, presets, calibration against published figures, docs/memory-model.md, ``dlo-fx plan`` |

Only `measured` is reached from a run, and only when ``mode="auto"`` or `memory_report`
asks; it loads the study (and sympy) on first use.
"""

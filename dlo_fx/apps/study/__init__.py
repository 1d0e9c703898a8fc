"""The capacity-planning study behind ``dlo-fx plan``: both streaming modes, symbolically.

`predict` evaluates a symbolic (sympy) model of both modes for one `PlanInputs`;
`recommend` picks ``"allgather"`` or ``"rank_local"`` and names the term that decides;
`formulas` prints every modelled quantity. Named constant sets are in `presets`, the
comparison with published figures in `calibration`, docs/memory-model.md is rendered by
`markdown`, and the ``plan`` command is in `cli`. The constants and their sources are in
`dlo_fx.apps.figures`, shared with the dump's timeline. The library never imports
it: ``mode="auto"`` simulates the schedule (`dlo_fx.planning.modes`) instead.
"""

from .calibration import (
    extrapolation_report,
    fit_staging_fraction,
    load_peak_report,
    minimax_inputs,
    wave_report,
)
from ..figures import CONSTANTS, Constant
from .inputs import PlanInputs
from .model import DEFINITIONS, Definition, evaluate, expression, formulas
from .prediction import ModePrediction, Prediction, fits, predict, recommend
from .presets import PRESETS, Preset, preset, preset_fields
from .symbols import SYMBOLS

__all__ = [
    "CONSTANTS",
    "Constant",
    "DEFINITIONS",
    "Definition",
    "ModePrediction",
    "PRESETS",
    "PlanInputs",
    "Prediction",
    "Preset",
    "SYMBOLS",
    "evaluate",
    "expression",
    "extrapolation_report",
    "fit_staging_fraction",
    "fits",
    "formulas",
    "load_peak_report",
    "minimax_inputs",
    "predict",
    "preset",
    "preset_fields",
    "recommend",
    "render_markdown",
    "wave_report",
]


def __getattr__(name: str):
    # Imported on first use so that ``python -m dlo_fx.apps.study.markdown`` runs cleanly.
    if name == "render_markdown":
        from .markdown import render_markdown

        return render_markdown
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

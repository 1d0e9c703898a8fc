"""The model against the published figures: fits, residuals and extrapolation.

* `fit_staging_fraction` re-derives ``figures.CONSTANTS["staging_fraction"]``.
* `load_peak_report` compares the cgroup-visible load peak with the three published
  Ascend measurements.
* `extrapolation_report` puts the model beside the DLO write-up's memory-scaling table.
* `wave_report` compares the model's MiniMax-H3 wave times on 8x B300 with the study.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..figures import PUBLISHED_EXTRAPOLATION, PUBLISHED_LOAD_PEAKS, PUBLISHED_WAVES, PublishedLoadPeak
from .inputs import PlanInputs
from .prediction import predict
from .presets import preset_fields

EXTRAPOLATION_PAIRS: tuple[tuple[float, int], ...] = tuple((r.model_gb, r.dp) for r in PUBLISHED_EXTRAPOLATION)
"""(model GB, dp) rows of the published memory-scaling table."""

MINIMAX_TOPOLOGIES: tuple[tuple[int, int], ...] = ((1, 8), (4, 2), (8, 1))
"""(dp, sp) routes of the MiniMax-H3 study on 8x B300."""

_MODEL_PRESETS = {33.0: "cosmos3-nano", 124.0: "cosmos3-super"}


@dataclass(frozen=True)
class LoadPeakRow:
    """Published vs predicted cgroup-visible load peak."""

    label: str
    model_gb: float
    dp: int
    published_gb: float
    predicted_gb: float
    physical_gb: float

    @property
    def relative_error(self) -> float:
        """(predicted - published) / published."""
        return (self.predicted_gb - self.published_gb) / self.published_gb


@dataclass(frozen=True)
class ExtrapolationRow:
    """One memory-scaling row: published estimate and model prediction (AllGather)."""

    model_gb: float
    dp: int
    published_cgroup_gb: float
    published_total_gb: float
    cgroup_gb: float
    physical_gb: float
    fits_2tb: bool


@dataclass(frozen=True)
class WaveRow:
    """Published vs predicted MiniMax-H3 wave time for one route and mode."""

    dp: int
    sp: int
    mode: str
    published_s: float
    predicted_s: float
    derivation: str

    @property
    def relative_error(self) -> float:
        """(predicted - published) / published."""
        return (self.predicted_s - self.published_s) / self.published_s


def ascend_inputs(model_gb: float, dp: int, **changes: object) -> PlanInputs:
    """AllGather inputs on the Ascend 910B3 node for a pure-DP run of ``model_gb``."""
    fields: dict = preset_fields(["ascend-910b3"])
    name = _MODEL_PRESETS.get(float(model_gb))
    if name:
        fields.update(preset_fields([name]))
    else:
        fields.update(model_gb=float(model_gb), blocks=128)
    fields.update(dp=dp, sp=1)
    fields.update(changes)
    return PlanInputs(**fields)


def _load_row(peak: PublishedLoadPeak, staging_fraction: Optional[float]) -> LoadPeakRow:
    changes = {} if staging_fraction is None else {"staging_fraction": staging_fraction}
    ag = predict(ascend_inputs(peak.model_gb, peak.dp, **changes)).allgather
    return LoadPeakRow(
        peak.label, peak.model_gb, peak.dp, peak.cgroup_gb, ag.cgroup_load_peak_gb, ag.host_physical_peak_gb
    )


def load_peak_report(staging_fraction: Optional[float] = None) -> tuple[LoadPeakRow, ...]:
    """The model's cgroup-visible load peak beside each published measurement."""
    return tuple(_load_row(p, staging_fraction) for p in PUBLISHED_LOAD_PEAKS)


def _worst(staging_fraction: float) -> float:
    return max(abs(r.relative_error) for r in load_peak_report(staging_fraction))


def fit_staging_fraction(tolerance: float = 1e-6) -> float:
    """The staging fraction minimising the largest relative load-peak error.

    The other load constants (page-cache fraction, per-rank overhead) come straight from
    published figures; the largest error is convex in this one, so a ternary search
    over [0, 1] finds it.
    """
    lo, hi = 0.0, 1.0
    while hi - lo > tolerance:
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if _worst(a) <= _worst(b):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


def extrapolation_report(
    pairs: Sequence[tuple[float, int]] = EXTRAPOLATION_PAIRS,
) -> tuple[ExtrapolationRow, ...]:
    """The model's AllGather host figures for (model GB, dp) pairs on the Ascend node,
    beside the published estimate where the write-up has one (NaN otherwise)."""
    published = {(r.model_gb, r.dp): r for r in PUBLISHED_EXTRAPOLATION}
    rows = []
    for model_gb, dp in pairs:
        ag = predict(ascend_inputs(model_gb, dp)).allgather
        ref = published.get((float(model_gb), int(dp)))
        rows.append(
            ExtrapolationRow(
                float(model_gb), int(dp),
                ref.cgroup_gb if ref else float("nan"),
                ref.total_gb if ref else float("nan"),
                ag.cgroup_load_peak_gb, ag.host_physical_peak_gb, ag.host_physical_peak_gb <= 2048.0,
            )
        )
    return tuple(rows)


def minimax_inputs(dp: int, sp: int, **changes: object) -> PlanInputs:
    """MiniMax-H3 T2VA on the 8x B300 node at ``dp x sp``."""
    fields: dict = preset_fields(["b300-8gpu", "minimax-h3"])
    fields.update(dp=dp, sp=sp)
    fields.update(changes)
    return PlanInputs(**fields)


def wave_report() -> tuple[WaveRow, ...]:
    """Predicted vs published MiniMax-H3 wave times (the model counts only the DiT
    blocks; text encoding and decoding are in the published figures)."""
    rows = []
    for w in PUBLISHED_WAVES:
        pred = predict(minimax_inputs(w.dp, w.sp)).for_mode(w.mode)
        rows.append(WaveRow(w.dp, w.sp, w.mode, w.wave_s, pred.request_time_s, w.derivation))
    return tuple(rows)

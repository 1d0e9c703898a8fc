"""Tests of the planning model (`dlo_fx.apps.study`): fits, identities, recommendations, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlo_fx.apps.study import (
    CONSTANTS,
    PRESETS,
    PlanInputs,
    expression,
    extrapolation_report,
    fit_staging_fraction,
    formulas,
    load_peak_report,
    minimax_inputs,
    predict,
    recommend,
    wave_report,
)
from dlo_fx.apps.study import cli
from dlo_fx.apps.study.calibration import EXTRAPOLATION_PAIRS, ascend_inputs
from dlo_fx.apps.study.markdown import DOC_PATH, render_markdown
from dlo_fx.apps.study.symbols import INPUT_SYMBOLS

REPO = Path(__file__).resolve().parents[1]


# --- fitted load peaks ---------------------------------------------------------------


def test_cgroup_load_peaks_within_15_percent_of_published():
    rows = load_peak_report()
    assert [r.label for r in rows] == ["Cosmos3-Nano DP2", "Cosmos3-Nano DP4", "Cosmos3-Super DP4"]
    for r in rows:
        assert abs(r.relative_error) < 0.15, r


def test_stored_staging_fraction_is_the_fit():
    assert fit_staging_fraction() == pytest.approx(CONSTANTS["staging_fraction"].value, abs=1e-3)


def test_every_constant_has_a_source_and_kind():
    for name, c in CONSTANTS.items():
        assert c.source.strip(), name
        assert c.kind in {"measured", "derived", "fitted", "spec", "assumed"}, name
    for p in PRESETS.values():
        for field, v in p.values.items():
            assert v.source.strip(), (p.name, field)


# --- memory identities -----------------------------------------------------------------


@pytest.mark.parametrize("psi", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dp,sp", [(1, 1), (2, 1), (4, 2), (8, 1)])
def test_physical_is_cgroup_plus_pinned_it_misses(psi, dp, sp):
    pred = predict(PlanInputs(model_gb=124.0, blocks=128, dp=dp, sp=sp, pinned_cgroup_fraction=psi))
    for m in (pred.allgather, pred.rank_local):
        assert m.host_physical_peak_gb == pytest.approx(m.cgroup_load_peak_gb + (1 - psi) * m.pinned_total_gb)
        assert m.pinned_total_gb == pytest.approx(m.pinned_per_rank_gb * dp * sp)


def test_ascend_physical_is_cgroup_plus_pinned_shards():
    ag = predict(ascend_inputs(124.0, 4)).allgather
    assert ag.pinned_per_rank_gb == pytest.approx(31.0)
    assert ag.host_physical_peak_gb == pytest.approx(ag.cgroup_load_peak_gb + 124.0)


def test_rank_local_holds_world_copies_allgather_one_per_group():
    pred = predict(PlanInputs(model_gb=66.3, blocks=50, dp=4, sp=2))
    assert pred.rank_local.pinned_total_gb == pytest.approx(8 * 66.3)
    assert pred.allgather.pinned_total_gb == pytest.approx(2 * 66.3)  # DP group of 4, two SP ranks
    world = predict(PlanInputs(model_gb=66.3, blocks=50, dp=4, sp=2, gather_over="world"))
    assert world.allgather.pinned_total_gb == pytest.approx(66.3)


def test_extrapolation_rows_cover_published_table():
    rows = extrapolation_report()
    assert [(r.model_gb, r.dp) for r in rows] == list(EXTRAPOLATION_PAIRS)
    for r in rows:
        assert r.physical_gb == pytest.approx(r.cgroup_gb + r.model_gb)
        assert r.fits_2tb


# --- B300 / MiniMax-H3 recommendations ------------------------------------------------


@pytest.mark.parametrize(
    "dp,sp,mode,term",
    [(1, 8, "allgather", "H2D"), (4, 2, "allgather", "H2D"), (8, 1, "rank_local", "lockstep")],
)
def test_minimax_b300_recommendations(dp, sp, mode, term):
    got, reason = recommend(minimax_inputs(dp, sp))
    assert got == mode
    assert reason.startswith(f"step time: {term} term dominates")


def test_recommendation_follows_the_terms_not_the_topology():
    # Without lockstep cost, the gather no longer loses at DP8xSP1.
    assert recommend(minimax_inputs(8, 1, lockstep_fraction=0.0))[0] == "allgather"
    # With H2D hidden perfectly and host bandwidth unconstrained, rank_local wins DP4xSP2.
    assert recommend(minimax_inputs(4, 2, overlap_efficiency=1.0, host_h2d_gbps=8 * 64.0))[0] == "rank_local"


def test_minimax_wave_times_match_published():
    for r in wave_report():
        assert abs(r.relative_error) < 0.02, r


def test_device_peak_decides_when_allgather_does_not_fit():
    # gather input buffers as the reference implementation kept them (dlo-fx: in place)
    inputs = PlanInputs(model_gb=100.0, blocks=10, dp=2, activation_gb=0.0, hbm_gb=25.0,
                        gather_buffers=2)
    pred = predict(inputs)
    assert pred.rank_local.device_peak_gb == pytest.approx(20.0)
    assert pred.allgather.device_peak_gb == pytest.approx(30.0)
    assert pred.mode == "rank_local"
    assert pred.reason.startswith("device peak: allgather needs 30.0 GB > HBM 25.0 GB")


def test_host_memory_decides_when_rank_local_does_not_fit():
    pred = predict(ascend_inputs(400.0, 8))
    assert not pred.rank_local.fits_host and pred.allgather.fits
    assert pred.mode == "allgather"
    assert pred.reason.startswith("host memory: rank_local needs")


def test_neither_fits():
    pred = predict(PlanInputs(model_gb=400.0, blocks=10, dp=8, hbm_gb=10.0))
    assert pred.mode == "none"
    assert "device peak" in pred.reason


# --- formulas and the document ---------------------------------------------------------


def test_formulas_print_in_every_style():
    plain = formulas()
    for key in ("allgather.cgroup_load_peak", "rank_local.device_peak", "allgather.step_time",
                "rank_local.step_time", "allgather.pinned_per_rank", "allgather.host_physical_peak"):
        assert " = " in plain[key]
    assert set(formulas("latex")) == set(plain) == set(formulas("pretty"))
    with pytest.raises(ValueError, match="style"):
        formulas("html")


def test_expanded_expressions_use_only_inputs():
    inputs = set(INPUT_SYMBOLS.values())
    expanded = expression("allgather.host_physical_peak", expand=True)
    assert expanded.free_symbols <= inputs
    assert expression("rank_local.step_time", expand=True).free_symbols <= inputs


def test_committed_doc_matches_the_model():
    doc = (REPO / DOC_PATH).read_text(encoding="utf-8")
    for text in formulas().values():
        assert text in doc
    assert doc == render_markdown(), "docs/memory-model.md is stale: python -m dlo_fx.apps.study.markdown --write docs/memory-model.md"


# --- CLI --------------------------------------------------------------------------------


def test_cli_json_has_both_modes(capsys):
    rc = cli.main(["--model-gb", "124", "--blocks", "128", "--dp", "4", "--sp", "1",
                   "--host-ram-gb", "2048", "--hbm-gb", "64", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    for mode in ("allgather", "rank_local"):
        assert {"cgroup_load_peak_gb", "host_physical_peak_gb", "pinned_per_rank_gb",
                "device_peak_gb", "step_time_ms", "fits"} <= set(data[mode])
    assert data["allgather"]["pinned_per_rank_gb"] == pytest.approx(31.0)
    assert data["mode"] in ("allgather", "rank_local") and data["reason"]


def test_cli_text_with_presets(capsys):
    assert cli.main(["--preset", "b300-8gpu,minimax-h3", "--dp", "8"]) == 0
    out = capsys.readouterr().out
    assert "recommended: rank_local" in out
    assert "reason: step time: lockstep term" in out
    assert "fits HBM (288 GB)" in out


def test_cli_table_rows(capsys):
    args = ["--table", "--table-sizes", "33,124,185,400", "--table-dp", "4,8", "--json"]
    assert cli.main(args) == 0
    rows = json.loads(capsys.readouterr().out)["table"]
    assert [(r["model_gb"], r["dp"]) for r in rows] == [(s, d) for s in (33, 124, 185, 400) for d in (4, 8)]
    assert rows[0]["published_cgroup_gb"] == 47.0 and rows[1]["published_cgroup_gb"] is None
    assert cli.main(args[:-1]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 8 + 1  # header, rows, footnote


def test_cli_bad_input_exit_2_names_the_argument(capsys):
    assert cli.main(["--model-gb", "10", "--blocks", "10", "--h2d-gbps", "0"]) == 2
    assert "h2d_gbps" in capsys.readouterr().err
    assert cli.main(["--preset", "b300-8gpu,minimax-h3", "--dp", "3"]) == 2
    assert "dp=3 does not divide world=8" in capsys.readouterr().err
    assert cli.main(["--blocks", "10"]) == 2
    assert "model_gb is required" in capsys.readouterr().err
    assert cli.main(["--preset", "nope", "--model-gb", "1", "--blocks", "1"]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert cli.main(["--table", "--table-sizes", "33,x"]) == 2
    assert "--table-sizes" in capsys.readouterr().err


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,name",
    [
        ({"model_gb": -1.0}, "model_gb"),
        ({"activation_gb": -2.0}, "activation_gb"),
        ({"resident_gb": -0.5}, "resident_gb"),
        ({"blocks": 0}, "blocks"),
        ({"max_block_gb": 0.5}, "max_block_gb"),
        ({"dp": 3, "world": 8}, "dp=3 does not divide world=8"),
        ({"dp": 2, "sp": 2, "world": 8}, "sp=2 does not match"),
        ({"h2d_gbps": 0.0}, "h2d_gbps"),
        ({"gather_gbps": 0.0}, "gather_gbps"),
        ({"host_h2d_gbps": 0.0}, "host_h2d_gbps"),
        ({"page_cache_fraction": 1.5}, "page_cache_fraction"),
        ({"block_compute_ms": -1.0}, "block_compute_ms"),
        ({"gather_over": "node"}, "gather_over"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(changes, name):
    fields = {"model_gb": 124.0, "blocks": 128}
    fields.update(changes)
    with pytest.raises(ValueError, match=name.replace("(", r"\(")):
        PlanInputs(**fields)


def test_single_rank_tie_goes_to_the_smaller_device_peak():
    pred = predict(PlanInputs(model_gb=33.0, blocks=72, dp=1, sp=1, gather_buffers=2))
    assert pred.allgather.host_physical_peak_gb == pytest.approx(pred.rank_local.host_physical_peak_gb)
    assert pred.mode == "rank_local"
    assert "device peak decides" in pred.reason


def test_default_activations_fit_the_device_given(capsys):
    """A 16 GB card with a 12 GB model in 40 blocks: the default activation memory is a
    share of the device's, so a mode fits (20 GB of activations would fit neither)."""
    assert cli.main(["--model-gb", "12", "--blocks", "40", "--hbm-gb", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["allgather"]["fits"] and data["allgather"]["device_peak_gb"] < 16
    assert PlanInputs(model_gb=12, blocks=40).activation_gb == 20.0  # 64 GB default device
    assert PlanInputs(model_gb=12, blocks=40, hbm_gb=16).activation_gb == 5.0
    assert PlanInputs(model_gb=12, blocks=40, hbm_gb=16, activation_gb=1.0).activation_gb == 1.0

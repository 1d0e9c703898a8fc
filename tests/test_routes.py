"""The gather group choice (`dlo_fx.planning.routes`): the cost model's terms, the
design's B300 ordering, agreement with the planning study's block times, and ``dlo-fx
plan``'s route table."""

from __future__ import annotations

import json

import pytest

from dlo_fx.apps.study import cli, predict
from dlo_fx.apps.study.calibration import minimax_inputs
from dlo_fx.apps.study.prediction import route_inputs
from dlo_fx.planning.routes import (
    RouteInputs,
    all_to_all_bytes,
    allgather_bytes,
    choose_route,
    host_bytes_per_rank,
    route_costs,
)


def test_the_terms_are_the_bytes_each_rank_moves():
    # Ulysses: q, k, v and the output, (sp - 1)/sp of each rank's tokens/sp leaving it.
    assert all_to_all_bytes(tokens=1024, heads=8, head_dim=64, dtype_bytes=2, sp=4) == \
        4 * 256 * 8 * 64 * 2 * 3 / 4
    assert all_to_all_bytes(1024, 8, 64, 2, sp=1) == 0.0
    assert allgather_bytes(800, 4) == 600 and allgather_bytes(800, 1) == 0
    assert host_bytes_per_rank(10, 4) == 3 and host_bytes_per_rank(10, 1) == 10


@pytest.mark.parametrize("dp, sp, route", [(1, 8, "sp"), (4, 2, "sp"), (8, 1, "none")])
def test_b300_reproduces_the_design_ordering(dp, sp, route):
    """DP1xSP8 and DP4xSP2 gather (over the replica's SP ranks: nothing couples the
    replicas); DP8xSP1 runs rank-local (a gather over 8 replicas waits for the slowest)."""
    inputs = route_inputs(minimax_inputs(dp, sp))
    assert inputs.all_to_all_bytes > 0 or sp == 1
    chosen, why = choose_route(inputs)
    assert chosen == route, why
    assert f"[dp={dp} x sp={sp}" in why


def test_without_an_all_to_all_the_routes_are_the_study_block_times():
    """The two modes of the study are two of the routes: allgather over its gather group,
    rank_local as ``"none"``; the same inputs give the same block time."""
    for dp, sp in ((1, 8), (4, 2), (8, 1), (2, 4)):
        for over, route in (("dp", "dp" if dp > 1 else "sp"), ("world", "world")):
            plan = minimax_inputs(dp, sp, gather_over=over, tokens=0)
            pred = predict(plan)
            costs = route_costs(route_inputs(plan))
            name = route if route in costs else ("dp" if sp == 1 else "sp")
            assert costs[name].block_s * 1e3 == pytest.approx(pred.allgather.block_time_ms)
            assert costs["none"].block_s * 1e3 == pytest.approx(pred.rank_local.block_time_ms)


def test_the_all_to_all_counts_where_it_makes_the_links_the_bound():
    base = dict(dp=1, sp=8, model_bytes=8e9, block_bytes=1e9, blocks=8,
                block_compute_s=0.016, h2d_Bps=50e9, link_Bps=500e9, host_ram_bytes=1e12,
                sp_serial_fraction=0.0, overlap_efficiency=1.0)
    quiet = route_costs(RouteInputs(**base))["sp"]
    busy = route_costs(RouteInputs(**base, all_to_all_bytes=0.5e9))["sp"]
    assert quiet.bound == "H2D" and quiet.block_s == pytest.approx(1e9 / 8 / 50e9)
    # 0.875 GB gathered + 0.5 GB of all-to-all on 500 GB/s links: 2.75 ms per block,
    # longer than the 2.5 ms copy that bound it without the all-to-all.
    assert busy.bound == "links" and busy.block_s == pytest.approx(0.00275)


def test_host_memory_drops_a_route_and_says_so():
    inputs = RouteInputs(dp=8, sp=1, model_bytes=400e9, block_bytes=4e9, blocks=100,
                         block_compute_s=0.05, h2d_Bps=50e9, link_Bps=500e9,
                         host_ram_bytes=1000e9)
    chosen, why = choose_route(inputs)
    assert chosen == "dp" and "none needs 3200.0 GB of host shards" in why
    tiny = RouteInputs(**{**inputs.__dict__, "host_ram_bytes": 1e9})
    chosen, why = choose_route(tiny)
    assert chosen == "dp" and why.startswith("no route fits the host")
    with pytest.raises(ValueError, match="RouteInputs.sp=0"):
        RouteInputs(**{**inputs.__dict__, "sp": 0})


def test_equal_groups_are_listed_once():
    common = dict(model_bytes=1e9, block_bytes=1e8, blocks=10, block_compute_s=0.01,
                  h2d_Bps=1e10, link_Bps=1e11, host_ram_bytes=1e12)
    assert list(route_costs(RouteInputs(dp=1, sp=4, **common))) == ["sp", "none"]
    assert list(route_costs(RouteInputs(dp=4, sp=1, **common))) == ["dp", "none"]
    assert list(route_costs(RouteInputs(dp=2, sp=2, **common))) == ["sp", "world", "none"]
    assert list(route_costs(RouteInputs(dp=2, sp=4, **common))) == ["sp", "dp", "world", "none"]


def test_plan_prints_the_gather_group_and_why(capsys):
    assert cli.main(["--preset", "b300-8gpu,minimax-h3", "--dp", "4"]) == 0
    text = capsys.readouterr().out
    assert "gather group (dp=4 x sp=2)" in text and "gather over: sp" in text
    assert cli.main(["--preset", "b300-8gpu,minimax-h3", "--dp", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gather"] == "none" and set(data["routes"]) == {"dp", "none"}
    assert data["routes"]["dp"]["lockstep_s"] > 0
    assert cli.main(["--preset", "b300-8gpu,minimax-h3", "--heads", "-1"]) == 2
    assert "heads must be a whole number >= 0" in capsys.readouterr().err


def test_the_engine_takes_the_planned_gather_group():
    """``Engine(gather="auto", plan=...)`` runs the route the planner chooses on the
    presets' figures; without ``plan`` the host-memory rule stays (no worker starts)."""
    from dlo_fx.apps.engine import Engine
    from dlo_fx.apps.engine.cli import add_generate_arguments

    factory = "dlo_fx.apps.engine.reference_pipeline:build"
    plan = "b300-8gpu,minimax-h3"
    chosen = {(dp, sp): Engine(factory, dp, sp_size=sp, plan=plan)
              for dp, sp in ((1, 8), (4, 2), (8, 1))}
    assert {k: e.spec.gather for k, e in chosen.items()} == \
        {(1, 8): "sp", (4, 2): "sp", (8, 1): "none"}
    assert "dp loses on the lock-step of its replicas" in chosen[8, 1].gather_reason
    fallback = Engine(factory, 8)
    assert fallback.spec.gather == "dp" and "host-memory rule" in fallback.gather_reason
    # plan chooses for gather="auto" only: given beside a named group it is refused, not dropped
    with pytest.raises(ValueError, match="gather='world' names it; pass one of them"):
        Engine(factory, 8, gather="world", plan=plan)
    from dlo_fx.apps.engine.engine import planned_gather
    from dlo_fx.apps.engine.topology import Topology

    with pytest.raises(ValueError, match="prices the dp and sp routes only"):
        planned_gather(Topology(1, 1, 2), plan)
    with pytest.raises(ValueError, match="unknown preset 'b301'"):
        Engine(factory, 8, plan="b301")
    with pytest.raises(ValueError, match="plan='b300-8gpu' gives no model_gb or blocks"):
        Engine(factory, 8, plan="b300-8gpu")
    import argparse

    parser = add_generate_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--requests", "r", "--out", "o", "--plan", plan])
    assert args.plan == plan and args.gather == "auto"

"""The engine's sequence-parallel replicas on a tiny saved Flux pipeline (gloo): each
replica's ranks split every request's sequence with diffusers' context parallelism
(Ulysses), and the weights are gathered over the group the topology (or ``gather=``)
chooses. Every output equals the same pipeline resident with the same context
parallelism, computed on 2 ranks by a spawned job; each rank holds 1/(group size) of the
transformer's blocks. A transformer that cannot split its sequence is refused before any
worker starts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile

import pytest
import torch

import diffusers_pipelines as dp
from distributed import in_child, spawn
from dlo_fx.apps.engine import Engine, Request, Topology
from dlo_fx.apps.engine.cli import add_generate_arguments
from dlo_fx.apps.engine.factories import DIFFUSERS

COMMON = dict(height=16, width=16, num_inference_steps=2, negative_prompt="blurry",
              true_cfg_scale=2.0, extra_args={"max_sequence_length": 16})
REQUESTS = [Request(prompt="a red cat over the tree", seed=1, **COMMON),
            Request(prompt="a blue dog", seed=2, **COMMON)]


def _save(folder: str, kind: str = "flux") -> None:
    dp.BUILDERS[kind]().save_pretrained(folder)


@pytest.fixture(scope="module")
def flux_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp") / "flux"
    spawn(1, in_child, _save, str(root))
    return root


def resident_case(rank: int, world: int, folder: str, requests: list) -> dict:
    """The pipeline in ``folder`` resident with context parallelism over these 2 ranks
    (the worker context and helper the engine's factory uses), then without; and the
    host bytes of its transformer loaded rank-local."""
    import dlo_fx
    from diffusers import FluxTransformer2DModel

    from dlo_fx.apps.engine.context_parallel import enable_context_parallel
    from dlo_fx.apps.engine.diffusers_pipeline import resident
    from dlo_fx.apps.engine.topology import WorkerContext, set_worker_context

    context = WorkerContext(rank=rank, topology=Topology(1, world), device="cpu")
    set_worker_context(context)
    try:
        pipe = resident(folder)
        enable_context_parallel(pipe.pipe.transformer, context.sp_mesh)
        parallel = [pipe(r)["images"] for r in requests]
    finally:
        set_worker_context(None)
    plain = [resident(folder)(r)["images"] for r in requests]
    local = dlo_fx.load(FluxTransformer2DModel, folder, subfolder="transformer",
                        options={"shard_group": [rank]})
    return {"parallel": parallel, "plain": plain,
            "whole": dlo_fx.memory_report(local).host_shard_bytes}


def _references() -> dict:
    """The spawned job: `resident_case` on 2 ranks, on a pipeline saved for it."""
    with tempfile.TemporaryDirectory() as folder:
        spawn(1, in_child, _save, folder)
        return spawn(2, resident_case, folder, REQUESTS, timeout=400)


# -- before any worker -------------------------------------------------------------------
def test_the_gather_group_follows_the_topology():
    topo = Topology(dp_size=2, sp_size=2)  # replicas (0, 1) and (2, 3)
    assert [topo.gather_group(1, g) for g in ("sp", "dp", "world", "none")] == \
        [(0, 1), (1, 3), (0, 1, 2, 3), (1,)]
    routes = {(dp_size, sp_size): Topology(dp_size, sp_size).choose_gather()
              for dp_size, sp_size in ((1, 1), (4, 1), (1, 4), (2, 2))}
    assert routes == {(1, 1): "dp", (4, 1): "dp", (1, 4): "sp", (2, 2): "sp"}
    assert topo.choose_gather(sp_share_fits=False) == "world"
    assert Topology(1, 4).choose_gather(sp_share_fits=False) == "sp"  # nothing smaller
    assert topo.choose_gather("dp", sp_share_fits=False) == "dp"
    parser = add_generate_arguments(argparse.ArgumentParser())
    common = ["--requests", "r.jsonl", "--out", "out"]
    assert parser.parse_args(common).gather == "auto"
    assert parser.parse_args(common + ["--gather", "world"]).gather == "world"
    with pytest.raises(ValueError, match="gather='auto' names no group"):
        topo.gather_group(0, "auto")
    with pytest.raises(ValueError, match="gather='node' is not allowed"):
        Engine(DIFFUSERS, 1, sp_size=2, gather="node")
    with pytest.raises(ValueError, match="gather='sp' and options\\['shard_group'\\]"):
        Engine("dlo_fx.apps.engine.reference_pipeline:build", 1, sp_size=2, gather="sp",
               options={"shard_group": [0, 1]})
    engine = Engine("dlo_fx.apps.engine.reference_pipeline:build", 2, sp_size=2)
    assert engine.spec.gather == "sp"  # a factory of unknown size: its share fits


def test_a_transformer_that_cannot_split_its_sequence_is_refused_up_front(
        flux_root, tmp_path, capsys, monkeypatch):
    from dlo_fx.apps.cli import main

    def started(*args, **kwargs):
        raise AssertionError("a worker started")

    monkeypatch.setattr(Engine, "start", started)

    sd3 = tmp_path / "sd3"
    spawn(1, in_child, _save, str(sd3), "sd3")
    with pytest.raises(ValueError, match="component 'transformer' is a diffusers."
                       "SD3Transformer2DModel, which has no context-parallel plan"):
        Engine(DIFFUSERS, 1, sp_size=2, pipeline_kwargs={"path": str(sd3)})
    Engine(DIFFUSERS, 2, pipeline_kwargs={"path": str(sd3)})  # sp 1: nothing to split
    with pytest.raises(ValueError, match="FluxTransformer2DModel, which has "
                       "num_attention_heads=2, which sp_size=4 does not divide"):
        Engine(DIFFUSERS, 1, sp_size=4, pipeline_kwargs={"path": str(flux_root)})
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"prompt": "a cat", "height": 16, "width": 16}) + "\n")
    status = main(["generate", "--diffusers", str(sd3), "--sp", "2", "--requests",
                   str(requests), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert status == 2 and "SD3Transformer2DModel, which has no context-parallel plan" in err
    assert "serve it with sp_size=1 (--sp 1)" in err and not (tmp_path / "out").exists()
    # Its neighbours: a folder that is no pipeline, two gather groups named at once.
    for folder, extra, needle in (
            (tmp_path, [], "no model_index.json there"),
            (sd3, ["--gather", "dp", "--option", "shard_group=[0]"],
             "gather='dp' and options['shard_group'] both name")):
        status = main(["generate", "--diffusers", str(folder), *extra, "--requests",
                       str(requests), "--out", str(tmp_path / "out"), "--quiet"])
        err = capsys.readouterr().err
        assert status == 2 and needle in err, err
    assert not (tmp_path / "out").exists()


def test_enable_context_parallel_refuses_what_diffusers_cannot_split():
    from torch import nn

    from dlo_fx.apps.engine.context_parallel import enable_context_parallel

    with pytest.raises(ValueError, match="has the dimensions \\(\\); diffusers reads the "
                       "dimensions 'ring' and 'ulysses'"):
        enable_context_parallel(nn.Linear(2, 2), object())


# -- replicas of two ranks ---------------------------------------------------------------
@pytest.mark.spawned.with_args(_references)
@pytest.mark.parametrize("dp_size, gather, group", [
    (1, "auto", 2),   # DP1xSP2: over the replica's ranks
    (1, "none", 1),   # rank-local
    (2, "world", 4),  # DP2xSP2 over every rank: both replicas in lock-step
    (2, "dp", 2),     # DP2xSP2 over the strided DP pairs (0, 2) and (1, 3)
])
def test_sequence_parallel_replicas_equal_the_resident_context_parallel_pipeline(
        spawned, flux_root, dp_size, gather, group):
    reference = spawned[0]
    with Engine(DIFFUSERS, dp_size, sp_size=2, gather=gather, wave_timeout_s=300,
                pipeline_kwargs={"path": str(flux_root)}) as engine:
        assert engine.spec.gather == ("sp" if gather == "auto" else gather)
        results = engine.generate(REQUESTS)
    assert [r.wave for r in results] == ([0, 0] if dp_size == 2 else [0, 1])
    for result, expected, plain in zip(results, reference["parallel"], reference["plain"]):
        assert result.ok, result.error
        assert torch.equal(result.output["images"], expected), result.request
        # Without context parallelism the transformer's output differs in its last bits
        # (the keys reach attention in another order: docs/architecture.md), not the 8-bit
        # images of these requests.
        assert torch.equal(plain, expected)
        info = result.info
        assert info["context_parallel"] == {"transformer": 2}
        host = info["transformer"]["host_shard_bytes"]
        whole = reference["whole"]
        assert whole / group <= host <= whole / group + 3 * 256, (host, whole, group)
    assert sorted({r.dp_rank for r in results}) == list(range(dp_size))


# -- a rank failing inside a graph --------------------------------------------------------
HANG_TIMEOUT_S = 5.0


@pytest.mark.spawned.with_args(_references)
def test_a_rank_hanging_inside_a_graph_fails_its_wave_within_the_collective_timeout(
        spawned, flux_root):
    """Rank 1 hangs inside the transformer's compiled graph (tests/hanging_pipeline.py);
    rank 0 waits in the model's next all-to-all (rank-local: no dlo collective at all),
    which runs on the default process group at DP1xSP2. It raises within
    ``collective_timeout_s`` (see [Note: failure inside a graph stays bounded]), not at
    that group's own timeout (the wave timeout, 300 s here), the wave fails closed, and the
    next wave, on fresh workers, equals the resident context-parallel pipeline."""
    reference = spawned[0]
    hang = dataclasses.replace(REQUESTS[0],
                               extra_args={**REQUESTS[0].extra_args, "hang_rank": 1})
    with Engine("hanging_pipeline:build", 1, sp_size=2, gather="none", wave_timeout_s=300,
                options={"collective_timeout_s": HANG_TIMEOUT_S},
                pipeline_kwargs={"path": str(flux_root)}) as engine:
        first = engine.run_wave([REQUESTS[0]])[0]  # compiles: the hang is timed alone
        failed = engine.run_wave([hang])[0]
        after = engine.run_wave([REQUESTS[1]])[0]
    assert first.ok, first.error
    assert torch.equal(first.output["images"], reference["parallel"][0])
    assert not failed.ok and "failed closed" in failed.error, failed.error
    assert "worker rank 0" in failed.error and f"{HANG_TIMEOUT_S * 1000:.0f}ms" in \
        failed.error, failed.error
    # bounded by collective_timeout_s, far below the 300 s the group's own timeout would
    # take (the margin is for a loaded 2-core machine: the rank's report and teardown)
    assert HANG_TIMEOUT_S <= failed.seconds < HANG_TIMEOUT_S + 60, failed.seconds
    assert engine.generations == 2
    assert after.ok, after.error
    assert torch.equal(after.output["images"], reference["parallel"][1])

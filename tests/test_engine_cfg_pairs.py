"""The engine's ``cfg_size=2`` on pipelines that call their denoiser once per guidance
branch ([Note: two-call CFG parallel] in dlo_fx/model/cfg_pairs.py): tiny saved Wan and
Flux pipelines, each topology one engine, every output equal to the same pipeline without
CFG parallel resident (with the same context parallelism at ``sp_size=2``)."""

from __future__ import annotations

import tempfile

import pytest
import torch

import diffusers_pipelines as dp
from distributed import in_child, spawn
from dlo_fx.apps.engine import Engine, Request
from dlo_fx.apps.engine.factories import DIFFUSERS
from test_engine_sequence_parallel import REQUESTS as FLUX_REQUESTS
from test_engine_sequence_parallel import resident_case

WAN = dict(height=32, width=32, num_frames=5, num_inference_steps=2, negative_prompt="blurry",
           extra_args={"max_sequence_length": 16})
WAN_REQUESTS = [Request(prompt="a red cat over the tree", seed=1, guidance_scale=3.0, **WAN),
                Request(prompt="a green house", seed=3, guidance_scale=3.0, **WAN),
                Request(prompt="a blue dog", seed=2, guidance_scale=1.0, **WAN)]  # no CFG
"""At dp 2 the first two share a wave (one per replica); the third runs alone."""


def _save(folder: str, kind: str) -> None:
    dp.BUILDERS[kind]().save_pretrained(folder)


def _plain(folder: str, requests: list) -> list:
    from dlo_fx.apps.engine.diffusers_pipeline import resident

    pipe = resident(folder)
    return [pipe(r)["frames"] for r in requests]


def _references() -> dict:
    """The saved Wan pipeline resident, single-rank, without CFG parallel; the saved Flux
    pipeline resident with context parallelism over 2 ranks (`resident_case`)."""
    with tempfile.TemporaryDirectory() as wan, tempfile.TemporaryDirectory() as flux:
        spawn(1, in_child, _save, wan, "wan")
        spawn(1, in_child, _save, flux, "flux")
        return {"wan": spawn(1, in_child, _plain, wan, WAN_REQUESTS)[0],
                "flux": spawn(2, resident_case, flux, FLUX_REQUESTS, timeout=400)[0]}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    out = {}
    for kind in ("wan", "flux"):
        out[kind] = tmp_path_factory.mktemp("cfg2") / kind
        spawn(1, in_child, _save, str(out[kind]), kind)
    return out


def _check(results, expected, key: str, pairs: int, sp_size: int = 1) -> None:
    for result, want in zip(results, expected):
        assert result.ok, result.error
        assert torch.equal(result.output[key], want), result.request
        first = 2 * sp_size * result.dp_rank  # the replying rank's pair, strided by sp
        assert result.info["cfg_parallel"] == {"transformer": [first, first + sp_size]}
    counts = results[-1].info["cfg_pairs"]["transformer"]
    assert counts["deferred"] >= pairs, counts


@pytest.mark.spawned.with_args(_references)
@pytest.mark.parametrize("dp_size", [1, 2])
def test_the_engine_at_cfg_2_equals_the_wan_pipeline_without_cfg_parallel(spawned, roots,
                                                                         dp_size):
    """dp 1 x cfg 2 (one pair) and dp 2 x cfg 2 (two pairs, two replicas); a request with
    guidance off computes its calls whole on both ranks of its pair."""
    with Engine(DIFFUSERS, dp_size, cfg_size=2, wave_timeout_s=400,
                pipeline_kwargs={"path": str(roots["wan"])}) as engine:
        assert engine.spec.gather == "cfg"
        results = engine.generate(WAN_REQUESTS)
    _check(results, spawned["wan"], "frames", pairs=1)
    assert sorted({r.dp_rank for r in results}) == list(range(dp_size))


@pytest.mark.spawned.with_args(_references)
def test_the_engine_at_cfg_2_sp_2_equals_the_context_parallel_flux_pipeline(spawned, roots):
    """cfg 2 x sp 2 (4 ranks): each branch's SP pair splits its sequence, the CFG pairs
    (0, 2) and (1, 3) pair the branches; every block gathered over the replica."""
    with Engine(DIFFUSERS, 1, cfg_size=2, sp_size=2, wave_timeout_s=400,
                pipeline_kwargs={"path": str(roots["flux"])}) as engine:
        assert engine.spec.gather == "replica"
        results = engine.generate(FLUX_REQUESTS)
    _check(results, spawned["flux"]["parallel"], "images", pairs=1, sp_size=2)
    assert results[0].info["context_parallel"] == {"transformer": 2}

"""CFG parallel (`dlo_fx.cfg_parallel`, ``compile_pipeline(cfg_group=...)``) on two gloo
ranks, one spawn running every sub-case (tests/cfg_cases.py): a tiny SD3 whose batched
guidance call is split over the pair, streamed by dlo with 1/2 of every block per rank,
equal to the same CFG-parallel pipeline resident; the refusals; the bounded failures."""

from __future__ import annotations

import tempfile

import pytest
import torch

import cfg_cases
import diffusers_pipelines as dp
from distributed import in_child, spawn
from dlo_fx.apps.engine import Engine, Request, Topology
from dlo_fx.apps.engine.cli import DIFFUSERS

COMMON = dict(height=16, width=16, num_inference_steps=2, negative_prompt="blurry",
              extra_args={"max_sequence_length": 16})
REQUESTS = [Request(prompt="a red cat over the tree", seed=1, guidance_scale=3.0, **COMMON),
            Request(prompt="a blue dog", seed=2, guidance_scale=1.0, **COMMON)]  # no CFG


def _save(folder: str, kind: str = "sd3") -> None:
    dp.BUILDERS[kind]().save_pretrained(folder)


def _job() -> dict:
    """Every sub-case of tests/cfg_cases.py on 2 ranks, on an SD3 pipeline saved for it."""
    with tempfile.TemporaryDirectory() as folder:
        spawn(1, in_child, _save, folder)
        return spawn(2, cfg_cases.cfg_cases, folder, REQUESTS, timeout=600)


@pytest.fixture(scope="module")
def sd3_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg") / "sd3"
    spawn(1, in_child, _save, str(root))
    return root


@pytest.mark.spawned.with_args(_job)
def test_cfg_parallel_sd3_equals_the_same_cfg_parallel_pipeline_resident(spawned):
    for rank in (0, 1):
        r = spawned[rank]
        assert r["readme"], "the README's CFG-parallel snippet gave another image"
        # streamed, each rank holding 1/2 of every block: the resident CFG-parallel
        # pipeline's images at both resolutions (the second recompiles), on both ranks
        assert all(torch.equal(a, b) for a, b in zip(r["dlo"], r["resident-sizes"])), rank
        assert torch.equal(r["dlo"][0], spawned[0]["dlo"][0])
        host, whole = r["host"]
        assert whole / 2 <= host < 0.55 * whole, (host, whole)
        # guidance off: batch 1, computed whole on both ranks: the plain pipeline's images
        assert torch.equal(r["dlo-off"], r["plain-off"])
        assert torch.equal(r["resident-off"], r["plain-off"])
        # Against the batch of two on one rank: the guided calls' noise predictions differ
        # in their last bits (a matrix product of B rows sums in another order than one of
        # 2B on this CPU), the unguided calls (batch 1 both ways) are equal.
        assert r["noise-equal"][2:] == [True, True], r["noise-equal"]
        assert r["noise-diff"] < 1e-5
        # refused by name before anything changes
        for key, words in (("three", "ThreeCallWan calls its denoiser more than twice per "
                                     "step (cache_context 'uncond_stg' besides"),
                           ("unnamed", "UnnamedTrueCFG calls its denoiser once per guidance "
                                       "branch without diffusers' cache_context")):
            kind, message = r[key]
            assert kind == "ValueError" and words in message, (key, message)
            assert "nothing was changed" in message
        assert r["two-call-unchanged"] and r["group-unchanged"]
        for key, words in (("one-rank", "expected two distinct ranks"),
                           ("three-ranks", "expected two distinct ranks"),
                           ("not-mine", "does not contain this process"),
                           ("a-word", "group='world' is not allowed"),
                           ("not-a-module", "StableDiffusion3Pipeline is not a torch module")):
            assert r[key][0] == "ValueError" and words in r[key][1], (key, r[key])
        # a module of its own: split with its rotary table whole; an odd batch whole
        assert r["split"] and r["odd"] and r["after-mismatch"] and r["removed"]
        kind, message = r["mismatch"]
        assert kind == "RuntimeError" and "reached different calls of _Scale" in message
        assert "rank 0: [4, 1," in message and "rank 1: [4, 1," in message
    # a rank whose forward raises: its peer raises too, within the pair's timeout (5 s)
    assert spawned[1]["peer-failed"] == ("RuntimeError", "injected failure")
    kind, message = spawned[0]["peer-failed"]
    assert kind == "RuntimeError" and "exchanging the halves of output over the CFG pair" \
        in message and spawned[0]["peer-failed-s"] < 30


def test_the_pipelines_cfg_parallel_cannot_serve_are_named():
    """Batched (SD3) and two calls named "cond"/"uncond" (Wan, Flux, Qwen-Image,
    HunyuanVideo) are served; a third call per step (LTX-2) is named."""
    import diffusers

    from dlo_fx.model.cfg_parallel import calls_per_branch, cfg_refusal

    for name in ("StableDiffusion3Pipeline", "FluxPipeline", "WanPipeline",
                 "QwenImagePipeline", "HunyuanVideoPipeline"):
        assert cfg_refusal(getattr(diffusers, name)) is None, name
    assert not calls_per_branch(diffusers.StableDiffusion3Pipeline)
    assert calls_per_branch(diffusers.WanPipeline) and calls_per_branch(diffusers.FluxPipeline)
    assert "more than twice per step (cache_context 'uncond_modality', 'uncond_stg'" in \
        cfg_refusal(diffusers.LTX2Pipeline)
    assert "more than twice per step" in cfg_refusal(cfg_cases.ThreeCallWan)
    assert "without diffusers' cache_context" in cfg_refusal(cfg_cases.UnnamedTrueCFG)


def test_cfg_parallel_needs_torch_distributed():
    from torch import nn

    import dlo_fx

    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        dlo_fx.cfg_parallel(nn.Linear(2, 2), [0, 1])


def test_the_cfg_pair_follows_the_topology(tmp_path):
    topo = Topology(dp_size=2, sp_size=2, cfg_size=2)  # replica 0: ranks 0-3, replica 1: 4-7
    assert [topo.cfg_group(r) for r in (0, 1, 2, 5)] == [(0, 2), (1, 3), (0, 2), (5, 7)]
    assert [topo.sp_group(r) for r in (0, 2, 7)] == [(0, 1), (2, 3), (6, 7)]
    assert topo.dp_group(2) == (2, 6) and topo.replica_group(5) == (4, 5, 6, 7)
    assert [topo.replies(r) for r in range(8)] == [True] + [False] * 3 + [True] + [False] * 3
    assert [topo.gather_group(3, g) for g in ("cfg", "replica", "world")] == \
        [(1, 3), (0, 1, 2, 3), tuple(range(8))]
    routes = {(d, c, s): Topology(d, s, c).choose_gather()
              for d, c, s in ((1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2), (4, 1, 1))}
    assert routes == {(1, 2, 1): "cfg", (2, 2, 1): "cfg", (1, 2, 2): "replica",
                      (2, 1, 2): "sp", (4, 1, 1): "dp"}
    assert Topology(2, 1, 2).choose_gather(sp_share_fits=False) == "world"
    with pytest.raises(ValueError, match="cfg_size=3 is not allowed: expected 1 or 2"):
        Topology(1, 1, 3)
    flux = tmp_path / "flux"
    spawn(1, in_child, _save, str(flux), "flux")
    Engine(DIFFUSERS, 1, cfg_size=2, pipeline_kwargs={"path": str(flux)})  # two calls: served
    index = flux / "model_index.json"  # the same folder, named as LTX-2's pipeline
    index.write_text(index.read_text().replace('"FluxPipeline"', '"LTX2Pipeline"'))
    with pytest.raises(ValueError, match="the pipeline LTX2Pipeline calls its denoiser more "
                       "than twice per step.*serve it with cfg_size=1 \\(--cfg 1\\)"):
        Engine(DIFFUSERS, 1, cfg_size=2, pipeline_kwargs={"path": str(flux)})


@pytest.mark.spawned.with_args(_job)
def test_the_engine_at_cfg_2_equals_the_resident_cfg_parallel_pipeline(spawned, sd3_root):
    """dp 1 x cfg 2: one request at a time on the CFG pair, every block gathered over it."""
    with Engine(DIFFUSERS, 1, cfg_size=2, wave_timeout_s=300,
                pipeline_kwargs={"path": str(sd3_root)}) as engine:
        assert engine.spec.gather == "cfg"
        results = engine.generate(REQUESTS)
    for result, expected in zip(results, spawned[0]["engine"]):
        assert result.ok, result.error
        assert torch.equal(result.output["images"], expected), result.request
        assert result.info["cfg_parallel"] == {"transformer": [0, 1]}
        assert result.info["context_parallel"] == {"transformer": 1}
    host = results[0].info["transformer"]["host_shard_bytes"]
    whole, = {spawned[r]["host"][1] for r in (0, 1)}
    assert whole / 2 <= host < 0.55 * whole, (host, whole)


# -- the reference pipeline at cfg 2 ----------------------------------------------------------
REFERENCE_DIT = dict(width=64, depth=3, heads=4)
REFERENCE_REQUESTS = [
    Request(prompt="a red fox", seed=1, height=32, width=32, num_inference_steps=3,
            guidance_scale=3.0, negative_prompt="blurry"),
    Request(prompt="two hills", seed=2, height=32, width=32, num_inference_steps=2,
            num_outputs_per_prompt=2, guidance_scale=4.0, cfg_normalize=True),
    Request(prompt="a bird", seed=3, height=32, width=32, num_inference_steps=2,
            num_outputs_per_prompt=2),  # guidance off: every call whole on both ranks
]
"""At dp 2 the first two share a wave (one per replica), guided with different steps and
batches; the third runs alone, unguided."""


def _reference_alone() -> list:
    from dlo_fx.apps.engine.reference_pipeline import resident

    pipe = resident(**REFERENCE_DIT)
    return [pipe(r) for r in REFERENCE_REQUESTS]


@pytest.mark.spawned.with_args(lambda: spawn(1, in_child, _reference_alone)[0])
@pytest.mark.parametrize("dp_size,gather", [(1, "auto"), (2, "world")])
def test_the_reference_pipeline_at_cfg_2_equals_it_without_cfg_parallel(spawned, dp_size,
                                                                        gather):
    """The reference DiT pipeline's guided steps as one call of both branches split over
    the pair ([Note: the reference pipeline's guidance on two ranks]): every output equal
    to the pipeline without CFG parallel, resident, in one process; at dp 2 with every
    block gathered over all 4 ranks, the replicas' waves mixing guided requests of other
    steps and batches (the forward clock pads the shorter one)."""
    with Engine("dlo_fx.apps.engine.reference_pipeline:build", dp_size, cfg_size=2,
                gather=gather, wave_timeout_s=300, pipeline_kwargs=REFERENCE_DIT) as engine:
        assert engine.spec.gather == ("cfg" if gather == "auto" else gather)
        results = engine.generate(REFERENCE_REQUESTS)
    for result, want in zip(results, spawned):
        assert result.ok, result.error
        assert torch.equal(result.output, want), result.request
        first = 2 * result.dp_rank
        assert result.info["cfg_parallel"] == [first, first + 1], result.info
    assert sorted({r.dp_rank for r in results}) == list(range(dp_size))

"""Two-call CFG parallel ([Note: two-call CFG parallel] in dlo_fx/model/cfg_pairs.py) on two
gloo ranks, one spawn running every sub-case (tests/cfg_pairs_cases.py): Wan, Flux's
true_cfg_scale and Wan 2.2 (and the transformers of Qwen-Image and HunyuanVideo, called
as their pipelines call them), resident and streamed with 1/2 of every block per rank, each
equal to the same pipeline without CFG parallel; the pending prediction; the refusals; a
rank failing mid-pair; the meta device."""

from __future__ import annotations

import pytest

import cfg_pairs_cases
from distributed import spawn


def _job() -> dict:
    return spawn(2, cfg_pairs_cases.cfg_pairs_cases, timeout=800)


@pytest.mark.spawned.with_args(_job)
def test_two_call_cfg_parallel_equals_the_pipeline_without_it(spawned):
    for rank in (0, 1):
        r = spawned[rank]
        for kind in ("wan", "flux"):
            assert r[f"{kind}-resident"] == [True, True], (kind, rank)
            # the first pair of each signature computed whole, every later one deferred
            assert r[f"{kind}-resident-counts"] == {"deferred": 3, "whole": 1}, r
            assert r[f"{kind}-dlo"] == [True, True, True], (kind, rank)
            assert r[f"{kind}-dlo-counts"]["deferred"] >= 3, r
            kind_, message = r[f"{kind}-off"]
            assert kind_ == "RuntimeError" and "dlo_fx.cfg_parallel" in message
            assert "guidance off" in message and "'cond'" in message
            assert r[f"{kind}-off-whole"] and r[f"{kind}-after-off"], (kind, rank)
        assert r["wan22"] == [True, True]
        for name in cfg_pairs_cases.PAIRED_CLASSES:  # the other classes that pair by context
            assert r[f"{name}-pairs"] == [True] * 6, (name, rank, r[f"{name}-pairs"])
            assert r[f"{name}-counts"] == {"deferred": 2, "whole": 1}, (name, r)
        assert r["released"][0] and r["released"][1] > r["flux-dlo-counts"]["deferred"]


@pytest.mark.spawned.with_args(_job)
def test_the_pending_prediction_and_the_pair_refusals(spawned):
    for rank in (0, 1):
        r = spawned[rank]
        assert r["tuple"] == ("tuple", "Pending", True, True)
        cls, view, read, cond, half, uncond = r["dict"]
        assert cls == "Transformer2DModelOutput" and view == (16, 2, 8, 8)
        assert read[0] == "RuntimeError" and "read the prediction of " \
            "WanTransformer3DModel's call 'cond' before its guidance pair's second call" in read[1]
        assert cond and half and uncond
        assert r["moved"][0] == "RuntimeError" and "hidden_states of WanTransformer3DModel's " \
            "first call of a guidance pair changed in place" in r["moved"][1]
        assert r["differ"][0] == "RuntimeError" and "differ in hidden_states " \
            "((1, 16, 2, 8, 8) torch.float32 against (1, 16, 2, 4, 4)" in r["differ"][1]
        assert r["after"] and r["inference"]
        for key in ("cache", "cache-later"):
            assert r[key][0] == "ValueError" and "WanTransformer3DModel has diffusers' cache " \
                "enabled (PyramidAttentionBroadcastConfig)" in r[key][1] and "disable_cache()" in r[key][1]
        assert "nothing was changed" in r["cache"][1] and r["cache-unchanged"]
        kind, message = r["cache-pipeline"]
        assert kind == "ValueError" and "cfg_group=[0, 1]: transformer: WanTransformer3DModel " \
            "has diffusers' cache enabled" in message and "nothing was changed" in message
        assert r["cache-pipeline-unchanged"]
        assert r["removed"]
        assert r["optimized-module"] == (True, True, {"deferred": 1, "whole": 1})
        kind, message = r["compiled-after"]
        assert kind == "RuntimeError" and "the module was compiled (module.compile) after " \
            "cfg_parallel" in message, message
        # pairs="order": a module without cache_context
        assert r["order"]
        assert r["pairs-bad"][0] == "ValueError" and "pairs='odd' is not allowed" in r["pairs-bad"][1]
        assert r["pending-after"][0] == "RuntimeError"
        assert r["later"][0] == "RuntimeError" and "failed before" in r["later"][1]
        # the meta device: traced, planned, shapes of the pair and of a batched call
        assert r["meta"] == [("meta", (1, 16, 2, 8, 8), "meta", (1, 16, 2, 8, 8))] * 2
        assert r["meta-batched"] == ("meta", (2, 16, 2, 8, 8))
    # a rank whose forward raises at a second call: its peer raises within the timeout (5 s)
    assert spawned[1]["failed"] == ("RuntimeError", "injected failure")
    kind, message = spawned[0]["failed"]
    assert kind == "RuntimeError" and "the predictions' shapes" in message
    assert spawned[0]["failed-s"] < 30

"""Two-call CFG parallel on two gloo ranks: the sub-cases of one spawn, each returning what
tests/test_cfg_pairs.py checks (see [Note: two-call CFG parallel] in
dlo_fx/model/cfg_pairs.py)."""

from __future__ import annotations

import time

import torch

import diffusers_pipelines as dp
from cfg_cases import _refused, _Scale


def _counts(pipe) -> dict:
    from dlo_fx.model.state import peek

    return dict(peek(pipe.transformer).cfg_parallel.pairs.counts)


def pipelines_case(rank: int) -> dict:
    """Wan (cache_context pairs), Flux's true_cfg_scale and Wan 2.2's two transformers: the
    plain single-rank pipeline against the same pipeline CFG-parallel, resident and
    streamed (1/2 of every block per rank), at two resolutions; guidance off."""
    import dlo_fx
    from dlo_fx.model.cfg_parallel import computed_whole

    out: dict = {}
    for kind in ("wan", "flux"):
        plain = dp.BUILDERS[kind]()
        sizes = dp.SIZES[kind] + dp.SIZES[kind][:1]
        expected = [dp.images(plain, kind, height=h, width=w) for h, w in sizes]
        resident = dp.BUILDERS[kind]()
        dlo_fx.cfg_parallel(resident.transformer, [0, 1], timeout_s=60)
        first = dict(zip(("height", "width"), sizes[0]))
        out[f"{kind}-resident"] = [torch.equal(dp.images(resident, kind, **first), expected[0])
                                   for _ in range(2)]
        out[f"{kind}-resident-counts"] = _counts(resident)
        pipe = dp.BUILDERS[kind]()
        dlo_fx.compile_pipeline(pipe, options={"num_slots": 2, "shard_group": [0, 1],
                                               "collective_timeout_s": 60}, cfg_group=[0, 1])
        out[f"{kind}-dlo"] = [torch.equal(dp.images(pipe, kind, height=h, width=w), e)
                              for (h, w), e in zip(sizes, expected)]
        out[f"{kind}-dlo-counts"] = _counts(pipe)
        # guidance off: one call a step, the pending prediction is read: a clear error ...
        off = dp.images(plain, kind, cfg=False, **first)
        out[f"{kind}-off"] = _refused(lambda: dp.images(pipe, kind, cfg=False, **first))
        with computed_whole(pipe.transformer):  # ... unless its calls are computed whole
            out[f"{kind}-off-whole"] = torch.equal(dp.images(pipe, kind, cfg=False, **first),
                                                   off)
        out[f"{kind}-after-off"] = torch.equal(dp.images(pipe, kind, **first), expected[0])
    # released: the weights back in the module, its pairing kept around the plain call
    dlo_fx.release(pipe)
    out["released"] = (torch.equal(dp.images(pipe, kind, **first), expected[0]),
                       _counts(pipe)["deferred"])
    plain, pipe = dp.wan(two_transformers=True), dp.wan(two_transformers=True)
    dlo_fx.compile_pipeline(pipe, options={"num_slots": 2, "shard_group": [0, 1]},
                            cfg_group=[0, 1])
    out["wan22"] = [torch.equal(dp.images(pipe, "wan"), dp.images(plain, "wan"))
                    for _ in range(2)]
    return out


def _wan_inputs(seed: int, frames: int = 2, side: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, frames, side, side, generator=g),
                timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 16, 32, generator=g))


def _pab():
    """diffusers' Pyramid Attention Broadcast (a cache hook; FirstBlockCache needs two blocks)."""
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                           current_timestep_callback=lambda: 500)


def transformer_case(rank: int) -> dict:
    """A Wan transformer called as a pipeline calls it, by hand: what the pending prediction
    allows, what it refuses, and the refusals before anything is computed."""
    import dlo_fx

    out: dict = {}
    plain, model = dp.wan().transformer, dp.wan().transformer
    cond, uncond = _wan_inputs(1), _wan_inputs(2)
    uncond["hidden_states"] = cond["hidden_states"]

    def expected(inputs, **kw):
        with torch.no_grad():
            return plain(**inputs, **kw)

    dlo_fx.cfg_parallel(model, [0, 1], timeout_s=30)

    def pair(first: dict, second: dict, between=None, **kw):
        with torch.no_grad():
            with model.cache_context("cond"):
                a = model(**first, **kw)
            if between is not None:
                between(a)
            with model.cache_context("uncond"):
                b = model(**second, **kw)
        return a, b

    pair(cond, uncond, return_dict=False)  # a new signature: computed whole on both ranks
    a, b = pair(cond, uncond, return_dict=False)
    out["tuple"] = (type(a).__name__, type(a[0]).__name__,
                    torch.equal(a[0], expected(cond, return_dict=False)[0]),
                    torch.equal(b[0], expected(uncond, return_dict=False)[0]))
    pair(cond, uncond)  # return_dict=True: another signature
    seen: dict = {}

    def look(a):
        seen["class"] = type(a).__name__
        seen["view"] = a.sample[0].shape  # a view of the pending prediction: allowed
        seen["read"] = _refused(lambda: a.sample * 2)
        seen["half"] = a.sample.chunk(2, dim=2)[1]

    a, b = pair(cond, uncond, between=look)
    out["dict"] = (seen["class"], tuple(seen["view"]), seen["read"],
                   torch.equal(a.sample, expected(cond).sample),
                   torch.equal(seen["half"], expected(cond).sample.chunk(2, dim=2)[1]),
                   torch.equal(b.sample, expected(uncond).sample))
    with torch.inference_mode():  # inference tensors keep no _version: copied, still exact
        icond = {k: v.clone() for k, v in cond.items()}
        a, b = pair(icond, {**uncond, "hidden_states": icond["hidden_states"]},
                    between=lambda a: icond["hidden_states"].add_(1), return_dict=False)
    out["inference"] = torch.equal(a[0], expected(cond, return_dict=False)[0])
    # The first call's tensor written in place before the second call.
    out["moved"] = _refused(lambda: pair(cond, uncond, between=lambda a: cond[
        "hidden_states"].add_(0), return_dict=False))
    # The two calls of a pair from different steps (another latent size).
    other = _wan_inputs(3, side=4)
    out["differ"] = _refused(lambda: pair(cond, other, return_dict=False))
    out["after"] = torch.equal(pair(cond, uncond, return_dict=False)[1][0],
                               expected(uncond, return_dict=False)[0])
    # diffusers' cache hooks: refused up front, and at a first call when enabled after.
    cached = dp.wan().transformer
    cached.enable_cache(_pab())
    out["cache"] = _refused(lambda: dlo_fx.cfg_parallel(cached, [0, 1]))
    out["cache-unchanged"] = not cached._forward_pre_hooks
    pipe = dp.wan()
    pipe.transformer.enable_cache(_pab())
    out["cache-pipeline"] = _refused(lambda: dlo_fx.compile_pipeline(pipe, cfg_group=[0, 1]))
    out["cache-pipeline-unchanged"] = (dlo_fx.state(pipe.transformer) is None
                                       and dlo_fx.state(pipe.text_encoder) is None)
    model.enable_cache(_pab())
    out["cache-later"] = _refused(lambda: pair(cond, uncond, return_dict=False))
    model.disable_cache()
    out["counts"] = dict(__import__("dlo_fx.model.state", fromlist=["peek"]).peek(
        model).cfg_parallel.pairs.counts)
    # a torch.compile wrapper (OptimizedModule) made CFG-parallel: the wrapped module's
    # cache_context names the calls
    wrapped = torch.compile(dp.wan().transformer, backend="eager")
    dlo_fx.cfg_parallel(wrapped, [0, 1], timeout_s=30)
    with torch.no_grad():
        for _ in range(2):
            with wrapped.cache_context("cond"):
                a = wrapped(**cond, return_dict=False)[0]
            with wrapped.cache_context("uncond"):
                b = wrapped(**uncond, return_dict=False)[0]
    out["optimized-module"] = (torch.equal(a, expected(cond, return_dict=False)[0]),
                               torch.equal(b, expected(uncond, return_dict=False)[0]),
                               __import__("dlo_fx.model.cfg_parallel", fromlist=["x"])
                               .cfg_pair_counts(wrapped))
    # compiled after cfg_parallel: module.compile replaced the pairing; said, not computed
    late = dp.wan().transformer
    dlo_fx.cfg_parallel(late, [0, 1], timeout_s=30)
    late.compile(backend="eager")
    with torch.no_grad(), late.cache_context("cond"):
        out["compiled-after"] = _refused(lambda: late(**cond, return_dict=False))
    dlo_fx.cfg_parallel(model, None)
    out["removed"] = (not model._forward_pre_hooks and "_compiled_call_impl" not in vars(model)
                      and model._diffusers_hook.get_hook("dlo_fx_cfg_context") is None)
    return out


def order_case(rank: int) -> dict:
    """``pairs="order"`` on a module of its own, and a rank failing at a second call."""
    import dlo_fx

    out: dict = {}
    torch.manual_seed(0)
    model, x, y = _Scale().eval(), torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with torch.no_grad():
        want = [_Scale.forward(model, x)[0], _Scale.forward(model, y)[0]]
        dlo_fx.cfg_parallel(model, [0, 1], timeout_s=5, pairs="order")
        for _ in range(2):  # whole, then deferred
            a, b = model(x)[0], model(y)[0]
        out["order"] = torch.equal(a, want[0]) and torch.equal(b, want[1])
        out["pairs-bad"] = _refused(lambda: dlo_fx.cfg_parallel(model, [0, 1], pairs="odd"))
        model.fail_rank = 1
        first = model(x)
        start = time.perf_counter()
        out["failed"] = _refused(lambda: model(y))
        out["failed-s"] = time.perf_counter() - start
        out["pending-after"] = _refused(lambda: first[0] + 1)
        model.fail_rank = None
        out["later"] = _refused(lambda: model(x))
    return out


def meta_case(rank: int) -> dict:
    """A Wan transformer offloaded for the meta device (its host shard 1/2 per rank), its
    pair and a batched call traced, planned and run for their shapes."""
    import dlo_fx

    model = dp.wan().transformer
    dlo_fx.offload(model, options={"device": "meta", "shard_group": [0, 1], "num_slots": 2})
    model.compile(backend="dlo", options={"device": "meta", "shard_group": [0, 1],
                                          "num_slots": 2})
    dlo_fx.cfg_parallel(model, [0, 1], timeout_s=30)
    inputs = {k: v.to("meta") for k, v in _wan_inputs(1).items()}
    shapes = []
    with torch.no_grad():
        for _ in range(2):  # whole, then deferred
            with model.cache_context("cond"):
                a = model(**inputs, return_dict=False)[0]
            with model.cache_context("uncond"):
                b = model(**inputs, return_dict=False)[0]
            shapes.append((a.device.type, tuple(a.shape), b.device.type, tuple(b.shape)))
        two = {k: torch.cat([v, v]) for k, v in inputs.items()}
        batched = model(**two, return_dict=False)[0]
    return {"meta": shapes, "meta-batched": (batched.device.type, tuple(batched.shape))}


#: How the pipelines of these classes call them: the conditional call, then the
#: unconditional one with the negative prompt's text, on the same latents and timestep
#: (QwenImagePipeline's ``true_cfg_scale``, HunyuanVideoPipeline's ``true_cfg_scale``).
PAIRED_CLASSES = ("QwenImage", "HunyuanVideo")


def more_classes_case(rank: int) -> dict:
    """Qwen-Image's and HunyuanVideo's transformers (tiny zoo configs), offloaded with 1/2
    of every block per rank and compiled, called in cache_context("cond") then ("uncond")
    as their pipelines call them: each prediction equal to the same class resident."""
    import dlo_fx
    from dlo_fx.model.cfg_parallel import cfg_pair_counts
    from models import offloaded
    from zoo_models import build, by_name, outputs

    out: dict = {}
    for name in PAIRED_CLASSES:
        torch._dynamo.reset()
        plain, cond = build(by_name(name))
        model, _ = build(by_name(name))
        _, negative = build(by_name(name), seed=5)
        uncond = {**cond, "encoder_hidden_states": negative["encoder_hidden_states"]}
        if "pooled_projections" in cond:
            uncond["pooled_projections"] = negative["pooled_projections"]
        with torch.no_grad():
            want = [outputs(plain(**cond))[0], outputs(plain(**uncond))[0]]
        offloaded(model, {"mode": "allgather", "shard_group": [0, 1]})
        model.compile(backend="dlo")
        dlo_fx.cfg_parallel(model, [0, 1], timeout_s=60)
        got = []
        with torch.no_grad():
            for _ in range(3):  # the first pair whole, then deferred
                with model.cache_context("cond"):
                    a = model(**cond)
                with model.cache_context("uncond"):
                    b = model(**uncond)
                got += [torch.equal(outputs(a)[0], want[0]), torch.equal(outputs(b)[0], want[1])]
        out[f"{name}-pairs"] = got
        out[f"{name}-counts"] = cfg_pair_counts(model)
        dlo_fx.release(model)
    return out


def cfg_pairs_cases(rank: int, world: int) -> dict:
    return {**pipelines_case(rank), **transformer_case(rank), **order_case(rank),
            **meta_case(rank), **more_classes_case(rank)}

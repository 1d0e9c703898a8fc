"""CFG parallel on two gloo ranks (`dlo_fx.cfg_parallel`, ``compile_pipeline(cfg_group=)``):
the sub-cases of one spawn, each returning what tests/test_cfg_parallel.py checks."""

from __future__ import annotations

import time

import torch
from torch import nn

import diffusers_pipelines as dp


def _refused(fn) -> tuple:
    try:
        fn()
    except Exception as exc:  # the test checks the kind and the words
        return type(exc).__name__, str(exc)
    return None, ""


def _transformer_outputs(pipe, calls: list) -> None:
    """Record each transformer call's output (the gathered batch) into ``calls``."""
    pipe.transformer.register_forward_hook(
        lambda m, a, o: calls.append((o[0] if isinstance(o, tuple) else o.sample).clone()))


class _Scale(nn.Module):
    """Two linear layers; raises on ``fail_rank`` when asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.fail_rank = None

    def forward(self, hidden_states, timestep=None, image_rotary_emb=None):
        import torch.distributed as dist

        if self.fail_rank == dist.get_rank():
            raise RuntimeError("injected failure")
        out = self.b(self.a(hidden_states))
        if timestep is not None:
            out = out + timestep[:, None, None]
        if image_rotary_emb is not None:
            out = out + image_rotary_emb.sum()
        return (out,)


def _wan_pipeline() -> type:
    from diffusers import WanPipeline
    return WanPipeline


class ThreeCallWan(_wan_pipeline()):
    """A pipeline that calls its denoiser a third time per step (as LTX-2's
    ``cache_context("uncond_stg")``): two ranks cannot hold its three branches."""

    def __call__(self, *args, **kwargs):
        with self.transformer.cache_context("uncond_stg"):
            pass
        return super().__call__(*args, **kwargs)


def _flux_pipeline() -> type:
    from diffusers import FluxPipeline
    return FluxPipeline


class UnnamedTrueCFG(_flux_pipeline()):
    """A ``true_cfg_scale`` loop whose two calls have no cache_context names to pair them."""

    def __call__(self, prompt=None, true_cfg_scale: float = 1.0, **kwargs):
        return super().__call__(prompt=prompt, true_cfg_scale=true_cfg_scale, **kwargs)


def engine_references(folder: str, requests: list) -> list:
    """The saved pipeline in ``folder`` resident, its transformer CFG-parallel over ranks 0
    and 1, as the engine's diffusers factory serves ``requests``: what the engine at
    ``cfg_size=2`` must return."""
    import dlo_fx
    from dlo_fx.apps.engine.diffusers_pipeline import resident

    pipe = resident(folder)
    dlo_fx.cfg_parallel(pipe.pipe.transformer, [0, 1])
    return [pipe(r)["images"] for r in requests]


def readme_case(folder: str) -> bool:
    """The README's CFG-parallel snippet on the pipeline saved in ``folder``, at a tiny
    size: the image of the same pipeline resident with `cfg_parallel`."""
    import numpy as np
    from diffusers import StableDiffusion3Pipeline

    import dlo_fx
    from test_readme import CFG_SECTION, python_snippets

    (line, code), = python_snippets(CFG_SECTION)
    code = code.replace('"SD3.5-medium"', repr(folder)).replace(
        "num_inference_steps=28)", "num_inference_steps=2, height=16, width=16, "
        "generator=torch.Generator().manual_seed(0))")
    namespace: dict = {}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
    reference = StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_3=None,
                                                         tokenizer_3=None)
    dlo_fx.cfg_parallel(reference.transformer, [0, 1])
    expected = reference("a red cat", guidance_scale=7.0, num_inference_steps=2, height=16,
                         width=16, generator=torch.Generator().manual_seed(0)).images[0]
    return bool(np.array_equal(np.asarray(namespace["image"]), np.asarray(expected)))


def cfg_cases(rank: int, world: int, folder: str, requests: list) -> dict:
    import dlo_fx
    from dlo_fx.model.memory import memory_report

    out: dict = {"engine": engine_references(folder, requests), "readme": readme_case(folder)}
    kw = dict(height=16, width=16)
    # The batch of two on each rank alone (the pipeline as shipped) ...
    plain, plain_calls = dp.sd3(), []
    _transformer_outputs(plain, plain_calls)
    out["plain"] = dp.images(plain, "sd3", **kw)
    out["plain-off"] = dp.images(plain, "sd3", cfg=False, **kw)
    # ... the same CFG-parallel pipeline resident: each rank computes one branch ...
    resident, resident_calls = dp.sd3(), []
    assert dlo_fx.cfg_parallel(resident.transformer, [0, 1]) is resident.transformer
    _transformer_outputs(resident, resident_calls)
    out["resident"] = dp.images(resident, "sd3", **kw)
    out["resident-off"] = dp.images(resident, "sd3", cfg=False, **kw)
    out["noise-equal"] = [torch.equal(a, b) for a, b in zip(plain_calls, resident_calls)]
    out["noise-diff"] = max(float((a - b).abs().max()) for a, b in zip(plain_calls, resident_calls))
    # ... and streamed by dlo, 1/2 of every block on each rank, gathered over the pair.
    pipe = dp.sd3()
    dlo_fx.compile_pipeline(pipe, options={"num_slots": 2, "shard_group": [0, 1]},
                            cfg_group=[0, 1])
    out["dlo"] = [dp.images(pipe, "sd3", height=h, width=w) for h, w in dp.SIZES["sd3"]]
    out["resident-sizes"] = [dp.images(resident, "sd3", height=h, width=w)
                             for h, w in dp.SIZES["sd3"]]
    out["dlo-off"] = dp.images(pipe, "sd3", cfg=False, **kw)
    report = memory_report(pipe.transformer)
    whole = sum(p.numel() * p.element_size() for p in dp.sd3().transformer.parameters())
    out["host"] = (report.host_shard_bytes, whole)

    # Refused by name before anything changes: three calls a step, two without names.
    three, unnamed = ThreeCallWan(**dp.wan().components), UnnamedTrueCFG(**dp.flux().components)
    out["three"] = _refused(lambda: dlo_fx.compile_pipeline(three, cfg_group=[0, 1]))
    out["unnamed"] = _refused(lambda: dlo_fx.compile_pipeline(unnamed, cfg_group=[0, 1]))
    out["two-call-unchanged"] = (dlo_fx.state(three.transformer) is None
                                 and dlo_fx.state(unnamed.transformer) is None
                                 and not three.transformer._forward_pre_hooks)
    sd3 = dp.sd3()
    for key, group in (("one-rank", [rank]), ("not-mine", [2, 3]), ("three-ranks", [0, 1, 2]),
                       ("a-word", "world")):
        out[key] = _refused(lambda: dlo_fx.compile_pipeline(sd3, cfg_group=group))
    out["group-unchanged"] = (dlo_fx.state(sd3.transformer) is None
                              and not sd3.transformer._forward_pre_hooks)
    out["not-a-module"] = _refused(lambda: dlo_fx.cfg_parallel(sd3, [0, 1]))

    # A module of its own: what is split and what is not, and the bounded failures.
    torch.manual_seed(0)
    model, x = _Scale().eval(), torch.randn(4, 3, 8)
    t, rope = torch.arange(4.0), torch.randn(4, 8)  # rope: a table as long as the batch
    with torch.no_grad():
        expected = torch.cat([model(x[:2], t[:2], rope)[0], model(x[2:], t[2:], rope)[0]])
        dlo_fx.cfg_parallel(model, [0, 1], timeout_s=5)
        out["split"] = torch.equal(model(hidden_states=x, timestep=t,
                                         image_rotary_emb=rope)[0], expected)
        out["odd"] = torch.equal(model(hidden_states=x[:3], timestep=t[:3])[0],
                                 _plain(model, x[:3], t[:3]))
        mine = x if rank == 0 else x[:, :2]  # the ranks reach different calls
        out["mismatch"] = _refused(lambda: model(hidden_states=mine))
        out["after-mismatch"] = torch.equal(model(hidden_states=x, timestep=t)[0],
                                            torch.cat([_plain(model, x[:2], t[:2]),
                                                       _plain(model, x[2:], t[2:])]))
        model.fail_rank = 1
        start = time.perf_counter()
        out["peer-failed"] = _refused(lambda: model(hidden_states=x))
        out["peer-failed-s"] = time.perf_counter() - start
        dlo_fx.cfg_parallel(model, None)
        out["removed"] = not model._forward_pre_hooks and not model._forward_hooks
    return out


def _plain(model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return type(model).forward(model, x, t)[0]

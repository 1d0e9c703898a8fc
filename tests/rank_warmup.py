"""Imported once by the fork server that every rank forks from (tests/distributed.py).

It compiles a tiny reference DiT with ``backend="dlo"`` and calls it once, resolves the
diffusers classes the tests build (`_resolve_diffusers_classes`), then resets
Dynamo and the runtimes: each rank then starts with the lazy set-up of a first compile
done (Dynamo's, the dlo passes' imports), not only with the modules imported. What it
leaves behind: no thread (the runtime's copy worker ends with `reset_runtimes`), no
compiled code, no runtime, one intra-op thread.
"""

from __future__ import annotations

import gc
import threading

import torch


def _warm_up() -> None:
    import dlo_fx
    from dlo_fx.apps.models import example_inputs, reference_dit
    from dlo_fx.runtime.weights.owners import reset_runtimes

    torch.set_num_threads(1)
    model = reference_dit(width=32, depth=3, heads=2, seed=0).eval().requires_grad_(False)
    inputs = example_inputs(model.config, batch=1, height=4, width=4, seed=0)
    with torch.no_grad():
        dlo_fx.offload(model, {"device": "cpu"})
        torch.compile(model, backend="dlo", fullgraph=True)(*inputs)
    del model
    _resolve_diffusers_classes()
    torch._dynamo.reset()
    reset_runtimes()
    gc.collect()
    if threading.active_count() != 1:  # forking beside a live thread could deadlock a rank
        raise RuntimeError(f"threads left by the warm-up: {threading.enumerate()}")


def _resolve_diffusers_classes() -> None:
    """diffusers imports a class's module on first access: the pipeline classes (with
    transformers' text encoders) and the zoo's transformer classes cost seconds of CPU in
    every process that first touches them. Resolved here once, they are imported in every
    rank and child forked from the server."""
    import diffusers
    import transformers
    import zoo_models

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its notes on torchvision, once per session
    try:
        for name in ("FluxPipeline", "WanPipeline", "StableDiffusion3Pipeline"):
            getattr(diffusers, name)
        for entry in zoo_models.ZOO:
            getattr(diffusers, entry.cls)
    finally:
        transformers.logging.set_verbosity(verbosity)


_warm_up()

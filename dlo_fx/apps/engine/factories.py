"""The engine's own pipeline factories, by name (``"package.module:function"``, what a worker
imports): the CLI's default and ``--diffusers``, and what the front end checks of them before
any worker starts (engine.py). Imports nothing, so ``dlo-fx generate --help`` loads no torch."""

REFERENCE = "dlo_fx.apps.engine.reference_pipeline:build"
"""The flow-matching sampler over the reference DiT (reference_pipeline.py)."""

DIFFUSERS = "dlo_fx.apps.engine.diffusers_pipeline:build"
"""A saved diffusers pipeline folder, its denoisers streamed (diffusers_pipeline.py)."""

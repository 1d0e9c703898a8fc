"""Tiny models the tests run: the reference DiT and diffusers' Wan and Flux transformers."""

from __future__ import annotations

from typing import Callable

import torch

import dlo_fx
from dlo_fx.apps.models import example_inputs, reference_dit
from dlo_fx.config import COMPILE_OPTIONS
from dlo_fx.runtime.weights.owners import runtimes_holding


def offloaded(model: torch.nn.Module, options=None, **kw) -> torch.nn.Module:
    """``model`` offloaded (`dlo_fx.offload`, the one way in) with the options in ``options``
    that shape its runtime (the compile options are ``torch.compile``'s to give), computing
    where its parameters are unless ``options`` names a device: the tests' inputs are
    made there."""
    if options is None or isinstance(options, dict):
        options = {k: v for k, v in (options or {}).items() if k not in COMPILE_OPTIONS}
        options.setdefault("device", str(next(model.parameters()).device))
    return dlo_fx.offload(model, options, **kw)


def tiny_dit(depth: int = 3, graph_break: bool = False, seed: int = 0):
    model = reference_dit(width=64, depth=depth, heads=4, seed=seed,
                          graph_break_in_blocks=graph_break)
    return model, example_inputs(model.config, batch=2, height=8, width=8, seed=1)


def _init(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval().requires_grad_(False)


def tiny_wan(seed: int = 0, heads: int = 2):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=3,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )
    _init(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = (torch.randn(1, 4, 2, 8, 8, generator=gen), torch.tensor([500]),
              torch.randn(1, 6, 32, generator=gen))
    return model, inputs


def tiny_flux(seed: int = 0, heads: int = 2, text: int = 6):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 4, 8),
    )
    _init(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = 16
    kwargs = dict(
        hidden_states=torch.randn(1, tokens, 16, generator=gen),
        encoder_hidden_states=torch.randn(1, text, 32, generator=gen),
        pooled_projections=torch.randn(1, 32, generator=gen),
        timestep=torch.tensor([0.5]),
        img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                           indexing="ij"), -1).reshape(-1, 3),
        txt_ids=torch.zeros(text, 3),
        return_dict=False,
    )
    return model, kwargs


MODELS: dict[str, Callable] = {"dit": tiny_dit, "wan": tiny_wan, "flux": tiny_flux}


def call(model, inputs):
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    if isinstance(out, tuple):
        out = out[0]
    return getattr(out, "sample", out)


def run_dlo(factory, options=None, *, calls=2, fullgraph=True, **kw):
    """Reference output of a resident model, and `calls` outputs of a dlo-compiled twin
    (offloaded first, then compiled: the one way in)."""
    ref_model, inputs = factory(**kw)
    with torch.no_grad():
        ref = call(ref_model, inputs)
    model, _ = factory(**kw)
    compiled = torch.compile(offloaded(model, options), backend="dlo", options=options,
                             fullgraph=fullgraph)
    with torch.no_grad():
        outs = [call(compiled, inputs) for _ in range(calls)]
    return ref, outs, model


def runtime_figures(model: torch.nn.Module) -> dict:
    """Mode, shard geometry and memory figures of the runtime holding ``model``."""
    report = dlo_fx.memory_report(model)
    runtime = runtimes_holding(list(model.parameters()))[0]
    blocks, dp = runtime.store.blocks, runtime.store.dp
    return {
        "mode": runtime.mode,
        "dp": dp,
        "host_shard_bytes": report.host_shard_bytes,
        "sum_shard": sum(b.spec.shard_bytes if dp > 1 else b.spec.padded_bytes for b in blocks),
        "total": sum(b.nbytes for b in blocks),
        "blocks": len(blocks),
        "slot_bytes": report.slot_bytes,
        "max_block_bytes": report.max_block_bytes,
        "reason": runtime.mode_reason,
        "predicted": report.predicted,
    }

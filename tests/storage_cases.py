"""Low-precision storage (``storage_dtype``) cases, run in their own processes: a tiny
diffusers Flux whose linear layers are stored as fp8 and computed in bf16, against the same
model with diffusers' layerwise casting run resident (`ref_model`)."""

from __future__ import annotations

import os
import warnings

import torch

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def flux(dtype: torch.dtype = BF16, seed: int = 0) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8])
    return model.to(dtype).eval().requires_grad_(False)


def inputs(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, 4, generator=g).to(BF16),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g).to(BF16),
                pooled_projections=torch.randn(1, 32, generator=g).to(BF16),
                timestep=torch.tensor([0.5]).to(BF16), img_ids=torch.zeros(16, 3),
                txt_ids=torch.zeros(8, 3))


def run(model: torch.nn.Module, seed: int = 1) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(**inputs(seed)).sample


def ref_model(model: torch.nn.Module) -> torch.nn.Module:
    model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=BF16)
    return model


def write_checkpoint(folder: str) -> None:
    """A float32 diffusers folder (loaded in bf16, stored in fp8: two casts) and its
    pre-sharded fp8 folders for dp 1 and 2."""
    from dlo_fx.loading.shards import write_shard_dir
    from diffusers import FluxTransformer2DModel

    root = os.path.join(folder, "flux")
    flux(torch.float32).save_pretrained(root)
    for dp in (1, 2):
        write_shard_dir(FluxTransformer2DModel, root, os.path.join(folder, f"fp8-dp{dp}"),
                        dp=dp, dtype=BF16, options={"storage_dtype": "float8_e4m3fn"})


def write_case(rank: int, world: int, folder: str) -> None:
    write_checkpoint(folder)


def ranks_case(rank: int, world: int, folder: str) -> dict:
    """Every rank: both modes, compiled from memory and loaded from the fp8 shard folders,
    two calls each, against the resident layerwise-cast model; and the bytes stored."""
    import dlo_fx
    from diffusers import FluxTransformer2DModel
    from dlo_fx.runtime.weights.owners import reset_runtimes, runtimes_holding
    from models import offloaded

    root = os.path.join(folder, "flux")
    want = run(ref_model(FluxTransformer2DModel.from_pretrained(root, torch_dtype=BF16)))
    want_memory = run(ref_model(flux()))
    out = {}
    for mode in ("allgather", "rank_local"):
        torch._dynamo.reset()
        reset_runtimes()
        model = offloaded(flux(), {"mode": mode, "storage_dtype": FP8})
        model.compile(backend="dlo")
        out[("memory", mode)] = [torch.equal(run(model), want_memory) for _ in range(2)]
        torch._dynamo.reset()
        model = dlo_fx.load(FluxTransformer2DModel, root, dtype=BF16, options={
            "mode": mode, "storage_dtype": FP8})  # the checkpoint itself, cast while read
        model.compile(backend="dlo")
        out[("root", mode)] = [torch.equal(run(model), want) for _ in range(2)]
        shards = os.path.join(folder, f"fp8-dp{world if mode == 'allgather' else 1}")
        for host_store in ("memory", "mmap"):
            torch._dynamo.reset()
            model = dlo_fx.load(FluxTransformer2DModel, shards, dtype=BF16, options={
                "mode": mode, "storage_dtype": "float8_e4m3fn", "host_store": host_store})
            eager = run(model)
            model.compile(backend="dlo")
            out[("shards", mode, host_store)] = [torch.equal(eager, want)] + [
                torch.equal(run(model), want) for _ in range(2)]
            store = runtimes_holding(list(model.parameters()))[0].store
            out[("dtypes", mode, host_store)] = sorted(
                {str(e.dtype) for e in store._entries.values()})
    return out

"""GGUF files for the loader: a tiny diffusers Flux written with the ``gguf`` package
(mixed: Q8_0 linear weights, one BF16 linear weight, an F16 weight whose width no GGML
block divides, F32 norms and biases), and the rank cases that load it."""

from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np
import torch

import storage_cases
from storage_cases import BF16, flux

COMPUTE = BF16


def run(model: torch.nn.Module, dtype: torch.dtype = COMPUTE) -> torch.Tensor:
    """`storage_cases.run` with its bfloat16 inputs in ``dtype``."""
    import warnings

    inputs = {k: v.to(dtype) if v.dtype == BF16 else v for k, v in storage_cases.inputs().items()}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(**inputs).sample


def write_gguf(path: str, model: torch.nn.Module,
               edit: Optional[Callable[[dict], dict]] = None) -> None:
    """``model``'s state dict as a GGUF file in diffusers names (``edit`` may change the
    dict of numpy arrays and their GGML types first)."""
    import gguf

    q8, bf16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16
    tensors = {}
    for key, value in model.state_dict().items():
        a = value.float().numpy()
        if key == "context_embedder.weight":
            tensors[key] = (gguf.quants.quantize(a, bf16), bf16)
        elif a.ndim == 2 and a.shape[1] % 32 == 0:
            tensors[key] = (gguf.quants.quantize(a, q8), q8)
        elif a.ndim == 2:
            tensors[key] = (a.astype(np.float16), None)
        else:
            tensors[key] = (a, None)
    if edit is not None:
        tensors = edit(tensors)
    writer = gguf.GGUFWriter(path, "flux")
    for key, (array, qtype) in tensors.items():
        writer.add_tensor(key, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_folder(folder: str) -> str:
    """A diffusers folder ``folder/flux/transformer`` with config.json and model.gguf;
    returns the .gguf path."""
    model = flux(torch.float32)
    sub = os.path.join(folder, "flux", "transformer")
    os.makedirs(sub, exist_ok=True)
    model.save_config(sub)
    path = os.path.join(sub, "model.gguf")
    write_gguf(path, model)
    return path


def reference(path: str, compute: torch.dtype = COMPUTE) -> torch.nn.Module:
    """diffusers' own load of the file, with the GGUF quantizer."""
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    return FluxTransformer2DModel.from_single_file(
        path, quantization_config=GGUFQuantizationConfig(compute_dtype=compute),
        config=os.path.dirname(path))


def write_case(rank: int, world: int, folder: str) -> None:
    write_folder(folder)


def ranks_case(rank: int, world: int, folder: str) -> dict:
    """Every rank: both modes, both host stores, from the folder: the eager call and two
    compiled calls against diffusers' load of the file."""
    import dlo_fx
    from diffusers import FluxTransformer2DModel
    from dlo_fx.runtime.weights.owners import reset_runtimes

    root = os.path.join(folder, "flux")
    want = run(reference(os.path.join(root, "transformer", "model.gguf")))
    out = {}
    for mode in ("allgather", "rank_local"):
        for host_store in ("memory", "mmap"):
            torch._dynamo.reset()
            reset_runtimes()
            model = dlo_fx.load(FluxTransformer2DModel, root, subfolder="transformer",
                                dtype=COMPUTE, options={"mode": mode, "host_store": host_store})
            eager = run(model)
            model.compile(backend="dlo")
            out[(mode, host_store)] = [torch.equal(eager, want)] + [
                torch.equal(run(model), want) for _ in range(2)]
    return out


def _classes(model: torch.nn.Module) -> dict:
    """Each parameter's class and GGUF type."""
    return {n: (type(p), getattr(p, "quant_type", None)) for n, p in model.named_parameters()}


def release_case(rank: int, world: int, folder: str) -> dict:
    """Every rank: the .gguf file loaded with `dlo_fx.load` (both host stores) and
    diffusers' own load of it offloaded, each called (compiled on one rank; eagerly on
    several, whose compiled calls `ranks_case` checks) and released; then
    {(how, host_store, mode): [the call exact, released exact, every parameter of the
    class and GGUF type diffusers' load has, the saved weights (``save_pretrained`` of the
    loaded model, ``save_file`` of the state dict of diffusers' own, which diffusers does
    not save) loaded into diffusers' load of the file exact]}."""
    import dlo_fx
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file, save_file
    from dlo_fx.runtime.weights.owners import reset_runtimes

    root = os.path.join(folder, "flux")
    path = os.path.join(root, "transformer", "model.gguf")
    resident = reference(path)
    want, classes = run(resident), _classes(resident)
    modes = ("allgather", "rank_local") if world > 1 else ("rank_local",)
    out = {}
    for how, host_store in (("load", "memory"), ("load", "mmap"), ("offload", "memory")):
        for mode in modes:
            torch._dynamo.reset()
            reset_runtimes()
            options = {"mode": mode, "host_store": host_store}
            if how == "load":
                model = dlo_fx.load(FluxTransformer2DModel, root, subfolder="transformer",
                                    dtype=COMPUTE, options=options)
            else:
                model = dlo_fx.offload(reference(path), options=options)
            if world == 1:  # compiled at dp 2 too by `ranks_case`; here the eager read
                model.compile(backend="dlo")
            got = [torch.equal(run(model), want)]
            dlo_fx.release(model)
            got += [torch.equal(run(model), want), _classes(model) == classes]
            saved = os.path.join(folder, f"saved_{rank}")
            if how == "load":
                model.save_pretrained(saved)
                weights = load_file(os.path.join(saved, "diffusion_pytorch_model.safetensors"))
            else:
                save_file(model.state_dict(), os.path.join(folder, f"saved_{rank}.safetensors"))
                weights = load_file(os.path.join(folder, f"saved_{rank}.safetensors"))
            fresh = reference(path)
            fresh.load_state_dict(weights)
            got.append(torch.equal(run(fresh), want) and _classes(fresh) == classes)
            out[(how, host_store, mode)] = got
    return out

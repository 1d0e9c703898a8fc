"""GGUF files as checkpoints: ``dlo_fx.load(FluxTransformer2DModel, "model.gguf",
config=...)`` streams the quantized bytes of the file, exactly as diffusers'
``from_single_file(path, quantization_config=GGUFQuantizationConfig(compute_dtype=...))``
computes with them.

[Note: a GGUF file is a checkpoint like any other]
A .gguf file goes through the loader's ordinary path; only the header reading and the
model's quantized layers are GGUF's own. The header (read with the ``gguf`` package's
``GGUFReader``, which maps the file and touches only the header) gives every tensor's name,
GGML type, shape and absolute offset. Each becomes a `TensorInfo` pointing into the .gguf
file, as a safetensors header's do:

- F32 and F16 tensors are plain tensors of their dtype (torch's dim order: GGUF stores the
  dims reversed), cast to the model's dtype while they are copied, as diffusers casts them to
  ``compute_dtype``;
- every other type (Q8_0, Q4_K, ..., and BF16, which diffusers also keeps as bytes) is a
  uint8 tensor of its byte shape (the values' shape with the last dim in bytes:
  ``gguf.quants.quant_shape_to_byte_shape``, the shape diffusers' ``GGUFParameter`` has),
  carrying its ``quant_type``.

After the header: plan and shape checks, block extents into the file, both host stores,
fingerprints and the ranks' agreement read the file's own bytes. `quantize_module` runs on
the meta-built model before the plan: diffusers' own ``_replace_with_gguf_linear`` swaps
each ``nn.Linear`` whose weight the file quantizes for a ``GGUFLinear`` (with
``compute_dtype``), and that weight becomes a meta ``GGUFParameter`` of the byte shape the
model's layer needs in the file's type, so a file made for another config is a shape
mismatch that `plan_load` reports with the others. The stored parameter keeps
``quant_type`` (see [Note: a stored weight is a tensor]), and ``GGUFLinear`` dequantizes the
slot view in the graph; `dlo_fx.release` gives it back as a ``GGUFParameter`` (see [Note: a
parameter's class comes back] in runtime/weights/stored.py).

Tensor names must be the model's FQNs (the diffusers layout), or be renamed to them with
``key_map=``. A file in a model's original layout (BFL's Flux keys) is converted by
diffusers' ``checkpoint_mapping_fn`` with splits and concatenations of tensors, which are
not all byte ranges of the file (Flux's ``norm_out`` swaps the halves of a weight): such a
file must be converted to diffusers names first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from .checkpoint import Checkpoint, CheckpointError, TensorInfo

__all__ = ["is_gguf", "quantize_module", "read_gguf"]

_PLAIN = {"F32": torch.float32, "F16": torch.float16}  # as diffusers: not GGUFParameters


def _modules() -> tuple[Any, Any]:
    try:
        import gguf
        from diffusers.quantizers.gguf import utils
    except ImportError as exc:
        raise ImportError(f"dlo_fx.load: a .gguf checkpoint needs the `gguf` and `diffusers` "
                          f"packages (pip install gguf diffusers): {exc}") from exc
    return gguf, utils


def is_gguf(ckpt: Checkpoint) -> bool:
    """Whether ``ckpt`` is a GGUF file (`read_gguf`)."""
    return len(ckpt.files) == 1 and ckpt.files[0].endswith(".gguf")


def read_gguf(path: str | os.PathLike, source: str, folder: Optional[Path]) -> Checkpoint:
    """Every tensor of the GGUF file ``path``: see [Note: a GGUF file is a checkpoint like
    any other]. Raises `CheckpointError` naming the file for a file ``GGUFReader`` refuses
    (truncated or corrupt), a tensor past its end, or a GGML type diffusers cannot
    dequantize (naming the tensor and its type)."""
    gguf, utils = _modules()
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        reader = gguf.GGUFReader(path)
        listed = [(t.name, t.tensor_type, [int(d) for d in t.shape], int(t.data_offset),
                   int(t.n_bytes)) for t in reader.tensors]
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the GGUF file: {exc}") from exc
    except Exception as exc:  # GGUFReader raises ValueError, KeyError, IndexError, ...
        raise CheckpointError(f"{path}: corrupt or truncated GGUF file ({type(exc).__name__}: "
                              f"{exc}); re-download or re-write it") from None
    del reader  # its mapping of the file
    supported = set(utils.SUPPORTED_GGUF_QUANT_TYPES)
    tensors: dict[str, TensorInfo] = {}
    for name, qtype, dims, offset, nbytes in listed:
        if offset + nbytes > size:
            raise CheckpointError(f"{path}: truncated GGUF file: tensor {name!r} ends at byte "
                                  f"{offset + nbytes} but the file has {size} bytes; "
                                  "re-download or re-write it")
        shape = tuple(reversed(dims))  # GGUF lists the fastest dim first
        plain = _PLAIN.get(qtype.name)
        if plain is not None:
            tensors[name] = TensorInfo(key=name, path=path, dtype=plain, shape=shape,
                                       nbytes=nbytes, offset=offset)
            continue
        if qtype not in supported:
            raise CheckpointError(
                f"{path}: tensor {name!r} has GGML type {qtype.name}, which diffusers cannot "
                f"dequantize (it supports F32, F16 and "
                f"{', '.join(sorted(t.name for t in supported))}); re-quantize the file")
        tensors[name] = TensorInfo(
            key=name, path=path, dtype=torch.uint8, nbytes=nbytes, offset=offset,
            shape=tuple(int(d) for d in gguf.quants.quant_shape_to_byte_shape(shape, qtype)),
            quant_type=qtype, quant_shape=shape)
    return Checkpoint(source=source, files=(path,), tensors=tensors,
                      folder=str(folder) if folder is not None else None)


def quantize_module(module: nn.Module, ckpt: Checkpoint, dtype: Optional[torch.dtype],
                    by_name: dict[str, TensorInfo]) -> torch.dtype:
    """Make the meta-built ``module`` hold the quantized tensors of GGUF checkpoint ``ckpt``
    (``by_name``: its tensors by model FQN): each ``nn.Linear`` whose weight the file
    quantizes becomes diffusers' ``GGUFLinear`` computing in ``dtype`` (default float32, as
    ``GGUFQuantizationConfig``), its weight a meta ``GGUFParameter`` of the bytes the layer
    needs in the file's type. Returns the dtype the other parameters get (the compute
    dtype: ``from_single_file`` casts them to it).

    Raises NotImplementedError naming the tensors that are quantized in the file but are no
    linear layer's weight, or that diffusers would dequantize at load (in the class's
    ``_keep_in_fp32_modules``): diffusers' GGUF layers compute with neither.
    """
    gguf, utils = _modules()
    compute = dtype if dtype is not None else torch.float32
    quantized = {fqn: info for fqn, info in by_name.items() if info.quant_type is not None}
    keep = [m for m in (getattr(type(module), "_keep_in_fp32_modules", None) or []) if m]
    modules = dict(module.named_modules())
    params = {fqn for fqn, _ in module.named_parameters(remove_duplicate=False)}
    _check_names(module, ckpt, params, by_name)
    refused = []
    for fqn in quantized:
        owner, _, attr = fqn.rpartition(".")
        if fqn not in params:
            continue  # an unexpected key: plan_load reports it
        if not isinstance(modules.get(owner), nn.Linear) or attr != "weight":
            refused.append(f"{fqn!r} ({type(modules.get(owner)).__name__}.{attr})")
        elif any(m in fqn.split(".") for m in keep):
            refused.append(f"{fqn!r} (in _keep_in_fp32_modules {keep})")
    if refused:
        raise NotImplementedError(
            f"dlo_fx.load: {ckpt.source!r} quantizes tensors that diffusers' GGUF layers do "
            f"not compute with (only nn.Linear weights outside _keep_in_fp32_modules are): "
            f"{', '.join(refused[:10])}{' ...' if len(refused) > 10 else ''}; store them as "
            "F32 or F16 in the file")
    meta = {fqn: utils.GGUFParameter(torch.empty(info.shape, dtype=torch.uint8, device="meta"),
                                     quant_type=info.quant_type)
            for fqn, info in quantized.items() if fqn in params}
    utils._replace_with_gguf_linear(module, compute, meta, modules_to_not_convert=keep)
    modules = dict(module.named_modules())
    for fqn in meta:
        owner = modules[fqn.rpartition(".")[0]]
        if not isinstance(owner, utils.GGUFLinear):
            continue
        qtype = quantized[fqn].quant_type
        want = (owner.out_features, owner.in_features)
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        if want[-1] % block:  # cannot hold this type: plan_load reports the shapes
            continue
        nbytes = tuple(int(d) for d in gguf.quants.quant_shape_to_byte_shape(want, qtype))
        owner._parameters["weight"] = utils.GGUFParameter(
            torch.empty(nbytes, dtype=torch.uint8, device="meta"), quant_type=qtype)
    return compute


def _check_names(module: nn.Module, ckpt: Checkpoint, params: set[str],
                 by_name: dict[str, TensorInfo]) -> None:
    """Most of the model's parameters absent from the file: its tensors are in another
    layout (a model's original one), which this loader does not convert."""
    found = len(params & set(by_name))
    if not params or found * 2 >= len(params):
        return  # a few missing or misnamed: plan_load reports them one by one
    theirs = sorted(set(by_name) - params)[:3]
    raise ValueError(
        f"dlo_fx.load: only {found} of {type(module).__name__}'s {len(params)} parameters are "
        f"tensors of {ckpt.source!r} (its tensors are named e.g. "
        f"{', '.join(map(repr, theirs))}): GGUF files are read in the model's own (diffusers) "
        "names. Rename them with key_map= (e.g. key_map=lambda k: "
        "k.removeprefix('model.diffusion_model.')); a file in a model's original layout "
        "(BFL's Flux keys), whose tensors diffusers splits and concatenates, must be "
        "converted to diffusers names first")


def shape_text(shape: tuple[int, ...], quant_type: Any, quant_shape: Any) -> str:
    """A tensor's shape for messages: the values' shape, and for a quantized one its type
    and byte shape."""
    if quant_type is None or quant_shape is None:
        return str(list(shape))
    return f"{list(quant_shape)} ({quant_type.name}, bytes {list(shape)})"

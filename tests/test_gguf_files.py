"""GGUF files loaded by `dlo_fx.load` (a .gguf file, or a diffusers folder holding one): the
quantized bytes of the file are what the host store holds and streams, and every call,
compiled or eager, is exact against diffusers' ``from_single_file`` with
``GGUFQuantizationConfig``. See [Note: a GGUF file is a checkpoint like any other] in
dlo_fx/loading/gguf.py."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import dlo_fx
from dlo_fx.loading.checkpoint import CheckpointError
from dlo_fx.runtime.weights.owners import runtimes_holding
from dlo_fx.runtime.weights.stored import is_stored

import gguf_cases
from distributed import written_then_spawned
from gguf_cases import COMPUTE, reference, run, write_folder, write_gguf
from storage_cases import flux

pytest.importorskip("gguf")


def _flux_cls():
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel


@pytest.fixture(scope="module")
def gguf_file():
    with tempfile.TemporaryDirectory() as folder:
        yield write_folder(folder)


def test_file_and_folder_both_host_stores_exact_compiled_and_eager(gguf_file):
    from diffusers.quantizers.gguf.utils import GGUFLinear

    want = run(reference(gguf_file))
    root = os.path.dirname(os.path.dirname(gguf_file))
    folder = ((root,), {"subfolder": "transformer"})  # both host stores at dp 2 too
    for (args, kw), store in [(((gguf_file,), {}), "memory"), (((gguf_file,), {}), "mmap"),
                              (folder, "memory")]:
        torch._dynamo.reset()
        model = dlo_fx.load(_flux_cls(), *args, **kw, dtype=COMPUTE,
                            options={"host_store": store})
        layer = model.transformer_blocks[0].attn.to_q
        assert isinstance(layer, GGUFLinear) and layer.compute_dtype == COMPUTE
        assert is_stored(layer.weight) and layer.weight.dtype == torch.uint8
        assert tuple(layer.weight.shape) == (32, 34)
        assert layer.weight.quant_type.name == "Q8_0"
        assert model.context_embedder.weight.quant_type.name == "BF16"
        assert model.x_embedder.weight.dtype == COMPUTE  # F16 in the file: cast, as diffusers
        assert torch.equal(run(model), want), (kw, store)  # eager: reads the host store
        model.compile(backend="dlo")
        assert all(torch.equal(run(model), want) for _ in range(2)), (kw, store)
        store = runtimes_holding([layer.weight])[0].store
        assert store._entries[id(layer.weight)].nbytes == 32 * 34  # Q8_0 bytes, as in the file


def test_resident_quantized_weights_and_the_default_compute_dtype(gguf_file):
    """Without dtype= the compute dtype is float32, as GGUFQuantizationConfig's; a quantized
    weight kept resident is a GGUFParameter as diffusers makes it."""
    from diffusers.quantizers.gguf.utils import GGUFParameter

    want = run(reference(gguf_file, torch.float32), torch.float32)
    torch._dynamo.reset()
    model = dlo_fx.load(_flux_cls(), gguf_file, resident=["time_text_embed"])
    weight = model.time_text_embed.timestep_embedder.linear_1.weight
    assert type(weight) is GGUFParameter and weight.quant_type.name == "Q8_0"
    assert model.norm_out.linear.bias.dtype == torch.float32
    model.compile(backend="dlo")
    assert all(torch.equal(run(model, torch.float32), want) for _ in range(2))


def test_a_file_that_does_not_match_the_config_names_the_tensors(tmp_path, gguf_file):
    import gguf

    def edit(tensors):
        del tensors["proj_out.bias"]
        tensors["extra.weight"] = tensors["proj_out.weight"]
        key = "transformer_blocks.0.attn.to_q.weight"
        array = tensors[key][0]
        tensors[key] = (array[:16], gguf.GGMLQuantizationType.Q8_0)  # half the rows
        return tensors

    path = str(tmp_path / "bad.gguf")
    write_gguf(path, flux(torch.float32), edit)
    with pytest.raises(ValueError) as info:
        dlo_fx.load(_flux_cls(), path, config=os.path.dirname(gguf_file), dtype=COMPUTE)
    text = str(info.value)
    assert "'proj_out.bias'" in text and "'extra.weight'" in text
    assert ("'transformer_blocks.0.attn.to_q.weight': the model expects [32, 32] (Q8_0, bytes "
            "[32, 34]), the checkpoint holds [16, 32] (Q8_0, bytes [16, 34])") in text


def test_a_file_in_other_names_is_refused_with_a_hint_and_loads_through_key_map(tmp_path,
                                                                                 gguf_file):
    def prefixed(tensors):
        return {"model.diffusion_model." + k: v for k, v in tensors.items()}

    path = str(tmp_path / "comfy.gguf")
    write_gguf(path, flux(torch.float32), prefixed)
    config = os.path.dirname(gguf_file)
    with pytest.raises(ValueError, match="GGUF files are read in the model's own .diffusers. "
                       "names. Rename them with key_map="):
        dlo_fx.load(_flux_cls(), path, config=config)
    model = dlo_fx.load(_flux_cls(), path, config=config, dtype=COMPUTE,
                        key_map=lambda k: k.removeprefix("model.diffusion_model."))
    assert model.transformer_blocks[0].attn.to_q.weight.quant_type.name == "Q8_0"
    assert torch.equal(run(model), run(reference(gguf_file)))  # eager: no compile


def test_bad_files_are_errors_naming_the_file_tensor_or_type(tmp_path, gguf_file):
    import numpy as np

    config = os.path.dirname(gguf_file)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(gguf_file, "rb").read()[:-1000])
    with pytest.raises(CheckpointError, match="truncated.gguf.*truncated"):
        dlo_fx.load(_flux_cls(), str(truncated), config=config)

    def int_tensor(tensors):
        tensors["proj_out.bias"] = (np.zeros(4, dtype=np.int32), None)
        return tensors

    path = str(tmp_path / "int.gguf")
    write_gguf(path, flux(torch.float32), int_tensor)
    with pytest.raises(CheckpointError, match="'proj_out.bias' has GGML type I32"):
        dlo_fx.load(_flux_cls(), path, config=config)

    def quantized_bias(tensors):
        import gguf

        q8 = gguf.GGMLQuantizationType.Q8_0
        tensors["norm_out.linear.bias"] = (
            gguf.quants.quantize(np.ones(64, dtype=np.float32), q8), q8)
        return tensors

    path = str(tmp_path / "qbias.gguf")
    write_gguf(path, flux(torch.float32), quantized_bias)
    with pytest.raises(NotImplementedError, match="'norm_out.linear.bias' \\(Linear.bias\\)"):
        dlo_fx.load(_flux_cls(), path, config=config)

    from dlo_fx.loading.shards import write_shard_dir

    with pytest.raises(NotImplementedError, match="GGUF file, which is not sharded yet"):
        write_shard_dir(_flux_cls(), gguf_file, str(tmp_path / "shards"), dp=2)

    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(CheckpointError, match="several .gguf files"):
        dlo_fx.load(_flux_cls(), str(tmp_path / "two"), config=config)


def _ranks():
    return written_then_spawned(gguf_cases.write_case, gguf_cases.ranks_case)


def test_release_gives_back_gguf_parameters(gguf_file):
    """`dlo_fx.release` of the loaded file (both host stores) and of diffusers' own load of
    it, offloaded: each parameter comes back a ``GGUFParameter`` with its ``quant_type``
    (a plain uint8 ``Parameter`` before, whose ``as_tensor`` the next call missed), the
    eager call is exact, and the saved weights load back exactly."""
    folder = os.path.dirname(os.path.dirname(os.path.dirname(gguf_file)))
    for case, got in gguf_cases.release_case(0, 1, folder).items():
        assert all(got), (case, got)


def _ranks_released():
    return written_then_spawned(gguf_cases.write_case, gguf_cases.release_case, timeout=480)


@pytest.mark.spawned.with_args(_ranks_released)
def test_release_gives_back_gguf_parameters_on_two_ranks_both_modes(spawned):
    for rank, out in spawned.items():
        assert len(out) == 6, (rank, out)
        for case, got in out.items():
            assert all(got), (rank, case, got)


@pytest.mark.spawned.with_args(_ranks)
def test_two_ranks_both_modes_both_host_stores(spawned):
    for rank, out in spawned.items():
        assert len(out) == 4, rank
        for key, value in out.items():
            assert all(value), (rank, key, value)

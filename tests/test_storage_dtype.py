"""Weights stored in a low-precision dtype and cast in the graph (``storage_dtype``, and
diffusers' layerwise casting taken over): the host store, the shard files and the slots hold
the fp8 bytes, and every call is bit-identical to the same model with layerwise casting run
resident. See [Note: storing weights in another dtype] in dlo_fx/model/storage_dtype.py."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import dlo_fx
from dlo_fx.runtime.weights.owners import runtimes_holding
from dlo_fx.runtime.weights.stored import is_stored
from dlo_fx.loading.shards import rank_file
from dlo_fx.model.storage_dtype import layerwise_layers

import storage_cases
from distributed import written_then_spawned
from models import offloaded
from storage_cases import BF16, FP8, flux, ref_model, run


def _store(model):
    return runtimes_holding(list(model.parameters()))[0].store


def test_compiled_from_memory_streams_fp8_bytes_exactly():
    want = run(ref_model(flux()))
    assert not torch.equal(want, run(flux()))  # fp8 storage changes the output
    model = offloaded(flux(), {"storage_dtype": FP8})
    model.compile(backend="dlo")
    assert all(torch.equal(run(model), want) for _ in range(3))
    weight = model.transformer_blocks[0].attn.to_q.weight
    assert is_stored(weight) and weight.dtype == BF16 and model.dtype == BF16
    resident = ref_model(flux()).transformer_blocks[0].attn.to_q.weight
    assert torch.equal(weight.float(), resident.float())  # a read outside the graph: cast
    store = _store(model)
    stored = {e.fqn: e for e in store._entries.values()}
    assert stored["transformer_blocks.0.attn.to_q.weight"].dtype == FP8
    assert stored["transformer_blocks.0.ff.net.2.weight"].dtype == FP8
    # diffusers' skip patterns: everything under a module named like "norm" keeps bf16
    assert stored["transformer_blocks.0.norm1.linear.weight"].dtype == BF16
    fp8_bytes = sum(b.nbytes for b in store.blocks)
    plain = offloaded(flux())
    plain.compile(backend="dlo")
    run(plain)
    bf16_bytes = sum(b.nbytes for b in _store(plain).blocks)
    assert fp8_bytes < 0.7 * bf16_bytes  # the AdaLN (norm) linears stay bf16


def test_the_graph_casts_right_after_the_slot_view(tmp_path):
    from dlo_fx.planning.stages.identify_params import identify_params  # noqa: F401 (the stage)

    graphs = []

    def keep(gm, ctx):
        graphs.append(gm)
        return gm

    options = {"storage_dtype": FP8, "user_passes": [keep], "dump_dir": str(tmp_path)}
    model = offloaded(flux(), options)
    model.compile(backend="dlo", options=options)
    want = run(ref_model(flux()))
    assert torch.equal(run(model), want)
    casts = [n for n in graphs[0].graph.nodes if n.meta.get("dlo", {}).get("kind") == "cast"]
    assert casts and all(n.target == "to" and n.args[1] == BF16 for n in casts)
    assert all(n.args[0].meta["dlo"]["kind"] == "slot_view" for n in casts)
    assert all(n.args[0].meta["dlo"]["stored_as"] == str(FP8) for n in casts)
    # the dump reads the cast too (it raised KeyError 'slot' in the dump writer)
    code = (tmp_path / "graph_0" / "schedule.py").read_text()
    assert code.count("# dlo: cast ") == len(casts)
    assert f"stored as {FP8}" in code and f"{FP8} -> {BF16}" in code


def test_dlo_selects_the_layers_diffusers_casts():
    from diffusers import SD3Transformer2DModel, WanTransformer3DModel

    def hooked(model):
        model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=BF16)
        return {n for n, m in model.named_modules() if getattr(m, "_diffusers_hook", None)
                and m._diffusers_hook.get_hook("layerwise_casting") is not None}

    builders = [
        flux,
        lambda: SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                      attention_head_dim=8, num_attention_heads=2,
                                      joint_attention_dim=16, caption_projection_dim=16,
                                      pooled_projection_dim=16, out_channels=4),
        lambda: WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2,
                                      attention_head_dim=8, in_channels=4, out_channels=4,
                                      text_dim=16, freq_dim=16, ffn_dim=16, num_layers=2,
                                      rope_max_seq_len=32),
    ]
    for build in builders:
        assert {n for n, _ in layerwise_layers(build())} == hooked(build())


def test_a_storage_dtype_option_is_forgotten_at_release():
    """``options["storage_dtype"]`` is the runtime's choice: release forgets it (the values
    stay those fp8 holds), and an offload without it stores every weight in its own dtype."""
    model = offloaded(flux(), {"storage_dtype": FP8})
    cast = dlo_fx.state(model).storage_dtypes
    assert cast and set(cast.values()) == {FP8}
    assert f"storage_dtypes=<{len(cast)} parameters as float8_e4m3fn>" in repr(dlo_fx.state(model))
    dlo_fx.release(model)
    assert dlo_fx.state(model).released and not dlo_fx.state(model).storage_dtypes
    assert dict(dlo_fx.state(offloaded(model)).storage_dtypes) == {}
    assert {e.dtype for e in _store(model)._entries.values()} == {BF16}


def test_layerwise_casting_taken_over_before_compile_is_exact():
    want = run(ref_model(flux()))
    model = ref_model(flux())
    assert dlo_fx.take_over_layerwise_casting(model) > 0
    offloaded(model).compile(backend="dlo")
    assert all(torch.equal(run(model), want) for _ in range(2))
    assert {e.dtype for e in _store(model)._entries.values()} == {FP8, BF16}
    # dlo_fx.state names each parameter stored as fp8: the layers diffusers cast
    cast = dlo_fx.state(model).storage_dtypes
    assert set(cast.values()) == {FP8} and "transformer_blocks.0.ff.net.2.weight" in cast
    assert not any("norm" in name for name in cast)
    # release keeps the model's own choice (the hooks were its), offload takes it again
    dlo_fx.release(model)
    assert dlo_fx.state(offloaded(model)).storage_dtypes == cast
    # a model without the hooks: nothing to take over, and the user is told
    with pytest.warns(UserWarning, match="found no layerwise-casting hooks under this "
                      "FluxTransformer2DModel, so nothing changes"):
        assert dlo_fx.take_over_layerwise_casting(flux()) == 0


def test_load_casts_through_the_model_dtype_into_fp8_both_host_stores():
    from diffusers import FluxTransformer2DModel

    with tempfile.TemporaryDirectory() as folder:
        storage_cases.write_checkpoint(folder)
        root = os.path.join(folder, "flux")
        want = run(ref_model(FluxTransformer2DModel.from_pretrained(root, torch_dtype=BF16)))
        for host_store in ("memory", "mmap"):
            torch._dynamo.reset()
            for source in (root, os.path.join(folder, "fp8-dp1")):
                model = dlo_fx.load(FluxTransformer2DModel, source, dtype=BF16, options={
                    "storage_dtype": "float8_e4m3fn", "host_store": host_store})
                assert torch.equal(run(model), want), (host_store, source)
                model.compile(backend="dlo")
                assert all(torch.equal(run(model), want) for _ in range(2)), (host_store, source)
        # the fp8 shard folder holds fp8 bytes: about half of the bf16 one
        sizes = {}
        for name, options in (("bf16", {}), ("fp8", {"storage_dtype": FP8})):
            from dlo_fx.loading.shards import write_shard_dir

            out = os.path.join(folder, f"sized-{name}")
            write_shard_dir(FluxTransformer2DModel, root, out, dp=1, dtype=BF16, options=options)
            sizes[name] = os.path.getsize(os.path.join(out, rank_file(0, 1)))
        assert sizes["fp8"] < 0.7 * sizes["bf16"]
        with pytest.raises(ValueError, match="storage_dtype"):  # loaded without the option
            dlo_fx.load(FluxTransformer2DModel, os.path.join(folder, "fp8-dp1"), dtype=BF16)
        # The command a user runs writes the same folder
        import subprocess
        import sys

        out = os.path.join(folder, "cli-fp8")
        subprocess.run([sys.executable, "-m", "dlo_fx.apps.cli", "shard", root, "--dp", "1",
                        "--dtype", "bfloat16", "--storage-dtype", "float8_e4m3fn", "--out", out],
                       check=True, capture_output=True, timeout=300)
        model = dlo_fx.load(FluxTransformer2DModel, out, dtype=BF16,
                            options={"storage_dtype": "float8_e4m3fn"})
        model.compile(backend="dlo")
        assert all(torch.equal(run(model), want) for _ in range(2))


def test_bad_storage_dtypes_are_refused_naming_the_option():
    for bad in ("int8", torch.int8, "float9", 3):
        with pytest.raises(ValueError, match="storage_dtype"):
            dlo_fx.DLOConfig.from_options({"storage_dtype": bad})
    model = flux()
    with pytest.raises(ValueError, match="cannot cast between them") as info:
        offloaded(model, {"storage_dtype": torch.float4_e2m1fn_x2})
    assert "float4_e2m1fn_x2" in str(info.value)


def _ranks():
    return written_then_spawned(storage_cases.write_case, storage_cases.ranks_case)


@pytest.mark.spawned.with_args(_ranks)
def test_two_ranks_both_modes_from_memory_and_fp8_shards(spawned):
    for rank, out in spawned.items():
        for key, value in out.items():
            if key[0] == "dtypes":
                assert value == ["torch.bfloat16", "torch.float8_e4m3fn"], (rank, key)
            else:
                assert all(value), (rank, key, value)


class _BreakInLoop(torch.nn.Module):
    """A graph break inside the model's loop: Dynamo runs the model's own frame eagerly
    (its first layer before dlo's backend is ever called) and compiles each block's."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(32, 32)

        def forward(self, x):
            return torch.nn.functional.gelu(self.l(x))

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(32, 32)
        self.blocks = torch.nn.ModuleList(self.Block() for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i == 1:
                torch._dynamo.graph_break()
            x = block(x)
        return x


def _break_in_loop():
    torch.manual_seed(0)
    return _BreakInLoop().to(BF16).eval().requires_grad_(False)


def test_a_model_frame_run_eagerly_is_refused_or_taken_over_exactly():
    from diffusers.hooks import apply_layerwise_casting

    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1)).to(BF16)
    ref = _break_in_loop()
    apply_layerwise_casting(ref, FP8, BF16)
    with torch.no_grad():
        want = ref(x)
    # The option alone: compiled before dlo saw the model, the first layer ran eagerly in
    # bf16 and the first call was silently different from the layerwise-cast model. Now the
    # compile of a model never offloaded is refused, nothing changed; offloaded with the
    # option (the weights rounded before any layer runs), exact from the first call.
    model = _break_in_loop()
    before = model.inp.weight.detach().clone()
    model.compile(backend="dlo", options={"storage_dtype": FP8})
    with torch.no_grad(), pytest.raises(ValueError, match=r"dlo_fx\.offload\(model, options\)"):
        model(x)
    assert torch.equal(model.inp.weight, before)  # nothing was changed
    torch._dynamo.reset()
    model = offloaded(_break_in_loop(), {"storage_dtype": FP8})
    model.compile(backend="dlo")
    with torch.no_grad():
        assert all(torch.equal(model(x), want) for _ in range(3))
    # Prepared before compiling: exact from the first call
    torch._dynamo.reset()
    model = _break_in_loop()
    apply_layerwise_casting(model, FP8, BF16)
    dlo_fx.take_over_layerwise_casting(model)
    offloaded(model).compile(backend="dlo")
    with torch.no_grad():
        assert all(torch.equal(model(x), want) for _ in range(3))


def test_compile_pipeline_takes_over_layerwise_casting_and_applies_storage_dtype():
    import diffusers_pipelines as dp

    reference = dp.flux(0)
    reference.transformer.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    want = dp.images(reference, "flux")
    for how in ("hooks", "option"):
        torch._dynamo.reset()
        pipe = dp.flux(0)
        if how == "hooks":
            pipe.transformer.enable_layerwise_casting(storage_dtype=FP8,
                                                      compute_dtype=torch.float32)
            dlo_fx.compile_pipeline(pipe, components=["transformer"])
        else:
            dlo_fx.compile_pipeline(pipe, components=["transformer"],
                                    options={"storage_dtype": FP8})
        assert torch.equal(dp.images(pipe, "flux"), want), how
        entries = _store(pipe.transformer)._entries.values()
        assert {e.dtype for e in entries} == {FP8, torch.float32}, how


def test_offload_takes_layerwise_casting_over_and_take_over_refuses_a_stored_model():
    """The issue's case: ``enable_layerwise_casting(fp8, fp32)`` then `dlo_fx.offload` was
    accepted, its first call advised `take_over_layerwise_casting`, and following that
    advice made every call fail ("mat1 and mat2 must have the same dtype"). offload now
    takes the casting over as compile_pipeline does: every call exact against the
    layerwise-cast model resident; take_over then refuses the stored model, saying to drop
    it, and a model compiled with backend='dlo' before offload is told a way out that
    works (followed here)."""
    f32 = torch.float32

    def hooked():
        model = flux(f32)
        model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=f32)
        return model

    def call(model):
        args = {k: v.to(f32) if v.is_floating_point() else v
                for k, v in storage_cases.inputs().items()}
        with torch.no_grad():
            return model(**args).sample

    want = call(hooked())
    model = hooked()
    dlo_fx.offload(model, {"device": "cpu"})
    assert torch.equal(call(model), want)  # eager
    compiled = torch.compile(model, backend="dlo")
    assert all(torch.equal(call(compiled), want) for _ in range(2))
    assert {e.dtype for e in _store(model)._entries.values()} == {FP8, f32}
    with pytest.raises(ValueError, match=r"weights of this FluxTransformer2DModel are in a dlo "
                       r"host store already .* nothing was changed\. dlo_fx\.offload and "
                       r"dlo_fx\.compile_pipeline take the casting over themselves: drop "
                       r"this call"):
        dlo_fx.take_over_layerwise_casting(model)
    assert torch.equal(call(compiled), want)
    # compiled before any offload: refused naming offload, the model as it was (its hooks on)
    torch._dynamo.reset()
    model = hooked()
    with pytest.raises(ValueError, match=r"dlo_fx\.offload\(model, options\) first"):
        call(torch.compile(model, backend="dlo"))
    assert torch.equal(call(model), want) and dlo_fx.state(model) is None
    torch._dynamo.reset()
    dlo_fx.offload(model, {"device": "cpu"})
    compiled = torch.compile(model, backend="dlo")
    assert all(torch.equal(call(compiled), want) for _ in range(2))

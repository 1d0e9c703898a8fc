"""torchao-quantized weights stream as their inner tensors (see [Note: a quantized weight
is its inner tensors] in dlo_fx/runtime/host/layout.py): the host store and the slots hold the
int8 / fp8 data and scales, the graph rebuilds each weight from its slot views, and every
call is bit-identical to the same quantized model run resident."""

from __future__ import annotations

import pytest
import torch

import quantized_cases
from distributed import spawn
from models import offloaded
from storage_cases import flux, inputs, run


@pytest.mark.parametrize("name", ["int8", "float8"])
def test_torchao_weights_stream_exactly_with_their_quantized_bytes(name, tmp_path):
    got = quantized_cases.compare(name, {"dump_dir": str(tmp_path)}, calls=3)
    assert all(got["equal"]), got
    assert got["kinds"] == [{"int8": "Int8Tensor", "float8": "Float8Tensor"}[name]]
    torch._dynamo.reset()
    plain = offloaded(flux())
    plain.compile(backend="dlo")
    run(plain)
    from dlo_fx.runtime.weights.owners import runtimes_holding

    bf16 = sum(b.nbytes for b in runtimes_holding(list(plain.parameters()))[0].store.blocks)
    assert got["block_bytes"] < 0.75 * bf16  # the quantized linears, beside bf16 norms
    assert "# dlo: slot_view" in (tmp_path / "graph_0" / "schedule.py").read_text()  # dumped


def test_a_quantized_weight_read_outside_the_graph_is_a_dlo_error_or_exact():
    model = offloaded(quantized_cases.quantized("int8"))
    model.compile(backend="dlo")
    run(model)
    weight = model.transformer_blocks[0].attn.to_q.weight
    assert "Int8Tensor" in repr(weight)  # the stored weight, rebuilt
    state = model.state_dict()["transformer_blocks.0.attn.to_q.weight"]
    want = quantized_cases.quantized("int8").transformer_blocks[0].attn.to_q.weight
    assert torch.equal(state.qdata, want.qdata) and torch.equal(state.scale, want.scale)
    # An eager call (the module's own forward, not the compiled call) reads op by op,
    # below the torch functions torchao implements: a dlo error naming the weight
    with pytest.raises(NotImplementedError, match=r"dlo: parameter 'x_embedder.weight' \(a "
                       r"Int8Tensor\) was read outside a compiled graph"):
        with torch.no_grad():
            model.forward(**inputs())


def test_subclasses_dlo_cannot_lay_out_are_refused_naming_parameter_and_type():
    # Dynamo itself fails earlier on a subclass it cannot fake; the pass's own check is what
    # a subclass Dynamo traces but dlo cannot flatten meets.
    from dlo_fx.runtime.store_view import check_streamable

    class Opaque(torch.Tensor):  # no storage, no __tensor_flatten__
        @staticmethod
        def __new__(cls, t):
            return torch.Tensor._make_wrapper_subclass(cls, t.shape, dtype=t.dtype)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    class BrokenFlatten(Opaque):
        def __tensor_flatten__(self):
            raise RuntimeError("no inner tensors today")

        @staticmethod
        def __tensor_unflatten__(inner, ctx, size, stride):
            raise AssertionError

    with pytest.raises(ValueError, match="parameter 'blocks.0.w' is a .*Opaque, a tensor "
                       "subclass with no storage.*__tensor_flatten__"):
        check_streamable(Opaque(torch.zeros(4, 4)), "blocks.0.w")
    with pytest.raises(ValueError, match="parameter 'blocks.1.w' is a .*BrokenFlatten whose "
                       "__tensor_flatten__ failed .*no inner tensors today"):
        check_streamable(BrokenFlatten(torch.zeros(4, 4)), "blocks.1.w")
    check_streamable(torch.nn.Parameter(torch.zeros(4)), "plain")  # a plain one passes


def _ranks():
    return spawn(2, quantized_cases.ranks_case)


@pytest.mark.spawned.with_args(_ranks)
def test_two_ranks_both_modes_stream_torchao_weights_exactly(spawned):
    for rank, out in spawned.items():
        for key, got in out.items():
            assert all(got["equal"]) and got["kinds"], (rank, key, got)


def test_quantized_weights_with_compiler_inductor_are_refused_naming_the_parameter():
    model = offloaded(quantized_cases.quantized("int8"))
    model.compile(backend="dlo", options={"compiler": "inductor"})
    with pytest.raises(ValueError, match=r"dlo: parameter '[\w.]+' is a Int8Tensor .*"
                       "compiler': 'eager'"):
        run(model)

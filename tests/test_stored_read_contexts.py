"""Reads of a stored weight outside a graph under no context, ``torch.no_grad()`` and
``torch.inference_mode()``, each against the same read of the resident parameter: the same
values (`torch.equal`), dtype, shape, strides, ``requires_grad`` and inference bit, or the
same exception type where torch refuses it. Under inference_mode an op torch defines as
other ops (``to``, ``contiguous``, ``reshape``) reaches the stored weight's dispatch whole,
where it was taken for a view and refused (see [Note: a composite op reaches the
dispatch] in dlo_fx/runtime/weights/stored.py)."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dlo_fx
from dlo_fx.runtime.weights.stored import is_stored



@pytest.fixture(autouse=True)
def read_outside_a_graph_warns():
    """Every read here is outside a graph: dlo warns that each such read copies the block
    from the host store (once per model), and every test here meets that warning."""
    with pytest.warns(RuntimeWarning, match="read outside a scheduled graph"):
        yield

CONTEXTS = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad,
            "inference_mode": torch.inference_mode}

X = torch.arange(16, dtype=torch.float32).reshape(2, 8) / 7

#: name -> f(p, bias) of a stored (8, 8) float32 weight and its stored bias
READS = {
    "float": lambda p, b: p.float(),
    "half": lambda p, b: p.half(),
    "double": lambda p, b: p.double(),
    "bfloat16": lambda p, b: p.bfloat16(),
    "to(dtype)": lambda p, b: p.to(torch.float16),
    "to(own dtype)": lambda p, b: p.to(torch.float32),
    "to(dtype, copy)": lambda p, b: p.to(torch.float32, copy=True),
    "to('cpu')": lambda p, b: p.to("cpu"),
    "to('cpu', dtype)": lambda p, b: p.to("cpu", torch.float64),
    "to(other)": lambda p, b: p.to(X),
    "cpu": lambda p, b: p.cpu(),
    "type": lambda p, b: p.type(torch.float16),
    "contiguous": lambda p, b: p.contiguous(),
    "t().contiguous()": lambda p, b: p.t().contiguous(),
    "reshape": lambda p, b: p.reshape(-1),
    "t().reshape": lambda p, b: p.t().reshape(-1),
    "reshape_as": lambda p, b: p.t().reshape_as(torch.empty(4, 16)),
    "flatten": lambda p, b: p.flatten(),
    "t().flatten": lambda p, b: p.t().flatten(),
    "ravel": lambda p, b: p.t().ravel(),
    "unflatten": lambda p, b: p.unflatten(1, (2, 4)),
    "view": lambda p, b: p.view(4, 16),
    "view(dtype)": lambda p, b: p.view(torch.int32),
    "view of a bad shape": lambda p, b: p.t().view(-1),
    "clone": lambda p, b: p.clone(),
    "detach": lambda p, b: p.detach(),
    "data": lambda p, b: p.data,
    "t": lambda p, b: p.t(),
    "T": lambda p, b: p.T,
    "mT": lambda p, b: p.mT,
    "permute": lambda p, b: p.permute(1, 0),
    "transpose": lambda p, b: p.transpose(0, 1),
    "movedim": lambda p, b: p.movedim(0, 1),
    "unsqueeze": lambda p, b: p.unsqueeze(0),
    "expand": lambda p, b: b.expand(3, 8),
    "expand_as": lambda p, b: b.expand_as(p),
    "index": lambda p, b: p[1],
    "slice": lambda p, b: p[:, 2:5],
    "index list": lambda p, b: p[[0, 2, 2]],
    "index mask": lambda p, b: p[p > 0],
    "index out of range": lambda p, b: p[9],
    "narrow": lambda p, b: p.narrow(1, 2, 3),
    "select": lambda p, b: p.select(1, 3),
    "unbind": lambda p, b: p.unbind(0),
    "chunk": lambda p, b: p.chunk(3),
    "split": lambda p, b: p.split(3),
    "split sizes": lambda p, b: p.split([2, 6], dim=1),
    "tensor_split": lambda p, b: p.tensor_split(3, dim=1),
    "diagonal": lambda p, b: p.diagonal(),
    "unfold": lambda p, b: p.unfold(1, 3, 2),
    "matmul": lambda p, b: X @ p.t(),
    "matmul 1-D": lambda p, b: p @ b,
    "mm": lambda p, b: torch.mm(X, p),
    "linear": lambda p, b: F.linear(X, p, b),
    "linear no bias": lambda p, b: F.linear(X, p),
    "einsum": lambda p, b: torch.einsum("ij,kj->ik", X, p),
    "cat": lambda p, b: torch.cat([p, p]),
    "stack": lambda p, b: torch.stack([b, b]),
    "add": lambda p, b: p + 0,
    "mul": lambda p, b: p * 2,
    "sum": lambda p, b: p.sum(),
    "mean dim": lambda p, b: p.mean(1),
    "norm": lambda p, b: p.norm(),
    "softmax": lambda p, b: p.softmax(-1),
    "layer_norm": lambda p, b: F.layer_norm(X, (8,), p[0], b),
    "embedding": lambda p, b: F.embedding(torch.tensor([[1, 3], [0, 7]]), p),
    "where": lambda p, b: torch.where(p > 0, p, b),
    "flip": lambda p, b: p.flip(0),
    "roll": lambda p, b: p.roll(2),
    "repeat": lambda p, b: b.repeat(2, 1),
    "max dim": lambda p, b: p.max(1),
    "sort": lambda p, b: p.sort(1),
    "masked_fill": lambda p, b: p.masked_fill(p > 0, 0.0),
    "clone().add_": lambda p, b: p.clone().add_(1),
    "new_zeros": lambda p, b: p.new_zeros(3),
    "zeros_like": lambda p, b: torch.zeros_like(p),
    "equal": lambda p, b: torch.equal(p, p.clone()),
    "allclose": lambda p, b: torch.allclose(p, p + 0),
    "item": lambda p, b: p[0, 0].item(),
    "tolist": lambda p, b: b.tolist(),
    "numpy": lambda p, b: p.numpy(),
    "numpy(force)": lambda p, b: p.numpy(force=True),
    "detach().numpy": lambda p, b: p.detach().numpy(),
}


def _model(requires_grad: bool):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).requires_grad_(requires_grad)
    model = copy.deepcopy(ref)
    dlo_fx.offload(model, options={"device": "cpu", "block_bytes": 1, "resident_bytes": 0})
    assert all(is_stored(p) for p in model.parameters())
    model.requires_grad_(requires_grad)  # offload freezes it: a user may not
    return model, ref


def _outcome(read, layer, context):
    try:
        with CONTEXTS[context]():
            return read(layer.weight, layer.bias), None
    except Exception as exc:  # noqa: BLE001 - the test compares it
        return None, exc


def _check_same(got, want) -> None:
    if isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want), (got, want)
        for g, w in zip(got, want):
            _check_same(g, w)
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), got
        meta = lambda t: (t.dtype, t.shape, t.stride(), t.device, t.requires_grad,  # noqa: E731
                          t.is_inference())
        assert meta(got) == meta(want)
        assert torch.equal(got.detach(), want.detach()), "values"
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        assert np.array_equal(got, want)
    else:
        assert got == want, (got, want)


@pytest.mark.parametrize("requires_grad", [True, False], ids=["requires_grad", "frozen"])
@pytest.mark.parametrize("context", list(CONTEXTS))
def test_every_read_is_exact_in_every_grad_context(context, requires_grad):
    model, ref = _model(requires_grad)
    failures = []
    for name, read in READS.items():
        want, refused = _outcome(read, ref[0], context)
        got, error = _outcome(read, model[0], context)
        if refused is not None or error is not None:
            if refused is None or not isinstance(error, type(refused)):
                failures.append(f"{name}: raised {error!r}, torch: {refused!r}")
            continue
        try:
            _check_same(got, want)
        except AssertionError as exc:
            failures.append(f"{name}: differs: {exc}")
    assert not failures, "\n".join(failures)
    assert dict(model.state_dict()).keys() == dict(ref.state_dict()).keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 ref.state_dict().values()))


def test_regional_compile_of_wan_under_inference_mode_is_exact():
    """diffusers' Wan, offloaded, its blocks compiled (``compile_repeated_blocks``) and its
    own forward eager, called under inference_mode: the forward's
    ``scale_shift_table.to(temb.device)`` of a stored weight was refused as a view."""
    from zoo_models import build, by_name, outputs

    ref, inputs = build(by_name("Wan"))
    model, _ = build(by_name("Wan"))
    with torch.inference_mode():
        want = outputs(ref(**inputs))
    dlo_fx.offload(model, options={"device": "cpu", "resident_bytes": 0})
    assert is_stored(model.scale_shift_table)
    model.compile_repeated_blocks(backend="dlo")
    with torch.inference_mode():
        for _ in range(2):
            got = outputs(model(**inputs))
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    dlo_fx.release(model)

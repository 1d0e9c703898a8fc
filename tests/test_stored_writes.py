"""Every write into a stored weight outside a graph raises ValueError naming the parameter,
before anything is written to any tensor the op would write (see [Note: a stored weight is
a tensor] in dlo_fx/runtime/weights/stored.py). The op schema says what an op writes: a
``Tensor(a!)`` argument, a ``Tensor(a!)[]`` list (the foreach and fused optimizer ops,
written whole by one op) and an ``out=`` argument alike. A list write returned without a
word, its result landing in a kept copy of the block only.

The model: two linear layers offloaded onto the CPU, weights stored and biases resident, so
that a list of ``model.parameters()`` mixes stored weights and ordinary tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dlo_fx
from dlo_fx.runtime.weights.stored import is_stored

aten = torch.ops.aten


IN_A_GRAPH = {"test_a_compiled_list_write_into_a_stored_weight_is_refused"}
"""Tests whose write is traced by Dynamo: refused in the graph, nothing read outside it."""


@pytest.fixture(autouse=True)
def read_outside_a_graph_warns(request):
    """The writes read the weights first: dlo warns that each such read copies the block
    from the host store (once per model), and every test here but `IN_A_GRAPH` meets that
    warning."""
    if request.node.originalname in IN_A_GRAPH:
        yield
        return
    with pytest.warns(RuntimeWarning, match="read outside a scheduled graph"):
        yield


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    dlo_fx.offload(model, options={"device": "cpu", "block_bytes": 1, "resident_bytes": 64})
    assert [is_stored(p) for p in model.parameters()] == [True, False, True, False]
    return model, ref


def _grads(params) -> list:
    return [torch.full(p.shape, 0.5) for p in params]


def _step(make, **options):
    """A step of optimizer ``make`` over every parameter, each with a gradient."""
    def step(model):
        params = list(model.parameters())
        for p, g in zip(params, _grads(params)):
            p.grad = g
        make(params, lr=0.1, **options).step()
    return step


def _unscale(model):
    found_inf = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(
        list(model.parameters()), found_inf, torch.ones(1))


# name -> f(model): each writes into the stored weight model[0].weight (or, where it lists
# more than one, into model[2].weight too)
WRITES = {
    "foreach_mul_": lambda m: torch._foreach_mul_([m[0].weight], 2.0),
    "foreach_add_ stored second": lambda m: torch._foreach_add_([m[0].bias, m[0].weight], 1.0),
    "foreach_add_ lists": lambda m: torch._foreach_add_(
        [m[0].bias, m[0].weight], [torch.ones(8), torch.ones(8, 8)]),
    "foreach_zero_": lambda m: torch._foreach_zero_([m[0].bias, m[0].weight]),
    "foreach_copy_": lambda m: torch._foreach_copy_([m[0].bias, m[0].weight],
                                                    [torch.ones(8), torch.ones(8, 8)]),
    "foreach_lerp_ (an EMA)": lambda m: torch._foreach_lerp_(
        list(m.parameters()), [torch.zeros(p.shape) for p in m.parameters()], 0.1),
    "foreach_addcmul_": lambda m: torch._foreach_addcmul_(
        [m[0].bias, m[0].weight], [torch.ones(8), torch.ones(8, 8)],
        [torch.ones(8), torch.ones(8, 8)]),
    "foreach out=": lambda m: aten._foreach_add.List_out(
        [torch.ones(8), torch.ones(8, 8)], [torch.ones(8), torch.ones(8, 8)],
        out=[m[0].bias, m[0].weight]),
    "amp unscale": _unscale,
    "SGD foreach": _step(torch.optim.SGD, foreach=True),
    "SGD fused": _step(torch.optim.SGD, fused=True),
    "SGD momentum foreach": _step(torch.optim.SGD, momentum=0.9, foreach=True),
    "SGD": _step(torch.optim.SGD, foreach=False),
    "Adam foreach": _step(torch.optim.Adam, foreach=True),
    "Adam fused": _step(torch.optim.Adam, fused=True),
    "AdamW fused": _step(torch.optim.AdamW, fused=True),
    "out=": lambda m: torch.mul(torch.ones(8, 8), 2, out=m[0].weight),
    "out= a view": lambda m: torch.mul(torch.ones(64), 2, out=m[0].weight.view(-1)),
    "cat out=": lambda m: torch.cat([torch.ones(4, 8), torch.ones(4, 8)], out=m[0].weight),
    "copy_": lambda m: m[0].weight.copy_(torch.ones(8, 8)),
    "copy_ into a view": lambda m: m[0].weight[1].copy_(torch.ones(8)),
    "setitem": lambda m: m[0].weight.__setitem__(0, 1.0),
    "mul_": lambda m: m[0].weight.mul_(2),
    "detach().zero_()": lambda m: m[0].weight.detach().zero_(),
    "set_": lambda m: m[0].weight.set_(torch.ones(8, 8)),
    "resize_": lambda m: m[0].weight.resize_(4, 4),
    "data =": lambda m: setattr(m[0].weight, "data", torch.ones(8, 8)),
    "init.normal_": lambda m: nn.init.normal_(m[0].weight),
    "init.orthogonal_": lambda m: nn.init.orthogonal_(m[0].weight),
    "vector_to_parameters": lambda m: nn.utils.vector_to_parameters(
        torch.zeros(sum(p.numel() for p in m.parameters())), m.parameters()),
    "load_state_dict": lambda m: m.load_state_dict(
        {k: torch.zeros(v.shape) for k, v in m.state_dict().items()}),
}


@pytest.mark.parametrize("name", list(WRITES))
def test_a_write_into_a_stored_weight_is_refused_before_anything_is_written(name):
    model, ref = _model()
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"dlo: .*parameter '[02]\.weight'.*"
                                             r"dlo_fx\.release\(model\)"):
            WRITES[name](model)
        got = {n: p * 1 for n, p in model.named_parameters()}  # a read of the stored weights
    assert got.keys() == before.keys()
    unchanged = [n for n in before if torch.equal(got[n], before[n])]
    assert unchanged == list(before), f"written: {set(before) - set(unchanged)}"
    state = model.state_dict()
    assert all(torch.equal(state[n], before[n]) for n in before)
    dlo_fx.release(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_what_writes_no_weight_runs_as_on_the_resident_model():
    """Ops that read a stored weight and write only ordinary tensors: the gradients
    (``clip_grad_norm_``, foreach), a copy into a tensor of the caller's, a foreach op
    whose stored weights are read only."""
    model, ref = _model()
    out = {}
    for m in (model, ref):
        params = list(m.parameters())
        for p, g in zip(params, _grads(params)):
            p.grad = g
        norm = nn.utils.clip_grad_norm_(params, 0.1, foreach=True)
        target = [torch.zeros(p.shape) for p in params]
        with torch.no_grad():
            torch._foreach_lerp_(target, params, 0.5)
            torch._foreach_copy_(target[:1], params[:1])
            total = torch.stack(torch._foreach_norm(params))
        out[m] = (norm, [p.grad for p in params], target, total)
    (norm, grads, target, total), want = out[model], out[ref]
    assert torch.equal(norm, want[0]) and torch.equal(total, want[3])
    assert all(torch.equal(a, b) for a, b in zip(grads + target, want[1] + want[2]))


class _WritesItsWeights(nn.Sequential):
    def forward(self, x):
        torch._foreach_mul_([self[0].bias, self[0].weight], 2.0)
        return super().forward(x)


def test_a_compiled_list_write_into_a_stored_weight_is_refused():
    """The same op traced by Dynamo: refused while it traces (Dynamo wraps the error), so
    no graph writes into a slot a weight was read into; nothing is written."""
    torch.manual_seed(0)
    model = _WritesItsWeights(nn.Linear(8, 8), nn.Linear(8, 8))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dlo_fx.offload(model, options={"device": "cpu", "block_bytes": 1, "resident_bytes": 64})
    with torch.no_grad(), pytest.raises(Exception, match=r"_foreach_mul_\.Scalar would write "
                                                         r"into parameter"):
        torch.compile(model, backend="dlo")(torch.ones(2, 8))
    dlo_fx.release(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())

"""`StoredWeight` (runtime/weights/stored.py): a parameter whose weights are in the host store,
as a storage-less tensor subclass. Each read is exact and each write a ValueError naming
the parameter; Dynamo traces a module holding one and hands the backend the parameters.

The parameters here become StoredWeights after a compiled call stored their blocks
(`become_stored`, the same object): the values read back are compared with the resident
model's."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from dlo_fx.runtime.weights.owners import runtimes_holding
from dlo_fx.runtime.weights.stored import StoredWeight, become_stored, is_stored

from models import call, offloaded, tiny_dit


def _stored_model():
    ref, inputs = tiny_dit()
    model, _ = tiny_dit()
    compiled = torch.compile(offloaded(model), backend="dlo", fullgraph=True)
    assert torch.equal(call(compiled, inputs), call(ref, inputs))
    runtime = runtimes_holding(list(model.parameters()))[0]
    names = [n for n, p in model.named_parameters() if p in runtime.store and p.numel()]
    assert names
    params = dict(model.named_parameters())
    for name in names:
        become_stored(params[name])
    return ref, model, names


def test_reads_are_exact_and_warn_once():
    ref, model, names = _stored_model()
    want = dict(ref.named_parameters())
    got = dict(model.named_parameters())
    name = names[-1]
    p = got[name]
    assert is_stored(p) and isinstance(p, torch.nn.Parameter) and type(p) is StoredWeight
    assert p.shape == want[name].shape and p.stride() == want[name].stride()
    with pytest.warns(RuntimeWarning, match="read outside a scheduled graph"):
        assert torch.equal(p.sum(), want[name].detach().sum())
    with torch.no_grad():
        for n in names:
            w = want[n].detach()
            assert torch.equal(got[n].detach().clone(), w)
            assert torch.equal(got[n].float(), w.float()), n  # a cast of any dtype
            assert torch.equal(got[n].detach().t() if w.dim() == 2 else got[n].detach(),
                               w.t() if w.dim() == 2 else w)
        total = sum(t.sum() for t in model.parameters())
        assert torch.equal(total, sum(t.sum() for t in ref.parameters()))
    assert (p.detach().float().numpy() == want[name].detach().float().numpy()).all()
    assert name in repr(p)


def test_save_and_load_round_trip_the_real_weights():
    ref, model, names = _stored_model()
    p = dict(model.named_parameters())[names[0]]
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert type(loaded) is torch.nn.Parameter
    assert torch.equal(loaded, dict(ref.named_parameters())[names[0]])


def test_writes_and_conversions_are_refused_naming_the_parameter():
    _, model, names = _stored_model()
    p = dict(model.named_parameters())[names[0]]
    plain = torch.zeros(p.shape, dtype=p.dtype)
    attempts = {
        "in place": lambda: p.mul_(2),
        "through a view": lambda: p.detach().view(-1).add_(1),
        "copy_": lambda: p.copy_(plain),
        "data =": lambda: setattr(p, "data", plain),
        "deepcopy": lambda: copy.deepcopy(p),
    }
    for what, attempt in attempts.items():
        with pytest.raises(ValueError, match=repr(names[0]).replace(".", r"\.")):
            with torch.no_grad():
                attempt()
    # a conversion of the parameter (not of its module) is a read, as for any tensor
    assert p.detach().to(torch.float16).dtype == torch.float16
    with torch.no_grad():
        assert torch.equal(p.to(torch.float16), p.detach().clone().to(torch.float16))


def test_dynamo_hands_the_backend_stored_parameters():
    ref, model, names = _stored_model()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(type(v) for v in example_inputs)
        return gm.forward

    layer, ref_layer = [(m, r) for m, r in zip(model.modules(), ref.modules())
                        if isinstance(m, torch.nn.Linear) and is_stored(m.weight)][0]
    x = torch.randn(2, layer.in_features, dtype=layer.weight.dtype)
    with torch.no_grad():
        torch.compile(lambda t: t * 2, backend=backend)(x)  # no parameter: plain inputs
        assert StoredWeight not in seen

        def fn(t):
            return torch.nn.functional.linear(t, layer.weight) + 1

        # This backend runs the graph on the subclass itself: each op reads the weights
        got = torch.compile(fn, backend=backend)(x)
        assert torch.equal(got, torch.nn.functional.linear(x, ref_layer.weight) + 1)
    assert StoredWeight in seen

"""FLOPs of a Dynamo graph's matrix products (dlo_fx/planning/flops.py), and the per-block compute
time the device budget builds from them (dlo_fx/planning/stages/resident_set.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dlo_fx.planning.flops import graph_flops, node_flops
from dlo_fx.planning.stages.resident_set import block_compute_seconds, block_spans


class Products(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.up = torch.nn.ConvTranspose2d(4, 2, 3)
        self.b = torch.nn.Parameter(torch.randn(16, 4))

    def forward(self, x, p, q, c, m1, m2, qq, kk, vv, img, small):
        h = self.lin(x)  # (2, 3, 8) -> (2, 3, 16): 2 * 96 * 8 = 1536
        h = h @ self.b  # (2, 3, 4): 2 * 24 * 16 = 768
        r = torch.bmm(p, q)  # (2, 3, 4) x (2, 4, 5) -> (2, 3, 5): 2 * 30 * 4 = 240
        r = torch.baddbmm(c, p, q) + r  # 240
        s = torch.addmm(m2[0], m1, m2)  # (3, 4) x (4, 5) -> (3, 5): 2 * 15 * 4 = 120
        s = s.matmul(m2.t())  # method: (3, 5) x (5, 4) -> (3, 4): 2 * 12 * 5 = 120
        a = F.scaled_dot_product_attention(qq, kk, vv)  # 2*2*6*10*(8+4) = 2880
        y = self.conv(img)  # (1, 4, 8, 8): 2 * 256 * (3 * 3 * 3) = 13824
        z = self.up(small)  # input (1, 4, 5, 5), weight (4, 2, 3, 3): 2 * 100 * 18 = 3600
        return h.sum() + r.sum() + s.sum() + a.sum() + y.sum() + z.sum() + torch.relu(x).sum()


EXPECTED = {"linear": 1536, "matmul": 768 + 120, "bmm": 240, "baddbmm": 240, "addmm": 120,
            "scaled_dot_product_attention": 2880, "conv2d": 13824, "conv_transpose2d": 3600}


def inputs():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return (r(2, 3, 8), r(2, 3, 4), r(2, 4, 5), r(2, 3, 5), r(3, 4), r(4, 5),
            r(1, 2, 6, 8), r(1, 2, 10, 8), r(1, 2, 10, 4), r(1, 3, 8, 8), r(1, 4, 5, 5))


def captured(dynamic: bool) -> torch.fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    model = Products()
    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs())
    (gm,) = graphs
    return gm


def by_name(gm: torch.fx.GraphModule) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        n = node_flops(node)
        if n:
            name = node.target if isinstance(node.target, str) else node.target.__name__
            name = "matmul" if name in ("matmul", "__matmul__") else name
            out[name] = out.get(name, 0) + n
    return out


@pytest.mark.parametrize("dynamic", [False, True])
def test_flops_of_each_product_are_exact(dynamic):
    gm = captured(dynamic)  # dynamic: sizes are SymInts, counted at their hints
    assert by_name(gm) == EXPECTED
    costs = graph_flops(gm.graph.nodes)
    assert sum(n for n, _ in costs) == sum(EXPECTED.values())
    assert {d for n, d in costs if n} == {torch.float32}
    assert all(d is None for n, d in costs if not n)  # relu, sum, add: not counted


def test_aten_graph_counts_the_same():
    """A graph of ATen ops (``node.meta["val"]``) counts what the torch-level one does
    (linear as addmm, attention decomposed into two bmm, convolutions as convolution)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    model = Products()
    with torch.no_grad():
        gm = make_fx(model)(*inputs())
    assert sum(n for n, _ in graph_flops(gm.graph.nodes)) == sum(EXPECTED.values())


def test_block_spans_and_compute_seconds():
    # Nodes 0..7; blocks first used at nodes 2, 4 and 6: the first block takes nodes 0..3
    # (the ones before it too), the last one nodes 6..7 (up to the output).
    assert block_spans([2, 4, 6], 8) == [range(0, 4), range(4, 6), range(6, 8)]
    assert block_spans([], 8) == []
    bf16, f32 = torch.bfloat16, torch.float32
    costs = [(0, None), (100, f32), (0, None), (400, bf16), (200, bf16), (0, None),
             (0, None), (50, f32)]
    rates = {bf16: 100.0, f32: 50.0}  # FLOP/s
    flops, seconds = block_compute_seconds(costs, block_spans([2, 4, 6], 8), rates.__getitem__)
    assert flops == [500, 200, 50]
    assert seconds == [100 / 50 + 400 / 100, 2.0, 1.0]

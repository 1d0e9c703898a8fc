"""Parameters that are not a tensor of their own: views with a storage offset (q and k cut
from one fused tensor, as a state dict saved from such views and loaded with
``load_state_dict(assign=True)`` leaves them), a transposed view, a strided slice, two
parameters sharing one storage, a parameter with no elements. Each offloaded or loaded,
on every rank, against the resident model (`torch.equal`), then released."""

from __future__ import annotations

import os
import warnings

import torch
from safetensors.torch import save_file
from torch import nn

import dlo_fx


class Views(nn.Module):
    """Four linear layers whose weights are views of other tensors (see the module's
    docstring), and an empty parameter the forward reads."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.q, self.k, self.t, self.s = (nn.Linear(64, 64) for _ in range(4))
        fused = torch.randn(192, 64, generator=gen)  # q, k and an unused tail
        # What torch.load of a state dict saved from views of one tensor gives, assigned
        self.load_state_dict({"q.weight": fused[:64], "k.weight": fused[64:128]},
                             strict=False, assign=True)
        self.t.weight = nn.Parameter(torch.randn(64, 64, generator=gen).t())
        self.s.weight = nn.Parameter(torch.randn(128, 64, generator=gen)[::2])
        self.empty = nn.Parameter(torch.randn(64, 192, generator=gen)[:, 64:64])
        for layer in (self.q, self.k, self.t, self.s):
            layer.bias = nn.Parameter(torch.randn(64, generator=gen))
        self.requires_grad_(False).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.q(x)) + self.k(x)
        x = torch.cat([self.t(x), x @ self.empty], dim=-1)
        return self.s(x)


def own_tensors(model: nn.Module) -> bool:
    """Released: each view came back a tensor of its own (q at storage offset 0, apart
    from k), dense ones with their strides (t's transposed), a strided slice contiguous."""
    q, k = model.q.weight, model.k.weight
    return (q.storage_offset() == 0 and q.untyped_storage().data_ptr()
            != k.untyped_storage().data_ptr() and model.t.weight.stride() == (1, 64)
            and model.s.weight.is_contiguous() and model.empty.shape == (64, 0))


def write_case(rank: int, world: int, folder: str) -> None:
    """The resident model's weights as ``folder/views.safetensors`` (contiguous copies)."""
    path = os.path.join(folder, "views.safetensors")
    save_file({k: v.contiguous() for k, v in Views().state_dict().items()}, path)


def _call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # eager reads: slow
        return model(x)


def views_case(rank: int, world: int, folder: str) -> dict:
    """{(how, mode): [eager, compiled, compiled again, released exact, released into
    tensors of their own (`own_tensors`), moved to float64 exact, its state dict saved
    (torch.save) and loaded exact]} on this rank: ``how`` is
    "offload" or "load", ``mode`` "allgather" or "rank_local" (one rank: rank_local)."""
    import torch._dynamo

    from dlo_fx.runtime.weights.owners import reset_runtimes

    path = os.path.join(folder, "views.safetensors")  # `write_case` wrote it
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    ref = Views()
    want = _call(ref, x)
    out = {}
    for how in ("offload", "load"):
        for mode in ("allgather", "rank_local") if world > 1 else ("rank_local",):
            torch._dynamo.reset()
            reset_runtimes()
            options = {"device": "cpu", "mode": mode, "block_bytes": 1, "resident_bytes": 0}
            if how == "offload":
                model = dlo_fx.offload(Views(), options=options)
            else:
                model = dlo_fx.load(Views, path, options=options)
            got = [torch.equal(_call(model, x), want)]
            compiled = torch.compile(model, backend="dlo")
            got += [torch.equal(_call(compiled, x), want) for _ in range(2)]
            dlo_fx.release(model)
            got += [torch.equal(_call(model, x), want), own_tensors(model)]
            wide = Views().double()
            got.append(torch.equal(_call(model.double(), x.double()), _call(wide, x.double())))
            saved = os.path.join(folder, f"released_{rank}.pt")
            torch.save(model.float().state_dict(), saved)
            fresh = Views(seed=1)
            fresh.load_state_dict(torch.load(saved))
            got.append(torch.equal(_call(fresh, x), want))
            out[(how, mode)] = got
    return out

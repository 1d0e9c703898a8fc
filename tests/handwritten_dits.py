"""Hand-written DiTs whose layers are not numbered: word-keyed ``ModuleDict`` blocks,
layers as named attributes of a container, one ``Sequential`` container, a wrapped model;
with long skips, a tied weight and mixed dtypes. Each has ``DEPTH`` similar layers."""

from __future__ import annotations

import torch
from torch import nn

DEPTH = 6
WIDTH = 32
WORDS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")
LAYOUTS = ("dict", "attr", "sequential", "wrapped")


class Layer(nn.Module):
    """adaLN modulation, attention-like mixing and a diffusers-style ``ff.net`` Sequential."""

    def __init__(self, width: int, dtype: torch.dtype, skip: bool = False):
        super().__init__()
        self.adaLN = nn.Linear(width, 2 * width, dtype=torch.float32)  # float32 in any model
        self.to_q = nn.Linear(width, width, dtype=dtype)
        self.to_k = nn.Linear(width, width, dtype=dtype)
        self.to_v = nn.Linear(width, width, dtype=dtype)
        self.to_out = nn.Linear(width, width, dtype=dtype)
        self.ff = nn.Module()
        self.ff.net = nn.Sequential(nn.Linear(width, 4 * width, dtype=dtype), nn.GELU(),
                                    nn.Linear(4 * width, width, dtype=dtype))
        self.skip = nn.Linear(2 * width, width, dtype=dtype) if skip else None

    def forward(self, x: torch.Tensor, cond: torch.Tensor, skip=None) -> torch.Tensor:
        if self.skip is not None and skip is not None:
            x = self.skip(torch.cat([x, skip], dim=-1))
        shift, scale = self.adaLN(cond).to(x.dtype).chunk(2, dim=-1)
        h = x * (1 + scale[:, None]) + shift[:, None]
        q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)
        attn = torch.softmax(q @ k.transpose(1, 2) / 8.0, dim=-1)
        x = x + self.to_out(attn @ v)
        return x + self.ff.net(x)


class Trunk(nn.Module):
    """Layers as named attributes (``trunk.layer_first``, ...), called in order."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.names = [f"layer_{w}" for w in WORDS[:len(layers)]]
        for name, layer in zip(self.names, layers):
            setattr(self, name, layer)

    def __iter__(self):
        return iter([getattr(self, n) for n in self.names])

    def __len__(self):
        return len(self.names)


class HandDiT(nn.Module):
    """``DEPTH`` layers between a patch embedding and an output projection.

    layout: ``dict`` (``blocks.first``, ...), ``attr`` (``trunk.layer_first``, ...),
    ``sequential`` (``layers.0``, one ``Sequential`` container). ``skips``: U-ViT long
    skips, layer i of the second half reads the output of layer ``DEPTH - 1 - i``.
    ``tied``: the output projection reads the embedding's weight. ``mixed``: the second
    half of the layers is float32, the rest bfloat16 (``adaLN`` is float32 throughout).
    """

    def __init__(self, layout: str = "dict", skips: bool = False, tied: bool = False,
                 mixed: bool = False, depth: int = DEPTH, width: int = WIDTH):
        super().__init__()
        self.skips, self.tied = skips, tied
        dtypes = [torch.float32 if mixed and i >= depth // 2 else torch.bfloat16
                  for i in range(depth)]
        layers = [Layer(width, dt, skip=skips and i >= depth // 2) for i, dt in enumerate(dtypes)]
        self.embed = nn.Linear(width, width, dtype=torch.bfloat16)
        self.time = nn.Linear(1, width, dtype=torch.float32)
        if layout == "dict":
            self.blocks = nn.ModuleDict(zip(WORDS, layers))
        elif layout == "attr":
            self.trunk = Trunk(layers)
        elif layout == "sequential":
            self.layers = nn.Sequential(*layers)
        else:
            raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
        self.out = nn.Linear(width, width, dtype=torch.bfloat16)
        if tied:
            self.out.weight = self.embed.weight

    def layer_list(self) -> list[nn.Module]:
        if hasattr(self, "blocks"):
            return list(self.blocks.values())
        if hasattr(self, "trunk"):
            return list(self.trunk)
        return list(self.layers)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        cond = self.time(t[:, None])
        h = self.embed(x.to(torch.bfloat16))
        layers = self.layer_list()
        saved = []
        for i, layer in enumerate(layers):
            skip = saved[len(layers) - 1 - i] if self.skips and i >= len(layers) // 2 else None
            h = layer(h, cond, skip)
            if i < len(layers) // 2:
                saved.append(h)
            h = h.to(torch.bfloat16) if i + 1 < len(layers) and \
                layers[i + 1].to_q.weight.dtype == torch.bfloat16 else h.float()
        return self.out(h.to(torch.bfloat16)).float()


class Wrapped(nn.Module):
    """The whole DiT inside one attribute: ``model.blocks.first``, ..."""

    def __init__(self, **kw):
        super().__init__()
        self.model = HandDiT(layout="dict", **kw)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.model(x, t)

    def layer_list(self) -> list[nn.Module]:
        return self.model.layer_list()


def build(layout: str = "dict", seed: int = 0, **kw) -> nn.Module:
    """A model with deterministic weights, in eval mode, without gradients."""
    model = Wrapped(**kw) if layout == "wrapped" else HandDiT(layout=layout, **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype))
    return model.eval().requires_grad_(False)


def inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 8, WIDTH, generator=gen), torch.tensor([0.25, 0.75])


def layer_bytes(model: nn.Module) -> int:
    """Bytes of the largest layer (each parameter's storage)."""
    return max(sum(p.numel() * p.element_size() for p in layer.parameters())
               for layer in model.layer_list())

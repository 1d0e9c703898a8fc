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
    model = construct(layout, **kw)
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


def construct(layout: str = "dict", **kw) -> nn.Module:
    """The model's constructor only (for ``dlo_fx.load``: weights come from a checkpoint)."""
    return Wrapped(**kw) if layout == "wrapped" else HandDiT(layout=layout, **kw)


def save(model: nn.Module, path: str) -> str:
    """Its state dict as one safetensors file (a tied weight saved under both names)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous().clone() for k, v in model.state_dict().items()}, path)
    return path


# -- running them ---------------------------------------------------------------------------
FEATURES = {"skips": True, "tied": True, "mixed": True}


def layer_of(model: nn.Module) -> dict[str, int]:
    """FQN -> index of the layer holding it, for every parameter inside a layer."""
    ids = {id(p): i for i, layer in enumerate(model.layer_list()) for p in layer.parameters()}
    return {name: ids[id(p)] for name, p in model.named_parameters() if id(p) in ids}


def figures(model: nn.Module, blocks: list[list[str]]) -> dict:
    """Block count, whether every layer sits whole in one block that holds no other layer,
    and the slot bytes of the runtime holding ``model``."""
    from models import runtime_figures

    layer = layer_of(model)
    per_block = [{layer[f] for f in b if f in layer} for b in blocks]
    homes = [[i for i, ls in enumerate(per_block) if n in ls] for n in range(len(model.layer_list()))]
    return {"blocks": len(blocks),
            "layers_whole": all(len(h) == 1 for h in homes) and all(len(ls) <= 1 for ls in per_block),
            "layer_bytes": layer_bytes(model), **{k: v for k, v in runtime_figures(model).items()
                                                 if k in ("slot_bytes", "max_block_bytes", "mode")}}


def run(layout: str, options: dict, *, ckpt: str = "", calls: int = 2, **kw) -> dict:
    """Compile (after `dlo_fx.load` from ``ckpt`` when given) and compare ``calls`` outputs
    with the resident model; the figures of the blocks the runtime holds."""
    import dlo_fx
    from models import call
    from dlo_fx.runtime.weights.owners import reset_runtimes, runtimes_holding

    torch._dynamo.reset()
    reset_runtimes()
    ref = build(layout, **kw)
    x = inputs()
    with torch.no_grad():
        expected = call(ref, x)
    from dlo_fx.config import split_options

    # each option to its verb: the runtime's to load or offload, the compile's to the compile
    runtime_options, options = split_options(options)
    if ckpt:
        model = dlo_fx.load(lambda: construct(layout, **kw), ckpt, options=runtime_options)
    else:
        model = dlo_fx.offload(build(layout, **kw), runtime_options)
    compiled = torch.compile(model, backend="dlo", options=options, fullgraph=True)
    with torch.no_grad():
        equal = all(torch.equal(call(compiled, x), expected) for _ in range(calls))
    store = runtimes_holding(list(model.parameters()))[0].store
    return {"equal": equal, **figures(model, [[e.fqn for e in b.entries] for b in store.blocks])}


def save_built(path: str, layout: str, **kw) -> str:
    """`save` of `build(layout, **kw)` to ``path``."""
    return save(build(layout, **kw), path)


def dp2_cases(rank: int, world: int, folder: str) -> dict:
    """Both modes, one through compile and one through load, on every rank of a 2-rank
    group (each compile is the slow part)."""
    return {"dict-features-allgather": run("dict", {"mode": "allgather"}, **FEATURES),
            "attr-load-rank_local": run("attr", {"mode": "rank_local"},
                                        ckpt=f"{folder}/attr.safetensors")}

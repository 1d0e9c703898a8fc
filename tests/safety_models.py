"""Models for the safety tests: eager frames, failures injected into a graph, tiny diffusers
transformers with graph breaks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.fx.node import has_side_effect

from models import _init


@torch._dynamo.disable
def _eager(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


class EagerHeadDiT(nn.Module):
    """Layers traced by Dynamo, then a head that runs once eagerly (a disabled helper) and
    once inside the graph of the resumed frame: after the first call its parameters are
    stored when the eager code reads them."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        x = _eager(self.head, x)
        return self.head(x) + x


class IndexedBlock(nn.Module):
    """A block that reads its own parameter and branches on its layer index before a graph
    break: Dynamo guards the index, so it compiles this frame once per layer and, past its
    recompile limit (8), runs the later layers' frames eagerly."""

    def __init__(self, index: int, width: int = 16) -> None:
        super().__init__()
        self.index = index
        self.linear = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.ones(width))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x) * self.scale
        if self.index % 3 == 0:
            x = x * 2
        torch._dynamo.graph_break()
        return self.out(x)


class IndexedDiT(nn.Module):
    """Ten `IndexedBlock` layers and a head. The graph break in the loop makes Dynamo skip
    this forward: it runs eagerly, and so does the head it calls."""

    def __init__(self, depth: int = 10, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(IndexedBlock(i, width) for i in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def indexed_dit(seed: int = 0):
    torch.manual_seed(seed)
    model = _init(IndexedDiT(), seed)
    return model, (torch.randn(2, 16, generator=torch.Generator().manual_seed(seed + 1)),)


def eager_head_dit(seed: int = 0):
    torch.manual_seed(seed)
    model = _init(EagerHeadDiT(), seed)
    return model, (torch.randn(2, 64, generator=torch.Generator().manual_seed(seed + 1)),)


def tiny_hidream(seed: int = 0):
    """HiDream: several graphs per forward (``.item()`` breaks), MoE feed-forwards."""
    from diffusers import HiDreamImageTransformer2DModel

    torch.manual_seed(seed)
    model = HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2,
        attention_head_dim=8, num_attention_heads=4, caption_channels=[8, 4], text_emb_dim=8,
        num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(4, 2, 2),
        max_resolution=(32, 32), llama_layers=[0, 1, 0, 1])
    _init(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return model, dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=gen), timesteps=torch.tensor([500]),
        encoder_hidden_states_t5=torch.randn(1, 6, 8, generator=gen),
        encoder_hidden_states_llama3=torch.randn(2, 1, 6, 4, generator=gen),
        pooled_embeds=torch.randn(1, 8, generator=gen), return_dict=False)


def tiny_hunyuan_video_15(seed: int = 0):
    """HunyuanVideo 1.5: the frame resumed after ``if is_t2v:`` runs an embedding eagerly."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16,
        num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=16,
        text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(4, 6, 6), target_size=32,
        task_type="i2v")
    _init(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return model, dict(
        hidden_states=torch.randn(1, 9, 1, 4, 4, generator=gen), timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 5, 16, generator=gen),
        encoder_attention_mask=torch.ones(1, 5),
        encoder_hidden_states_2=torch.randn(1, 3, 8, generator=gen),
        encoder_attention_mask_2=torch.ones(1, 3),
        image_embeds=torch.randn(1, 4, 12, generator=gen), return_dict=False)


# -- failures injected into a scheduled graph ---------------------------------------------
FAIL = {"rank": None, "at": -1, "kind": "index", "seen": 0}


def _maybe_fail(x: torch.Tensor) -> None:
    """Raise on rank ``FAIL["rank"]`` at the ``FAIL["at"]``-th execution of this node."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != FAIL["rank"]:
        return
    FAIL["seen"] += 1
    if FAIL["seen"] != FAIL["at"]:
        return
    if FAIL["kind"] == "interrupt":
        raise KeyboardInterrupt
    torch.nn.functional.embedding(torch.tensor([10**6]), x.reshape(-1, 1))  # out of range


has_side_effect(_maybe_fail)


def fail_after_half_the_waits(gm, ctx):
    """User pass: a `_maybe_fail` node after half of the graph's waits."""
    waits = [n for n in gm.graph.nodes if n.meta.get("dlo", {}).get("kind") == "wait"]
    if waits:
        view = next(iter(waits[len(waits) // 2].users))  # a weight of that block
        with gm.graph.inserting_after(view):
            gm.graph.call_function(_maybe_fail, (view,))
    return gm

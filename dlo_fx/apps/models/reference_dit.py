"""A small, deterministic Diffusion Transformer used as a reference workload.

The model is deliberately shaped like a production text-to-image DiT so that a
weight-streaming compiler backend meets the same patterns it meets in real
models:

* joint attention over text and image tokens with rotary position embeddings;
* adaLN-Zero style modulation, including a ``modulation_table`` parameter that
  every block reads, so one parameter is used at many points of the graph;
* a float32 timestep embedding living inside a bfloat16 model;
* a non-persistent float32 buffer (``rope_freqs``) used by every block;
* a non-contiguous parameter (each block's ``fc2_weight`` is stored transposed);
* optionally, a graph break in the middle of every block.

Parameters are registered in the order in which ``forward`` first uses them,
with two exceptions that ``named_parameters`` ordering makes unavoidable:
``modulation_table`` is a direct parameter of the model, so it is listed before
every submodule's parameters, yet it is first used just after
``blocks.0.adaLN``; and each block's ``fc2_weight``/``fc2_bias`` are direct
parameters of the block, so they are listed before the block's submodules'
parameters, yet they are used last in the block.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import torch_private

__all__ = ["DiTBlock", "DiTConfig", "ReferenceDiT", "example_inputs", "reference_dit"]

_TIME_FEATURES = 256
_POSITIVE_INT_FIELDS = ("width", "depth", "heads", "patch_size", "in_channels", "text_dim", "text_len")


@dataclass(frozen=True)
class DiTConfig:
    """Hyper-parameters of :class:`ReferenceDiT`."""

    width: int = 256
    """Hidden size of every token. Must be a multiple of ``heads``. Default: 256."""
    depth: int = 4
    """Number of transformer blocks. Default: 4."""
    heads: int = 4
    """Number of attention heads; ``width // heads`` must be even. Default: 4."""
    mlp_ratio: float = 4.0
    """MLP hidden size as a multiple of ``width``. Default: 4.0."""
    patch_size: int = 2
    """Side of the square latent patch that becomes one token. Default: 2."""
    in_channels: int = 4
    """Channels of the input (and output) latents. Default: 4."""
    text_dim: int = 64
    """Feature size of the incoming text tokens. Default: 64."""
    text_len: int = 8
    """Number of text tokens :func:`example_inputs` makes by default. Default: 8."""
    dtype: torch.dtype = torch.bfloat16
    """Dtype of every parameter except the timestep embedding. Default: torch.bfloat16."""
    graph_break_in_blocks: bool = False
    """Insert ``torch._dynamo.graph_break()`` between attention and MLP. Default: False."""

    def __post_init__(self) -> None:
        for name in _POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DiTConfig.{name}={value!r} is invalid: it must be a positive int")
        ratio = self.mlp_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
            raise ValueError(f"DiTConfig.mlp_ratio={ratio!r} is invalid: it must be a positive number")
        if int(self.width * ratio) < 1:
            raise ValueError(
                f"DiTConfig.mlp_ratio={ratio!r} is invalid: width * mlp_ratio must be at least 1 "
                f"(width={self.width})"
            )
        if self.width % self.heads != 0:
            raise ValueError(
                f"DiTConfig.width={self.width} is invalid: it must be a multiple of heads={self.heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"DiTConfig.heads={self.heads} is invalid: head_dim = width // heads = {self.head_dim} "
                "must be even for rotary embeddings"
            )
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"DiTConfig.dtype={self.dtype!r} is invalid: it must be a floating torch.dtype")
        if not isinstance(self.graph_break_in_blocks, bool):
            raise ValueError(
                f"DiTConfig.graph_break_in_blocks={self.graph_break_in_blocks!r} is invalid: it must be a bool"
            )

    @property
    def head_dim(self) -> int:
        """Feature size of one attention head."""
        return self.width // self.heads

    @property
    def mlp_hidden(self) -> int:
        """Hidden size of each block's MLP."""
        return int(self.width * self.mlp_ratio)


def _rope_frequencies(head_dim: int) -> Tensor:
    """Rotary inverse frequencies for ``head_dim`` features, float32, shape [head_dim // 2]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return 1.0 / (10000.0**exponents)


def _timestep_features(timestep: Tensor) -> Tensor:
    """Sinusoidal float32 features of ``timestep`` [B], shape [B, 256]."""
    half = _TIME_FEATURES // 2
    steps = torch.arange(half, dtype=torch.float32, device=timestep.device)
    freqs = torch.exp(-math.log(10000.0) * steps / half)
    args = timestep.float()[:, None] * freqs[None, :]
    return torch.cat((torch.cos(args), torch.sin(args)), dim=-1)


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of ``x`` [B, H, T, D] by the angles behind ``cos``/``sin`` [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """Apply per-sample ``shift``/``scale`` [B, W] to tokens ``x`` [B, T, W]."""
    return x * (1 + scale[:, None, :]) + shift[:, None, :]


class DiTBlock(nn.Module):
    """One joint-attention transformer block with adaLN-Zero modulation."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        width, hidden, dtype = config.width, config.mlp_hidden, config.dtype
        self.heads = config.heads
        self.graph_break = config.graph_break_in_blocks
        self.adaLN = nn.Linear(width, 6 * width, dtype=dtype)
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width, dtype=dtype)
        self.proj = nn.Linear(width, width, dtype=dtype)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.fc1 = nn.Linear(width, hidden, dtype=dtype)
        # Stored transposed: shape [width, hidden] with stride (1, width).
        self.fc2_weight = nn.Parameter(torch.empty(hidden, width, dtype=dtype).t())
        self.fc2_bias = nn.Parameter(torch.empty(width, dtype=dtype))

    def attention(self, x: Tensor, rope_freqs: Tensor) -> Tensor:
        """Multi-head self-attention with rotary embeddings over ``x`` [B, T, W]."""
        batch, tokens, width = x.shape
        qkv = self.qkv(x).view(batch, tokens, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        positions = torch.arange(tokens, dtype=torch.float32, device=x.device)
        angles = positions[:, None] * rope_freqs[None, :]
        cos, sin = torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, width))

    def forward(self, x: Tensor, cond: Tensor, modulation_table: Tensor, rope_freqs: Tensor) -> Tensor:
        """Update tokens ``x`` [B, T, W] given the activated conditioning ``cond`` [B, W]."""
        batch, _, width = x.shape
        mod = self.adaLN(cond).view(batch, 6, width) + modulation_table
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.unbind(1)
        x = x + gate1[:, None, :] * self.attention(_modulate(self.norm1(x), shift1, scale1), rope_freqs)
        if self.graph_break:
            torch_private.graph_break()
        h = F.gelu(self.fc1(_modulate(self.norm2(x), shift2, scale2)), approximate="tanh")
        return x + gate2[:, None, :] * F.linear(h, self.fc2_weight, self.fc2_bias)


class ReferenceDiT(nn.Module):
    """A small Diffusion Transformer over latents [B, C, H, W] conditioned on time and text.

    Parameters are left uninitialised; call :meth:`init_weights` (or build the
    model with :func:`reference_dit`).
    """

    def __init__(self, config: DiTConfig | None = None, **overrides: object) -> None:
        super().__init__()
        config = dataclasses.replace(config or DiTConfig(), **overrides)
        self.config = config
        width, dtype, p = config.width, config.dtype, config.patch_size
        self.patch_embed = nn.Linear(config.in_channels * p * p, width, dtype=dtype)
        self.time_embed = nn.Sequential(
            nn.Linear(_TIME_FEATURES, width), nn.SiLU(), nn.Linear(width, width)
        ).float()
        self.text_proj = nn.Linear(config.text_dim, width, dtype=dtype)
        self.modulation_table = nn.Parameter(torch.empty(6, width, dtype=dtype))
        self.register_buffer("rope_freqs", _rope_frequencies(config.head_dim), persistent=False)
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.depth))
        self.norm_out = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.final_adaLN = nn.Linear(width, 2 * width, dtype=dtype)
        self.proj_out = nn.Linear(width, p * p * config.in_channels, dtype=dtype)

    def patchify(self, latents: Tensor) -> Tensor:
        """Turn latents [B, C, H, W] into tokens [B, (H/p)*(W/p), p*p*C]."""
        batch, channels, height, width = latents.shape
        p = self.config.patch_size
        if height % p or width % p:
            raise ValueError(f"latent height={height} and width={width} must be multiples of patch_size={p}")
        x = latents.reshape(batch, channels, height // p, p, width // p, p)
        return x.permute(0, 2, 4, 3, 5, 1).reshape(batch, (height // p) * (width // p), p * p * channels)

    def unpatchify(self, tokens: Tensor, height: int, width: int) -> Tensor:
        """Inverse of :meth:`patchify`: tokens [B, N, p*p*C] back to latents [B, C, H, W]."""
        p, channels = self.config.patch_size, self.config.in_channels
        x = tokens.reshape(tokens.shape[0], height // p, width // p, p, p, channels)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(tokens.shape[0], channels, height, width)

    def forward(self, latents: Tensor, timestep: Tensor, text: Tensor) -> Tensor:
        """Predict from ``latents`` [B, C, H, W], ``timestep`` [B] and ``text`` [B, L, text_dim].

        Returns a tensor shaped like ``latents`` in the model dtype.
        """
        dtype = self.config.dtype
        height, width = latents.shape[-2:]
        image = self.patch_embed(self.patchify(latents.to(dtype)))
        temb = self.time_embed(_timestep_features(timestep)).to(dtype)
        text_tokens = self.text_proj(text.to(dtype))
        cond = F.silu(temb)
        x = torch.cat((text_tokens, image), dim=1)
        for block in self.blocks:
            x = block(x, cond, self.modulation_table, self.rope_freqs)
        x = x[:, text_tokens.shape[1] :]
        shift, scale = self.final_adaLN(cond).chunk(2, dim=-1)
        x = self.proj_out(_modulate(self.norm_out(x), shift, scale))
        return self.unpatchify(x, height, width)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> ReferenceDiT:
        """Fill every parameter deterministically from ``seed``; returns ``self``.

        Weights are drawn from N(0, 0.02), biases from N(0, 0.01) and the shared
        ``modulation_table`` from N(0, 0.1). Values are drawn on the CPU in
        float32 in registration order, so they do not depend on device or dtype.
        """
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name == "modulation_table":
                std = 0.1
            elif name.endswith("bias"):
                std = 0.01
            else:
                std = 0.02
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            param.copy_(values)
        return self


def example_inputs(
    config: DiTConfig,
    *,
    batch: int = 1,
    height: int = 16,
    width: int = 16,
    text_len: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[Tensor, Tensor, Tensor]:
    """Deterministic ``(latents, timestep, text)`` for a model built from ``config``.

    ``latents`` is [batch, in_channels, height, width] and ``text`` is
    [batch, text_len, text_dim], both in ``config.dtype``; ``timestep`` is a
    float32 [batch] tensor in [0, 1000). The image gives
    ``(height / patch_size) * (width / patch_size)`` tokens.
    """
    p = config.patch_size
    if height % p or width % p:
        raise ValueError(f"height={height} and width={width} must be multiples of patch_size={p}")
    length = config.text_len if text_len is None else text_len
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, config.in_channels, height, width, generator=generator)
    timestep = torch.rand(batch, generator=generator) * 1000.0
    text = torch.randn(batch, length, config.text_dim, generator=generator)
    return (
        latents.to(device=device, dtype=config.dtype),
        timestep.to(device=device),
        text.to(device=device, dtype=config.dtype),
    )


def reference_dit(
    *,
    width: int = 256,
    depth: int = 4,
    heads: int = 4,
    seed: int = 0,
    device: str | torch.device = "cpu",
    **kw: object,
) -> ReferenceDiT:
    """Build an initialised :class:`ReferenceDiT` in eval mode with gradients disabled.

    Extra keyword arguments are further :class:`DiTConfig` fields.
    """
    model = ReferenceDiT(DiTConfig(width=width, depth=depth, heads=heads, **kw))
    model.init_weights(seed)
    return model.to(device).eval().requires_grad_(False)

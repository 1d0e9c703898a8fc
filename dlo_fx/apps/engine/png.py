"""A dependency-free PNG writer (zlib + struct) and a latent preview for it."""

from __future__ import annotations

import os
import struct
import zlib
from typing import Union

import torch


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def encode_png(rgb: torch.Tensor) -> bytes:
    """PNG bytes of an 8-bit RGB image ``rgb`` [H, W, 3] (uint8)."""
    if rgb.dtype != torch.uint8 or rgb.dim() != 3 or rgb.shape[2] != 3:
        raise ValueError(f"encode_png expects a uint8 tensor [H, W, 3], got {rgb.dtype} "
                         f"{list(rgb.shape)}")
    height, width, _ = rgb.shape
    rows = bytes(rgb.contiguous().flatten().tolist())
    stride = width * 3
    raw = b"".join(b"\x00" + rows[y * stride : (y + 1) * stride] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit truecolour
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b""))


def latents_preview(latents: torch.Tensor, min_size: int = 128) -> torch.Tensor:
    """A uint8 RGB picture [H, W, 3] of one latent [C, h, w]: its first three channels
    (repeated when fewer), each stretched to 0..255, enlarged by an integer factor to at
    least ``min_size`` pixels on the short side."""
    if latents.dim() != 3:
        raise ValueError(f"latents_preview expects one latent [C, h, w], got "
                         f"{list(latents.shape)}")
    x = latents.detach().float().cpu()
    x = x[[i % x.shape[0] for i in range(3)]]
    lo = x.amin(dim=(1, 2), keepdim=True)
    hi = x.amax(dim=(1, 2), keepdim=True)
    x = ((x - lo) / (hi - lo).clamp_min(1e-12) * 255.0).round().to(torch.uint8)
    scale = max(1, -(-min_size // min(x.shape[1:])))
    x = x.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)
    return x.permute(1, 2, 0).contiguous()


def write_png(path: Union[str, os.PathLike], rgb: torch.Tensor) -> None:
    """Write ``rgb`` [H, W, 3] uint8 as a PNG file."""
    with open(path, "wb") as f:
        f.write(encode_png(rgb))

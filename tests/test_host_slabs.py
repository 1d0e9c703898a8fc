"""Pinned host shards packed into power-of-two slabs (`runtime/host_slabs.py`), tested on
CPU through the platform layer: `platform.pinned_slab` is replaced by an allocator that
grants what PyTorch's caching host allocator grants (the next power of two)."""

from __future__ import annotations

import pytest
import torch

from dlo_fx import memory_report
from dlo_fx.loading.loader import load
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.runtime import platform
from dlo_fx.runtime.host_slabs import SLAB_MAX, HostSlabs
from loader_cases import SHARED, fresh, resident_dit, save_dit
from models import call, tiny_dit


def fake_pinned(device: str, granted: list):
    def pinned_slab(nbytes: int) -> torch.Tensor:
        size = platform.pinned_held_bytes(nbytes)
        granted.append(size)
        if device == "meta":
            return torch.empty(size, dtype=torch.uint8, device=device)
        raw = torch.empty(size + 4096, dtype=torch.uint8)  # page aligned, as pinned memory is
        skip = -raw.data_ptr() % 4096
        return raw[skip : skip + size]
    return pinned_slab


def test_held_bytes_are_the_next_power_of_two():
    assert [platform.pinned_held_bytes(n) for n in (1, 2, 3, 4096, 4097, 680 << 20)] == \
        [1, 2, 4, 4096, 8192, 1 << 30]


def test_flux_sized_shards_pin_what_they_use(monkeypatch):
    granted: list[int] = []
    monkeypatch.setattr(platform, "pinned_slab", fake_pinned("meta", granted))
    # FLUX.1-dev in bfloat16: 19 double blocks of 680 MB, 38 single blocks of 283 MB
    sizes = [680_000_000] * 19 + [283_000_000] * 38 + [5_000_000] * 3
    slabs = HostSlabs()
    views = [slabs.take(n) for n in sizes]
    assert [v.numel() for v in views] == sizes
    assert slabs.requested == sum(sizes) and slabs.allocated == sum(granted)
    one_each = sum(platform.pinned_held_bytes(n) for n in sizes)  # pin_memory() per shard
    assert one_each / sum(sizes) > 1.4
    assert slabs.allocated - slabs.requested <= SLAB_MAX + 2 * 680_000_000
    assert slabs.allocated / slabs.requested < 1.1 and len(slabs.slabs) < 30


def test_small_shards_pack_disjoint_aligned_and_zeroed(monkeypatch):
    granted: list[int] = []
    monkeypatch.setattr(platform, "pinned_slab", fake_pinned("cpu", granted))
    slabs = HostSlabs(alignment=256)
    sizes = [1, 300, 70_000, 4096, 3 << 20, 12, 1 << 20]
    views = []
    for n in sizes:
        v = slabs.take(n)
        assert v.numel() == n and v.data_ptr() % 256 == 0 and not v.any()
        v.fill_(len(views) + 1)  # disjoint: no later take overwrites an earlier one
        views.append(v)
    assert all(bool((v == i + 1).all()) for i, v in enumerate(views))
    assert slabs.allocated == sum(granted) and all(g & (g - 1) == 0 for g in granted)
    assert slabs.allocated < 2 * sum(sizes) + (2 << 20)


def test_pinned_memory_store_packed_bit_identical_and_reported(tmp_path, monkeypatch):
    granted: list[int] = []
    monkeypatch.setattr(platform, "pinned_slab", fake_pinned("cpu", granted))
    monkeypatch.setattr(platform, "can_pin", lambda device: True)
    path, config = save_dit(str(tmp_path))
    fresh()
    model = load(ReferenceDiT, path, config=config, resident=SHARED)
    compiled = torch.compile(model, backend="dlo")
    inputs = tiny_dit()[1]
    with torch.no_grad():
        expected = call(resident_dit(path, config), inputs)
        assert all(torch.equal(call(compiled, inputs), expected) for _ in range(2))
    report = memory_report(model)
    assert report.pinned_requested_bytes == report.host_shard_bytes > 0
    assert report.pinned_allocated_bytes == sum(granted) >= report.pinned_requested_bytes
    assert "pinned_allocated_bytes" in str(report)
    fresh()

"""Pinned host shards packed into power-of-two slabs (`runtime/host/host_slabs.py`), tested on
CPU through the platform layer: `platform.pinned_slab` is replaced by an allocator that
grants what PyTorch's caching host allocator grants (the next power of two)."""

from __future__ import annotations

import pytest
import torch

from dlo_fx import memory_report
from dlo_fx.loading.loader import load
from dlo_fx.apps.models import ReferenceDiT
from dlo_fx.runtime.device import platform
from dlo_fx.runtime.host.host_slabs import SLAB_MAX, HostSlabs
from loader_cases import SHARED, fresh, resident_dit, save_dit
from models import call, offloaded, tiny_dit


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


# -- exact pinning: registered slabs ([Note: pinned slabs]) ---------------------------------
# FLUX.1-dev's transformer/config.json (benchmarks/gpu_check.py's FLUX_DEV): width 24 heads
# x 128, MLP 4x the width. A double block's parameters and a single block's, in diffusers'
# FluxTransformer2DModel (679,662,592 and 283,183,616 bytes in bfloat16).
FLUX_WIDTH, FLUX_MLP, FLUX_HEAD = 24 * 128, 4 * 24 * 128, 128


def flux_block_shapes(kind: str) -> list[tuple[int, ...]]:
    w, m, h = FLUX_WIDTH, FLUX_MLP, FLUX_HEAD
    linear = lambda o, i: [(o, i), (o,)]  # noqa: E731
    if kind == "double":
        return (linear(6 * w, w) * 2 + [(h,)] * 4 + linear(w, w) * 8
                + (linear(m, w) + linear(w, m)) * 2)
    return linear(3 * w, w) + linear(m, w) + linear(w, w + m) + [(h,)] * 2 + linear(w, w) * 3


def flux_shard_sizes(dp: int, alignment: int = 256) -> list[int]:
    """This rank's host shard sizes of FLUX.1-dev in bfloat16, as the host store lays the
    blocks out (19 double blocks, 38 single ones)."""
    from dlo_fx.runtime.host.host_store import HostStore

    store = HostStore(alignment=alignment, dp=dp)
    sizes = {}
    for kind in ("double", "single"):
        params = [torch.empty(s, dtype=torch.bfloat16, device="meta")
                  for s in flux_block_shapes(kind)]
        _, spec = store.layout(params, [f"p{i}" for i in range(len(params))])
        sizes[kind] = store.shard_size(spec)
    return [sizes["double"]] * 19 + [sizes["single"]] * 38


class Registrar:
    """A fake `platform.host_register` / `host_unregister` pair: the host memory is real,
    its registration recorded (or refused, ``fail``)."""

    def __init__(self, monkeypatch, fail: bool = False) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail = fail
        monkeypatch.setattr(platform, "can_register", lambda: True)
        monkeypatch.setattr(platform, "host_register", self.register)
        monkeypatch.setattr(platform, "host_unregister", self.unregister)

    def register(self, ptr: int, nbytes: int) -> None:
        assert ptr % platform.PAGE == 0 and nbytes % platform.PAGE == 0
        if self.fail:
            raise RuntimeError("cudaHostRegister of %d bytes failed: out of memory (error 2)"
                               % nbytes)
        self.registered.append((ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)

    def each_unregistered_once(self) -> bool:
        return sorted(self.unregistered) == sorted(p for p, _ in self.registered)


def fake_registered(granted: list):
    """`platform.registered_slab` on the meta device: the page-rounded size, no memory."""
    def registered_slab(nbytes: int, device=None) -> torch.Tensor:
        size = -(-nbytes // platform.PAGE) * platform.PAGE
        granted.append(size)
        return torch.empty(size, dtype=torch.uint8, device="meta")
    return registered_slab


def test_flux_shard_sizes_are_the_published_configs():
    sizes = flux_shard_sizes(1)
    assert sizes[0] == 679_662_592 and sizes[-1] == 283_183_616  # every tensor 256-aligned
    assert flux_shard_sizes(2)[0] == sizes[0] // 2 and flux_shard_sizes(2)[-1] == sizes[-1] // 2


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("announced", [True, False])
def test_flux_shards_registered_pin_what_they_use(monkeypatch, dp, announced):
    granted: list[int] = []
    monkeypatch.setattr(platform, "registered_slab", fake_registered(granted))
    monkeypatch.setattr(platform, "pinned_slab", lambda n: pytest.fail("power-of-two slab"))
    sizes = flux_shard_sizes(dp) + [5_000_000] * 3 + [4096, 70_000]
    slabs = HostSlabs(alignment=256, exact=True)
    if announced:  # what `Runtime.store_blocks` and the loader do
        slabs.reserve(sizes)
    views = [slabs.take(n) for n in sizes]
    assert [v.numel() for v in views] == sizes
    assert slabs.requested == sum(sizes) and slabs.allocated == sum(granted)
    assert slabs.allocated / slabs.requested <= 1.001
    if announced:  # packed in order into slabs of at most SLAB_MAX, exactly filled
        assert len(slabs.slabs) <= sum(sizes) // SLAB_MAX + 2
        assert all(s.free < platform.PAGE for s in slabs.slabs)
    else:  # one slab per shard (the small ones in small slabs: two here)
        assert len(slabs.slabs) == len(sizes)


@pytest.mark.parametrize("announced", [True, False])
def test_many_small_shards_share_a_few_registered_slabs(monkeypatch, announced):
    """A model of many small blocks stored one by one (a graph Dynamo reuses for every
    layer announces one block at a time): a few regions, not one per block."""
    granted: list[int] = []
    monkeypatch.setattr(platform, "registered_slab", fake_registered(granted))
    slabs = HostSlabs(alignment=256, exact=True)
    sizes = [10_240 + 256 * (i % 7) for i in range(2000)]
    for n in sizes:
        if announced:
            slabs.reserve([n])
        slabs.take(n)
    assert slabs.allocated == sum(granted) and len(granted) <= 16
    assert slabs.allocated - slabs.requested <= slabs.requested
    assert not any(s.reserved for s in slabs.slabs)


@pytest.mark.parametrize("fail", [False, True])
def test_flux_shards_power_of_two_where_registration_is_unavailable_or_fails(monkeypatch, fail):
    granted: list[int] = []
    monkeypatch.setattr(platform, "pinned_slab", fake_pinned("meta", granted))
    sizes = flux_shard_sizes(1)
    if fail:  # registration refused: a warning, then the old policy for good
        Registrar(monkeypatch, fail=True)
        slabs = HostSlabs(alignment=256)
        with pytest.warns(RuntimeWarning, match="falling back to power-of-two"):
            slabs.reserve(sizes)
        assert slabs.exact is False
    else:
        monkeypatch.setattr(platform, "can_register", lambda: False)
        slabs = HostSlabs(alignment=256)
        slabs.reserve(sizes)  # nothing to reserve: the slabs grow as they are taken
    for n in sizes:
        slabs.take(n)
    assert slabs.allocated == sum(granted) and all(g & (g - 1) == 0 for g in granted)
    assert 1.05 < slabs.allocated / slabs.requested < 1.1  # FLUX.1-dev: 1.09x


def test_a_registered_slab_is_exact_page_locked_and_unregistered_when_its_last_view_dies(
        monkeypatch):
    import gc

    calls = Registrar(monkeypatch)
    slab = platform.registered_slab(10_000)
    assert slab.numel() == 3 * platform.PAGE and slab.device.type == "cpu"
    assert calls.registered == [(slab.data_ptr(), 3 * platform.PAGE)]
    view = slab[100:200]
    view.fill_(7)
    del slab
    gc.collect()
    assert calls.unregistered == []  # a view still reads it
    assert int(view.sum()) == 700
    del view
    gc.collect()
    assert calls.each_unregistered_once()


def test_a_refused_registration_leaves_nothing_registered(monkeypatch):
    calls = Registrar(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        platform.registered_slab(1 << 20)
    assert calls.registered == [] and calls.unregistered == []


def pinned_dit(tmp_path, monkeypatch, **fakes):
    """The tiny DiT loaded into a pinned memory store (``pin`` forced on the CPU)."""
    monkeypatch.setattr(platform, "can_pin", lambda device: True)
    path, config = save_dit(str(tmp_path))
    model = load(ReferenceDiT, path, config=config, resident=SHARED)
    return model, resident_dit(path, config)


def exact_against_resident(model, resident) -> None:
    inputs = tiny_dit()[1]
    compiled = torch.compile(model, backend="dlo")
    with torch.no_grad():
        expected = call(resident, inputs)
        assert all(torch.equal(call(compiled, inputs), expected) for _ in range(2))


@pytest.mark.parametrize("end", ["release", "collect"])
def test_the_store_registers_what_it_uses_and_unregisters_it_once(tmp_path, monkeypatch, end):
    import gc

    import dlo_fx

    calls = Registrar(monkeypatch)
    monkeypatch.setattr(platform, "pinned_slab", lambda n: pytest.fail("power-of-two slab"))
    fresh()
    model, resident = pinned_dit(tmp_path, monkeypatch)
    assert len(calls.registered) == 1  # the loader announced every block: one slab
    exact_against_resident(model, resident)
    report = memory_report(model)
    assert report.pinned_requested_bytes == report.host_shard_bytes > 0
    assert report.pinned_allocated_bytes == sum(n for _, n in calls.registered)
    assert report.pinned_allocated_bytes - report.pinned_requested_bytes < platform.PAGE
    assert calls.unregistered == []
    if end == "release":
        dlo_fx.release(model)
        gc.collect()
        assert calls.each_unregistered_once()
        with torch.no_grad():  # eager again, on its own weights
            assert torch.equal(call(model, tiny_dit()[1]), call(resident, tiny_dit()[1]))
    else:
        del model
        fresh()
        gc.collect()
        assert calls.each_unregistered_once()
    fresh()
    gc.collect()
    assert calls.each_unregistered_once()  # and never again


def test_a_refused_registration_falls_back_with_a_warning_and_stays_exact(tmp_path, monkeypatch):
    calls = Registrar(monkeypatch, fail=True)
    granted: list[int] = []
    monkeypatch.setattr(platform, "pinned_slab", fake_pinned("cpu", granted))
    fresh()
    with pytest.warns(RuntimeWarning, match="falling back to power-of-two pin_memory slabs"):
        model, resident = pinned_dit(tmp_path, monkeypatch)
    exact_against_resident(model, resident)
    report = memory_report(model)
    assert report.pinned_requested_bytes == report.host_shard_bytes > 0
    assert report.pinned_allocated_bytes == sum(granted) >= report.pinned_requested_bytes
    assert granted and all(g & (g - 1) == 0 for g in granted)
    assert calls.registered == [] and calls.unregistered == []
    fresh()


def test_a_registered_slab_waits_for_its_device_before_it_is_unregistered(monkeypatch):
    """A stream waits for a copy from the slab, the host does not: the device finishes
    them before the memory stops being page-locked."""
    import gc

    calls = Registrar(monkeypatch)
    order: list[str] = []
    monkeypatch.setattr(platform, "has_streams", lambda device: device.type == "cuda")
    monkeypatch.setattr(platform, "synchronize", lambda device: order.append(f"sync {device}"))
    monkeypatch.setattr(platform, "host_unregister", lambda ptr: order.append("unregister"))
    slab = platform.registered_slab(4096, torch.device("cuda", 1))
    assert len(calls.registered) == 1 and order == []
    del slab
    gc.collect()
    assert order == ["sync cuda:1", "unregister"]


@pytest.mark.filterwarnings("ignore:dlo.*read by no compiled graph")
@pytest.mark.parametrize("graph_break", [False, True])
def test_a_compiled_model_registers_what_it_uses(monkeypatch, graph_break):
    """Stored by its first call (`backend.commit` announces each graph's new blocks; with a
    graph break in every block, Dynamo's graph for the next block stores one at a time)."""
    import gc

    from dlo_fx.runtime.weights.owners import owner_of

    calls = Registrar(monkeypatch)
    monkeypatch.setattr(platform, "can_pin", lambda device: True)
    monkeypatch.setattr(platform, "pinned_slab", lambda n: pytest.fail("power-of-two slab"))
    fresh()
    model, inputs = tiny_dit(graph_break=graph_break)
    with torch.no_grad():
        expected = call(model, inputs)
        compiled = torch.compile(offloaded(model), backend="dlo")
        assert all(torch.equal(call(compiled, inputs), expected) for _ in range(2))
    slabs = owner_of(model.parameters()).store.slabs
    report = memory_report(model)
    assert report.pinned_requested_bytes == report.host_shard_bytes == slabs.requested > 0
    assert report.pinned_allocated_bytes == sum(n for _, n in calls.registered)
    assert len(calls.registered) <= 4
    if not graph_break:
        assert report.pinned_allocated_bytes - report.pinned_requested_bytes < platform.PAGE
    del slabs, compiled, model
    fresh()
    gc.collect()
    assert calls.each_unregistered_once()


def test_slabs_reserved_for_blocks_a_failed_store_drops_are_let_go(monkeypatch):
    import gc

    from dlo_fx.runtime.host.host_store import HostStore

    calls = Registrar(monkeypatch)
    store = HostStore(alignment=256, pin=True)
    blocks = [([torch.zeros(1 << 20)], ["w0"]), ([torch.zeros(1 << 20)], ["w1"])]
    store.reserve(blocks)
    assert len(calls.registered) == 1 and store.slabs.allocated == 8 << 20
    store.add_block(*blocks[0])
    store.drop_blocks(0)  # the second was never added: its room stays in the used slab
    assert store.slabs.allocated == 8 << 20
    store.reserve(blocks[1:])
    store.drop_blocks(1)  # nothing taken from the new slab: let go
    assert len(calls.registered) == 2 and store.slabs.allocated == 8 << 20
    gc.collect()
    assert calls.unregistered == [calls.registered[1][0]]
    del store
    gc.collect()
    assert calls.each_unregistered_once()


def test_host_register_checks_the_return_code_and_clears_the_error(monkeypatch):
    """Through `torch.cuda.cudart()`'s bindings (faked here): a refusal raises, naming the
    CUDA error, after consuming it; unregistering never raises."""
    import types

    results = {"register": 2, "unregister": 0}
    seen: list = []
    rt = types.SimpleNamespace(
        cudaError=types.SimpleNamespace(success=0),
        cudaGetErrorString=lambda err: {2: "out of memory", 4: "unloading"}[err],
        cudaHostRegister=lambda ptr, n, flags: seen.append(("register", ptr, n, flags))
        or results["register"],
        cudaHostUnregister=lambda ptr: seen.append(("unregister", ptr)) or results["unregister"])
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    cleared: list[int] = []
    monkeypatch.setattr(platform, "_clear_cuda_error", lambda: cleared.append(1))
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 8192 bytes failed: out of "
                                           r"memory \(error 2\)"):
        platform.host_register(4096, 8192)
    assert seen == [("register", 4096, 8192, 1)] and cleared == [1]
    results["register"] = 0
    platform.host_register(4096, 8192)
    platform.host_unregister(4096)
    assert cleared == [1] and seen[-1] == ("unregister", 4096)
    results["unregister"] = 4
    platform.host_unregister(4096)  # logged, not raised
    assert cleared == [1, 1]

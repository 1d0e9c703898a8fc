"""The platform layer: the one module that knows accelerator names.

Everything else goes through the generic accelerator API (`torch.accelerator`,
`torch.Stream`, `torch.Event`, `torch.get_device_module`) or through the functions here.
Weight gathers run on a group made from the caller's process group, so they use its
backend (NCCL on CUDA and ROCm, HCCL on Ascend NPUs, XCCL on Intel XPUs, gloo on CPU).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import weakref
from typing import Iterator, Optional

import torch

log = logging.getLogger(__name__)


def accelerator() -> Optional[torch.device]:
    """The accelerator this build can use, or None (CPU only)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator()
    return None


def default_device() -> torch.device:
    return accelerator() or torch.device("cpu")


def missing_device(device: torch.device) -> Optional[str]:
    """Why dlo cannot compute on ``device`` on this machine (a clause naming what it has
    instead), or None where it can: the CPU, the meta device, and the accelerator this build
    uses, at an index it has."""
    if device.type in HOST_LIKE:
        return None
    acc = accelerator()
    if acc is None:
        return f"PyTorch here has no {device.type} device (no accelerator: the CPU only)"
    if device.type != acc.type:
        return f"this machine's accelerator is {acc.type}, not {device.type}"
    count = torch.get_device_module(acc.type).device_count()
    if device.index is not None and not 0 <= device.index < count:
        return f"this machine has {count} {acc.type} device(s) ({acc.type}:0 to {acc.type}:{count - 1})"
    return None


def exchange_device(pg) -> torch.device:
    """Where small control tensors for process group ``pg`` must live: the CPU when the
    group's backend serves CPU tensors (gloo), the current accelerator otherwise."""
    import torch.distributed as dist

    backend = str(dist.get_backend(pg)).lower()
    return torch.device("cpu") if "gloo" in backend else default_device()


HOST_LIKE = ("cpu", "meta")
"""Devices without streams or memory of their own to measure: the host, and the meta
device (a compute device that plans and traces but holds no values)."""


def has_streams(device: torch.device) -> bool:
    """Whether ``device`` is an accelerator (streams, events, its own memory): not one of
    `HOST_LIKE`."""
    return device.type not in HOST_LIKE


def can_pin(device: torch.device) -> bool:
    """Whether host shards for ``device`` should be page-locked."""
    return has_streams(device) and accelerator() is not None


def pinned_held_bytes(nbytes: int) -> int:
    """Bytes PyTorch's caching host allocator holds for a pinned request of ``nbytes``: the
    next power of two (what `pinned_slab` asks for, so that nothing is held unseen)."""
    return 1 << max(nbytes - 1, 0).bit_length()


def pinned_slab(nbytes: int) -> torch.Tensor:
    """Page-locked host bytes from PyTorch's caching host allocator (``pin_memory``; where
    `registered_slab` is unavailable or refused): ``pinned_held_bytes(nbytes)`` of them, all
    usable. Raises RuntimeError where the platform cannot pin that much. See [Note: pinned
    slabs] in host/host_slabs.py."""
    with torch.inference_mode(False):
        return torch.empty(pinned_held_bytes(nbytes), dtype=torch.uint8, pin_memory=True)


PAGE = mmap.PAGESIZE
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device


def can_register() -> bool:
    """Whether this build page-locks ordinary host memory in place: CUDA and ROCm
    (``cudaHostRegister`` / ``hipHostRegister``, which torch exposes through
    `torch.cuda.cudart`), on an OS with anonymous private mappings. See [Note: pinned
    slabs] in host/host_slabs.py."""
    acc = accelerator()
    if acc is None or acc.type != "cuda" or not hasattr(mmap, "MAP_PRIVATE"):
        return False
    try:
        rt = torch.cuda.cudart()
    except (AttributeError, RuntimeError, AssertionError):
        return False
    return hasattr(rt, "cudaHostRegister") and hasattr(rt, "cudaHostUnregister")


def _clear_cuda_error() -> None:
    """Consume the error a failed registration left as this thread's last CUDA error, so
    that the next kernel launch's check does not report it as its own. torch exposes no
    ``cudaGetLastError``; a tiny kernel launch's check reads it (raising, and so clearing
    it) where one is pending, and does nothing where none is."""
    for _ in range(2):
        try:
            torch.zeros(1, device="cuda").add_(1)
            return
        except RuntimeError:
            continue


def host_register(ptr: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of ordinary host memory at ``ptr`` (page aligned). Raises
    RuntimeError, the CUDA error state cleared, where the platform refuses."""
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE)
    if err != rt.cudaError.success:
        what = rt.cudaGetErrorString(err)
        _clear_cuda_error()
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {what} "
                           f"(error {int(err)})")


def host_unregister(ptr: int) -> None:
    """Undo `host_register` at ``ptr``. Runs in a finalizer: logs a failure, never raises."""
    try:
        rt = torch.cuda.cudart()
        err = rt.cudaHostUnregister(ptr)
        if err != rt.cudaError.success:
            log.warning("dlo: cudaHostUnregister(%#x) failed: %s", ptr,
                        rt.cudaGetErrorString(err))
            _clear_cuda_error()
    except Exception as exc:  # interpreter shutdown, a torn-down CUDA context
        log.debug("dlo: cudaHostUnregister(%#x) failed: %s", ptr, exc)


def _unregister_then_unmap(ptr: int, mapping: mmap.mmap, device: Optional[torch.device]) -> None:
    # A copy issued from the slab may still run on the device (a stream waits on it, the
    # host does not): it finishes before the memory stops being page-locked. Explicit,
    # outside steady state (a store released or collected).
    if device is not None and has_streams(device):
        try:
            synchronize(device)
        except Exception as exc:
            log.debug("dlo: synchronising %s before cudaHostUnregister failed: %s", device, exc)
    host_unregister(ptr)  # before the memory goes: ``mapping`` is held until here
    try:
        mapping.close()
    except BufferError:  # something still exports it: the mapping goes with it
        pass


def registered_slab(nbytes: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Page-locked host bytes, exactly ``nbytes`` rounded up to a page: an anonymous private
    mapping, registered with `host_register`, unregistered (then unmapped) by a finalizer
    when the tensor's storage dies, that is when the last view of it does, once the copies
    ``device`` (the one the slab feeds, if known) has queued are done. Raises
    RuntimeError where the platform cannot register it. See [Note: pinned slabs] in
    host/host_slabs.py."""
    size = -(-max(nbytes, 1) // PAGE) * PAGE
    try:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise RuntimeError(f"mapping {size} bytes of host memory failed: {exc}") from exc
    if hasattr(mmap, "MADV_DONTFORK"):  # as CUDA's own pinned memory: a forked child gets
        try:  # none of it (rather than copying every page-locked page at the fork)
            mapping.madvise(mmap.MADV_DONTFORK)
        except OSError:
            pass
    with torch.inference_mode(False):
        slab = torch.frombuffer(mapping, dtype=torch.uint8)
    ptr = slab.data_ptr()
    try:
        host_register(ptr, size)
    except BaseException:
        del slab
        with contextlib.suppress(BufferError):
            mapping.close()
        raise
    weakref.finalize(slab.untyped_storage(), _unregister_then_unmap, ptr, mapping,
                     device).atexit = False
    return slab


def host_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A host uint8 buffer that device copies read from (page-locked when ``pin``)."""
    with torch.inference_mode(False):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def new_stream(device: torch.device) -> torch.Stream:
    return torch.Stream(device=device)


def current_stream(device: torch.device) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def new_event(device: torch.device, timing: bool = False) -> torch.Event:
    return torch.Event(device=device, enable_timing=timing)


def device_free_bytes(device: torch.device) -> Optional[tuple[int, int]]:
    """(free, total) memory of one device as its driver reports it (None on CPU)."""
    if not has_streams(device):
        return None
    try:
        free, total = torch.get_device_module(device).mem_get_info(device)
    except (AttributeError, RuntimeError):
        return None
    return int(free), int(total)


@contextlib.contextmanager
def on_stream(stream: torch.Stream) -> Iterator[None]:
    """Make ``stream`` current for the work issued inside."""
    with stream:
        yield


def synchronize(device: torch.device) -> None:
    """Host-blocking: only at compile time (slot growth), never in steady state."""
    torch.accelerator.synchronize(device)


def _memory_call(name: str, device: torch.device):
    """``torch.accelerator.<name>(device)`` where this torch has it, else the device
    module's (``torch.cuda.<name>``); None on the CPU and the meta device, or where neither
    exists."""
    if not has_streams(device):
        return None
    acc = getattr(torch, "accelerator", None)
    fn = getattr(acc, name, None) if acc is not None else None
    if fn is None:
        fn = getattr(torch.get_device_module(device), name, None)
    if fn is None:
        return None
    try:
        return fn(device)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def memory_allocated(device: torch.device) -> Optional[int]:
    """Bytes the caching allocator hands out on ``device`` now (None on CPU / meta)."""
    value = _memory_call("memory_allocated", device)
    return None if value is None else int(value)


def max_memory_allocated(device: torch.device) -> Optional[int]:
    """The allocator's peak on ``device`` since the last `reset_peak_memory` (None on
    CPU / meta: the auto budget then takes the declared capacity and a simulated peak)."""
    value = _memory_call("max_memory_allocated", device)
    return None if value is None else int(value)


def oom_count(device: torch.device) -> Optional[int]:
    """How many allocations on ``device`` have failed with an out-of-memory error in this
    process (the caching allocator's ``num_ooms``); None on CPU / meta. The device module's
    nested statistics where it has them (no flattening: read at every call under the auto
    budget), else ``torch.accelerator.memory_stats``."""
    if not has_streams(device):
        return None
    nested = getattr(torch.get_device_module(device), "memory_stats_as_nested_dict", None)
    try:
        stats = nested(device) if nested is not None else _memory_call("memory_stats", device)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    value = stats.get("num_ooms") if isinstance(stats, dict) else None
    return None if value is None else int(value)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for `max_memory_allocated` (nothing on CPU / meta)."""
    _memory_call("reset_peak_memory_stats", device)


def free_and_total(device: torch.device) -> Optional[tuple[int, int]]:
    """(free, total) bytes of ``device`` as its driver reports them; None on CPU / meta."""
    value = _memory_call("get_memory_info", device)
    if value is None:
        return device_free_bytes(device)
    free, total = value
    return int(free), int(total)


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """Total memory of one device (None on CPU)."""
    if not has_streams(device):
        return None
    try:
        return int(torch.get_device_module(device).get_device_properties(device).total_memory)
    except (AttributeError, RuntimeError):
        return None


@contextlib.contextmanager
def sync_debug(device: torch.device, mode: str = "error") -> Iterator[None]:
    """Raise on any host-blocking synchronisation inside (where the platform can tell)."""
    module = torch.get_device_module(device)
    setter = getattr(module, "set_sync_debug_mode", None)
    getter = getattr(module, "get_sync_debug_mode", None)
    if setter is None or getter is None:
        raise NotImplementedError(f"{device.type} has no sync debug mode")
    previous = getter()
    setter(mode)
    try:
        yield
    finally:
        setter(previous)

"""The executor contract on CPU, pinning, the platform boundary and the GPU check script."""

from __future__ import annotations

import pathlib
import re
import tempfile
import threading
import warnings

import pytest
import torch

import benchmark_cases
from distributed import spawn

from dlo_fx.runtime.device import platform
from dlo_fx.runtime.device.executor import CpuExecutor, DeviceExecutor, FaultDelay, make_executor
from dlo_fx.runtime.host.host_store import HostStore

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cpu_executor_runs_tasks_in_issue_order_and_inlines_small_copies():
    ex = CpuExecutor()
    seen: list[tuple[str, str]] = []
    big = ex.inline_bytes
    handles = [ex.copy(0, lambda: seen.append(("copy", threading.current_thread().name)), big),
               ex.gather(0, lambda: seen.append(("gather", threading.current_thread().name)),
                         None)]
    for h in handles:
        ex.wait(h)
    assert [k for k, _ in seen] == ["copy", "gather"]
    assert all(name.startswith("dlo-copy") for _, name in seen)
    assert ex.copy(1, lambda: seen.append(("small", threading.current_thread().name)), 16) is None
    assert seen[-1][1] == threading.current_thread().name
    ex.shutdown()


def test_fault_delay_always_goes_through_the_worker():
    ex = make_executor(torch.device("cpu"), 2)
    delay = FaultDelay(0.001, ex)  # what a runtime with fault_delay_s passes
    handle = ex.copy(0, lambda: None, 1, None, delay.next())
    assert handle is not None
    ex.wait(handle)
    ex.shutdown()


def test_fault_delay_is_refused_where_streams_order_the_slots():
    streams = DeviceExecutor.__new__(DeviceExecutor)  # a device's executor, no stream made
    with pytest.raises(NotImplementedError, match="fault_delay is a CPU-runtime test hook"):
        FaultDelay(0.001, streams)
    assert FaultDelay(0.0, streams).next() is None  # no delay asked: nothing to refuse


def test_pinning_failure_warns_and_falls_back():
    store = HostStore(alignment=256, pin=True)
    param = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
    expected = param.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block = store.add_block([param], ["w"])
    if platform.accelerator() is None:  # CPU-only build: pinning cannot work
        assert any("pinning" in str(w.message) for w in caught)
        assert not block.shard.is_pinned() and not store.pin
    entry = block.entries[0]
    assert torch.equal(entry.view_of(block.shard), expected)


def test_cpu_runtime_pins_nothing():
    assert not platform.can_pin(torch.device("cpu"))


def test_no_module_outside_the_platform_layer_calls_cuda():
    pattern = re.compile(r"torch\.cuda|\.cuda\(|torch_npu|torch\.xpu|torch\.npu")
    offenders = []
    for path in (ROOT / "dlo_fx").rglob("*.py"):
        if path.name == "platform.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def _gpu_check():
    with tempfile.TemporaryDirectory() as folder:
        return spawn(1, benchmark_cases.gpu_check_on_cpu, folder, timeout=600)[0]


@pytest.mark.spawned.with_args(_gpu_check)
def test_gpu_check_runs_on_cpu(spawned):
    """The script's `main`, in a forked child (a subprocess would import torch again): every
    section at tiny sizes, exit 0, the figures it reports present and measured."""
    rc, result, printed = spawned
    assert rc == 0, printed
    assert result["failures"] == [], printed
    identity = result["identity"]
    assert identity["load + compile (reference DiT)"] is True
    assert identity["compile_pipeline (tiny FluxPipeline)"] is True
    assert all(v is True or v.startswith("not run") for v in identity.values()), identity
    flux = result["flux"]["resolutions"]
    assert len(flux) == 2
    first, second = flux.values()
    for res in (first, second):
        assert res["label"] in ("compute-bound", "transfer-bound")
        assert res["phase 1"]["floor_ms"] > 0
        dlo = res["variants"]["dlo 2 slots"]
        assert dlo["bit_identical"] is True and dlo["over_resident"] > 0 and dlo["over_floor"] > 0
        assert dlo["plan"]["predicted_step_ms"] > 0 and dlo["plan"]["hardware"] == "h200"
        assert res["variants"]["dlo auto budget"]["bit_identical"] is True
        assert "group offload (CPU: no streams)" in res["variants"]
    assert first["variants"]["dlo 3 slots"]["bit_identical"] is True
    assert first["variants"]["dlo fp8"]["step_ms"] > 0
    half = first["variants"]["dlo half budget"]  # device_budget = half the model's bytes
    # which blocks (if any) fit and pay off at tiny sizes depends on the machine's figures
    assert half["bit_identical"] is True and half["resident_blocks"] < half["num_blocks"]
    assert half["predicted_step_ms"] > 0 and half["measured_over_predicted"] > 0
    assert "dlo 3 slots" not in second["variants"] and result["flux"]["dropped"]
    child = result["host_rss_child"]
    assert child["peak_rss"] > 0 and child["host_store_bytes"] > 0, child
    assert result["wan"]["variants"]["dlo 2 slots"]["bit_identical"] is True
    assert "| dlo 2 slots |" in printed

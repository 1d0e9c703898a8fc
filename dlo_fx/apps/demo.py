"""`dlo-fx demo`: the main job on the built-in reference DiT.

Builds a reference DiT of a few hundred MB, runs it resident and through
``torch.compile(backend="dlo")``, checks the outputs are bit-identical, and prints the
memory report and the latency ratio.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from ..loading.offload import offload
from ..model.memory import memory_report
from .models import example_inputs, reference_dit


CPU_COPIES = ("on a CPU the copy into a slot is a memcpy (and, with ranks, the gather of a "
              "block's other shards is gloo over loopback TCP), on the cores that compute, so "
              "it adds to the compute instead of hiding under it; on a GPU the copy engine and "
              "the interconnect run beside the compute (docs/benchmarks.md)")
"""Why a streamed run on a CPU is slower than the resident model: the demos print it."""


def _median_latency(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_demo(*, width: int = 1024, depth: int = 12, heads: int = 16, size: int = 16,
             runs: int = 3) -> int:
    torch.manual_seed(0)
    resident = reference_dit(width=width, depth=depth, heads=heads, seed=0)
    weights = sum(p.numel() * p.element_size() for p in resident.parameters())
    print(f"reference DiT: width {width}, {depth} layers, {weights / 2**20:.0f} MiB of weights")
    streamed = copy.deepcopy(resident)
    inputs = example_inputs(resident.config, batch=1, height=size, width=size, seed=0)
    offload(streamed, {"device": "cpu"})  # where the inputs are
    compiled = torch.compile(streamed, backend="dlo", fullgraph=True)
    eager = torch.compile(resident, backend="eager", fullgraph=True)
    with torch.inference_mode():
        start = time.perf_counter()
        out = compiled(*inputs)
        compile_s = time.perf_counter() - start
        ref = eager(*inputs)
        identical = torch.equal(out, ref)
        dlo_s = _median_latency(lambda: compiled(*inputs), runs)
        ref_s = _median_latency(lambda: eager(*inputs), runs)
        identical &= torch.equal(compiled(*inputs), ref)
    print(f"first call (compile + run): {compile_s:.1f} s")
    print(f"bit-identical to the resident model: {identical}")
    print(f"latency: dlo {dlo_s * 1e3:.1f} ms, resident {ref_s * 1e3:.1f} ms, "
          f"ratio {dlo_s / ref_s:.3f} (median of {runs})")
    if dlo_s > ref_s:
        print(f"why slower: {CPU_COPIES}")
    print(memory_report(streamed))
    return 0 if identical else 1

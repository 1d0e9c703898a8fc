"""torchao-quantized models streamed by dlo, run in their own processes: a tiny diffusers
Flux quantized with torchao (its linear layers; norms and embeddings keep bf16), compiled
with ``backend="dlo"``, against the same quantized model run resident."""

from __future__ import annotations

import torch

from storage_cases import flux, run


def configs() -> dict:
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    return {"int8": Int8WeightOnlyConfig(), "float8": Float8WeightOnlyConfig()}


def quantized(name: str) -> torch.nn.Module:
    from torchao.quantization import quantize_

    model = flux()
    quantize_(model, configs()[name])
    return model


def compare(name: str, options: dict, calls: int = 2) -> dict:
    """Bit-identity of ``calls`` calls, and the host bytes against the bf16 model's."""
    from dlo_fx.runtime.weights.owners import reset_runtimes, runtimes_holding
    from models import offloaded

    torch._dynamo.reset()
    reset_runtimes()
    want = run(quantized(name))
    from dlo_fx.config import COMPILE_OPTIONS

    model = offloaded(quantized(name), options)
    model.compile(backend="dlo", options={k: v for k, v in options.items() if k in COMPILE_OPTIONS})
    equal = [torch.equal(run(model), want) for _ in range(calls)]
    store = runtimes_holding(list(model.parameters()))[0].store
    kinds = sorted({e.wrapper[0].__name__ for e in store._entries.values() if e.parts})
    return {"equal": equal, "kinds": kinds, "host": store.host_bytes,
            "block_bytes": sum(b.nbytes for b in store.blocks)}


def ranks_case(rank: int, world: int) -> dict:
    return {(name, mode): compare(name, {"mode": mode})
            for name in ("int8", "float8") for mode in ("allgather", "rank_local")}

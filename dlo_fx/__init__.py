"""dlo-fx: run Diffusion Transformers larger than one accelerator's memory.

``torch.compile(model, backend="dlo")`` streams the model's weights from host memory
through ``num_slots`` device slots, block by block, the next block's transfer overlapping
the current block's compute.

This module holds what users call. The library is in one package per stage (planning,
runtime, passes, loading, model, dynamo; see docs/architecture.md, "Layout"); what is
built on it is in `dlo_fx.apps`: schedule dumps, stalls and traces in `dlo_fx.apps.dump`,
the planning study in `dlo_fx.apps.study`, `dlo_fx.plan` (a model planned for hardware
one does not have) in `dlo_fx.apps.plan`, the engine in `dlo_fx.apps.engine`, the
reference DiT in `dlo_fx.apps.models`.
"""

from .config import DLOConfig
from .dynamo.backend import SCHEDULED_OBSERVERS as _SCHEDULED_OBSERVERS
from .dynamo.errors import DeviceMemoryError
from .loading.loader import load
from .loading.offload import offload
from .model.cfg_parallel import cfg_parallel
from .model.memory import memory_report
from .model.state import DLOState, state
from .dynamo.pipelines import compile_pipeline, release
from .model.storage_dtype import take_over_layerwise_casting

__all__ = ["DLOConfig", "DLOState", "DeviceMemoryError", "Engine", "Request", "Result", "cfg_parallel",
           "compile_pipeline", "load",
           "memory_report", "offload", "plan", "release", "state",
           "take_over_layerwise_casting"]
__version__ = "0.1.0"

_ENGINE = ("Engine", "Request", "Result")


def _dump_when_asked(gm, plan, runtime, config) -> None:
    # The library composes with its applications here, at the root: the backend only
    # calls its observers, and the dump writer loads when a compile asks for a dump.
    if config.dump_dir:
        from .apps.dump import write_dump

        write_dump(gm, plan, runtime, config.dump_dir)


_SCHEDULED_OBSERVERS.append(_dump_when_asked)


def __getattr__(name: str):
    # The engine (worker processes, control plane) loads on first use, not with every
    # `import dlo_fx` of a process that only compiles.
    if name in _ENGINE:
        from .apps import engine

        return getattr(engine, name)
    if name == "plan":  # a model planned for hardware it does not run on (apps/plan)
        from .apps.plan import plan

        return plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

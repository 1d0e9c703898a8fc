"""dlo-fx: run Diffusion Transformers larger than one accelerator's memory.

``torch.compile(model, backend="dlo")`` streams the model's weights from host memory
through ``num_slots`` device slots, block by block, the next block's transfer overlapping
the current block's compute.
"""

from .config import DLOConfig
from .dump import stall_summary, write_trace
from .engine import Engine, Request, Result
from .loader import load
from .memory import MemoryReport, memory_report
from .module_guard import release

__all__ = ["DLOConfig", "Engine", "MemoryReport", "Request", "Result", "load", "memory_report",
           "release", "stall_summary", "write_trace"]
__version__ = "0.1.0"

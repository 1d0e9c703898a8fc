"""The DP wave engine: serve N requests at once, one per data-parallel replica.

``Engine(pipeline, dp_size)`` starts ``dp_size`` worker processes (``sp_size`` ranks
each) behind an authenticated loopback control plane, refuses requests outside the
pipeline's `Limits`, packs `Request`\\ s of any shapes into waves, runs each wave with
one request per replica in lock-step weight AllGathers, answers a request that raises
with its own error `Result`, and fails a wave closed (fresh workers for the next) when
a worker dies, hangs or leaves its collectives out of step. ``serve`` does the same
over ranks started by ``torchrun``.
"""

from .clock import ForwardClock
from .engine import Engine
from .limits import Limits
from .request import LOCAL_FIELDS, WAVE_KEY_FIELDS, Request
from .result import Result
from .serve import serve
from .topology import Topology, WorkerContext, worker_context

__all__ = ["Engine", "ForwardClock", "LOCAL_FIELDS", "Limits", "Request", "Result",
           "Topology", "WAVE_KEY_FIELDS", "WorkerContext", "serve", "worker_context"]

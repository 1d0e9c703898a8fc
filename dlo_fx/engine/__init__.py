"""The DP wave engine: serve N requests at once, one per data-parallel replica.

``Engine(pipeline, dp_size)`` starts ``dp_size`` worker processes (``sp_size`` ranks
each), forms waves of compatible `Request`\\ s, runs each wave with one request per
replica in lock-step weight AllGathers, and fails a wave closed (an error `Result` for
each of its requests, fresh workers for the next call) when a worker raises, dies or
hangs. ``serve`` does the same over ranks started by ``torchrun``.
"""

from .engine import Engine
from .request import LOCAL_FIELDS, WAVE_KEY_FIELDS, Request
from .result import Result
from .serve import serve
from .topology import Topology, WorkerContext, worker_context

__all__ = ["Engine", "LOCAL_FIELDS", "Request", "Result", "Topology", "WAVE_KEY_FIELDS",
           "WorkerContext", "serve", "worker_context"]

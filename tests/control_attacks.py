"""A local attacker on the engine's torchrun control plane, for the tests: a store that
records or tampers with what the engine writes, a trivial pipeline to serve in-process
with `serve.TorchrunWorkers`, and the signed values of another job to replay.

``attacked`` is a pipeline factory for a real torchrun job: on rank 1 it writes, before
its pipeline is built (so before any of the keys it targets is written), an
unauthenticated value where rank 0's first reply will go and the signed reply of another
job with the same secret where rank 1's first reply will go; then it builds the
reference pipeline.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from dlo_fx.apps.engine import Request
from dlo_fx.apps.engine.channel import pack
from dlo_fx.apps.engine.store_channel import StoreFront, StoreWorker


class Store:
    """Wraps a store: records every value set (``sets``), and ``tamper(key, value)``
    returns what to store instead: the attacker's value replaces the writer's before any
    reader can see it (written in its place, so that no reader can win the race)."""

    def __init__(self, store: Any, tamper: Optional[Callable[[str, bytes], bytes]] = None):
        self.store, self.tamper, self.sets = store, tamper, {}

    def set(self, key: str, value: Any) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.sets[key] = value
        self.store.set(key, value if self.tamper is None else self.tamper(key, value))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def echo(options: Any = None, **_: Any) -> Callable[[Request], torch.Tensor]:
    """A pipeline whose output is the request's seed: one job's answer is told from
    another's."""
    return lambda request: torch.full((2, 3), float(request.seed))


def forged_reply(index: int, seq: int = 0, wave: int = 0) -> bytes:
    """A reply as an attacker without the secret writes it: a header with a zero tag."""
    return b"\0" * 32 + pack({"kind": "reply", "seq": seq, "wave": wave, "index": index,
                              "dp_rank": index, "_chunks": 0, "_sha256": ""})


def other_job(secret: bytes, rank: int, world: int, messages: list) -> dict:
    """The values worker ``rank`` of another job (same secret) wrote for ``messages``
    (``(header, payload)`` each, sent in order), by key: what a local process that
    watched that job's store recorded."""
    import torch.distributed as dist

    store = Store(dist.HashStore())
    front = StoreFront(store, secret, world)
    worker = StoreWorker(store, secret, rank)
    front.receive(0)  # the front end answers the worker's greeting, where there is one
    for header, payload in messages:
        worker.send(header, payload)
    return {k: v for k, v in store.sets.items() if k.startswith(f"msg/{rank}/")}


def attacked(options: Any = None, **kwargs: Any) -> Any:
    """The reference pipeline, after rank 1 attacked the job's control plane (see the
    module docstring)."""
    from dlo_fx.apps.engine.channel import encode_output
    from dlo_fx.apps.engine.reference_pipeline import build
    from dlo_fx.apps.engine.store_channel import secret_from_environment

    if os.environ.get("RANK") == "1":
        import torch.distributed as dist

        store, _, _ = next(dist.rendezvous("env://"))
        control = dist.PrefixStore("dlo_engine", store)
        control.set("msg/0/1", forged_reply(0))
        decoy = {"kind": "reply", "seq": 0, "wave": 0, "index": 1, "rank": 1, "dp_rank": 1,
                 "info": {}}
        values = other_job(secret_from_environment(), 1, 2,
                           [({"kind": "ready", "rank": 1, "mixed": True}, b""),
                            (decoy, encode_output(torch.full((1, 4, 4, 8), 7.0)))])
        for key, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
            if key.startswith("msg/1/1"):  # its reply: the payload chunks first
                control.set(key, value)
    return build(options, **kwargs)

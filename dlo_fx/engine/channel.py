"""`WaveChannel`: the engine's control plane, as keys of a ``torch.distributed`` store.

[Note: the wave protocol]
The front end and the workers talk through a key-value store (a ``TCPStore`` hosted by
the front end), never through a collective, so a dead or hung rank cannot block the
front end: it polls keys, worker liveness and the clock. The store lives as long as one
generation of workers; a fresh generation gets a fresh store, so no key is ever stale.

- ``ready/{rank}``: a worker built its pipeline.
- ``wave/{seq}``: the one broadcast of a wave (JSON: engine wave id and the request
  list), or a stop message. Every rank reads it and runs ``requests[dp_rank % len]``.
- ``reply/{seq}/{dp_rank}/{i}`` chunks, then ``reply/{seq}/{dp_rank}/n`` (the chunk
  count, written last), then ``replies/{seq}`` is incremented: the first rank of each
  replica posts its output (safetensors bytes, the reply metadata in the header).
- ``fatal/{rank}``, then ``fatal`` incremented: why a worker stopped (JSON).

Nothing here unpickles: requests travel as JSON and outputs as safetensors.
"""

from __future__ import annotations

import json
import struct
import time
from typing import Any, Mapping, Optional

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

_CHUNK = 4 << 20  # the libuv TCPStore refuses values above 8 MiB
_META = "dlo_fx_reply"


def encode_output(output: Any, meta: Mapping[str, Any]) -> bytes:
    """A pipeline's output (tensor or dict of tensors) and ``meta`` as safetensors bytes."""
    if isinstance(output, torch.Tensor):
        tensors, kind = {"output": output}, "tensor"
    elif isinstance(output, Mapping) and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in output.items()):
        tensors, kind = dict(output), "dict"
    else:
        raise TypeError(f"the pipeline returned a {type(output).__name__}; an engine pipeline "
                        "must return a torch.Tensor or a dict of str -> torch.Tensor")
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return save_tensors(tensors, metadata={_META: json.dumps({**meta, "kind": kind})})


def decode_output(blob: bytes) -> tuple[Any, dict]:
    """Inverse of `encode_output`: ``(output, meta)``."""
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    meta = json.loads(header.get("__metadata__", {}).get(_META, "{}"))
    tensors = load_tensors(blob)
    output = tensors["output"] if meta.get("kind") == "tensor" else tensors
    return output, meta


class Backoff:
    """The sleeps of a polling loop: 1 ms, doubling up to ``max_s``, so a busy wave
    costs the CPUs that compute it almost nothing while a reply is still seen fast."""

    def __init__(self, max_s: float = 0.02) -> None:
        self.delay = 0.001
        self.max_s = max_s

    def sleep(self) -> None:
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, self.max_s)


class WaveChannel:
    """Both ends of the wave protocol over one store."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def _count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    # -- front end -----------------------------------------------------------------------
    def publish(self, seq: int, message: Mapping[str, Any]) -> None:
        self.store.set(f"wave/{seq}", json.dumps(message))

    def ready_count(self, world: int) -> int:
        return sum(self._has(f"ready/{r}") for r in range(world))

    def reply_count(self, seq: int) -> int:
        return self._count(f"replies/{seq}")

    def take_reply(self, seq: int, dp_rank: int) -> Optional[tuple[Any, dict]]:
        prefix = f"reply/{seq}/{dp_rank}"
        if not self._has(f"{prefix}/n"):
            return None
        n = int(self.store.get(f"{prefix}/n"))
        blob = b"".join(self.store.get(f"{prefix}/{i}") for i in range(n))
        for i in range(n):
            self.store.delete_key(f"{prefix}/{i}")
        return decode_output(blob)

    def fatal_count(self) -> int:
        return self._count("fatal")

    def fatal(self, world: int) -> dict[int, dict]:
        """Every ``fatal/{rank}`` posted so far."""
        return {r: json.loads(self.store.get(f"fatal/{r}")) for r in range(world)
                if self._has(f"fatal/{r}")}

    # -- workers -------------------------------------------------------------------------
    def post_ready(self, rank: int) -> None:
        self.store.set(f"ready/{rank}", "1")

    def next_message(self, seq: int) -> dict:
        """Block until wave ``seq`` is published (polling; a lost store raises)."""
        key = f"wave/{seq}"
        backoff = Backoff()
        while not self._has(key):
            backoff.sleep()
        return json.loads(self.store.get(key))

    def post_reply(self, seq: int, dp_rank: int, blob: bytes) -> None:
        prefix = f"reply/{seq}/{dp_rank}"
        chunks = [blob[i : i + _CHUNK] for i in range(0, len(blob), _CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            self.store.set(f"{prefix}/{i}", chunk)
        self.store.set(f"{prefix}/n", str(len(chunks)))
        self.store.add(f"replies/{seq}", 1)

    def post_fatal(self, rank: int, report: Mapping[str, Any]) -> None:
        self.store.set(f"fatal/{rank}", json.dumps(report))
        self.store.add("fatal", 1)

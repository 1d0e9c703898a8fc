"""The control plane of `serve` (ranks started by ``torchrun``): authenticated messages as
keys of the job's store. See [Note: the control plane's trust model] in channel.py.

- ``wave/{seq}``: the front end's ``seq``-th message to every worker; deleted by the
  front end once the wave ended.
- ``msg/{rank}/{n}``: worker ``rank``'s ``n``-th message to the front end (its header,
  and the SHA-256 and chunk count of its payload), after ``msg/{rank}/{n}/{i}`` payload
  chunks; deleted by the front end once read.

Every value is ``HMAC-SHA256(secret, key, body) + body``: a value moved to another key,
or forged without the secret, fails authentication and fails the wave.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import time
from typing import Any, Mapping, Optional

from .channel import Backoff, ChannelError, Message, mac, pack, unpack

SECRET_ENV = "DLO_FX_ENGINE_SECRET"
SECRET_FILE_ENV = "DLO_FX_ENGINE_SECRET_FILE"
_CHUNK = 4 << 20  # the libuv TCPStore refuses values above 8 MiB


def secret_from_environment() -> bytes:
    """The job's secret: hex in ``DLO_FX_ENGINE_SECRET``, or the content of the file named
    by ``DLO_FX_ENGINE_SECRET_FILE`` (readable by its owner only). ``ValueError`` without
    one, or when it is shorter than 16 bytes."""
    if os.environ.get(SECRET_ENV):
        try:
            secret = bytes.fromhex(os.environ[SECRET_ENV].strip())
        except ValueError:
            raise ValueError(f"{SECRET_ENV} must be hex (e.g. `openssl rand -hex 32`)") from None
    elif os.environ.get(SECRET_FILE_ENV):
        path = os.environ[SECRET_FILE_ENV]
        try:
            mode = os.stat(path).st_mode
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"{SECRET_FILE_ENV}={path!r} cannot be read: {exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"{SECRET_FILE_ENV}={path!r} is readable by others (mode "
                             f"{stat.S_IMODE(mode):o}); chmod 600 it")
    else:
        raise ValueError(f"dlo_fx.engine.serve needs the job's control-plane secret: set "
                         f"{SECRET_ENV} (hex) or {SECRET_FILE_ENV} (a file of mode 0600) to "
                         "the same value on every rank")
    if len(secret) < 16:
        raise ValueError("the engine's control-plane secret must be at least 16 bytes")
    return secret


class _Signed:
    def __init__(self, store: Any, secret: bytes) -> None:
        self.store = store
        self.secret = secret

    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def _set(self, key: str, body: bytes) -> None:
        self.store.set(key, mac(self.secret, key.encode(), body) + body)

    def _get(self, key: str) -> bytes:
        value = self.store.get(key)
        tag, body = value[:32], value[32:]
        if not hmac.compare_digest(tag, mac(self.secret, key.encode(), body)):
            raise ChannelError(f"the engine's control message {key!r} failed authentication "
                               "(a process without the job's secret wrote it)")
        return body


class StoreFront(_Signed):
    """The front end's end, on rank 0."""

    def __init__(self, store: Any, secret: bytes, world: int) -> None:
        super().__init__(store, secret)
        self.world = world
        self.lost: dict[int, str] = {}
        self._seq = 0
        self._next = [0] * world
        self._published: list[str] = []

    def broadcast(self, header: Mapping[str, Any]) -> None:
        key = f"wave/{self._seq}"
        self._seq += 1
        self._set(key, pack(header))
        self._published.append(key)

    def retire(self) -> None:
        """Delete the messages every worker has read (a wave ended)."""
        for key in self._published:
            self.store.delete_key(key)
        self._published.clear()

    def _take(self, rank: int) -> Optional[Message]:
        key = f"msg/{rank}/{self._next[rank]}"
        if not self._has(key):
            return None
        header, _ = unpack(self._get(key))
        chunks = [self.store.get(f"{key}/{i}") for i in range(header.pop("_chunks"))]
        payload = b"".join(chunks)
        if hashlib.sha256(payload).hexdigest() != header.pop("_sha256"):
            raise ChannelError(f"the payload of the engine's control message {key!r} does not "
                               "match its authenticated digest")
        for i in range(len(chunks)):
            self.store.delete_key(f"{key}/{i}")
        self.store.delete_key(key)
        self._next[rank] += 1
        return Message(rank, header, payload)

    def receive(self, timeout_s: float) -> list[Message]:
        backoff = Backoff()
        deadline = time.monotonic() + timeout_s
        while True:
            messages = [m for m in (self._take(r) for r in range(self.world)) if m is not None]
            if messages or time.monotonic() >= deadline:
                return messages
            backoff.sleep()

    def close(self) -> None:
        self.retire()


class StoreWorker(_Signed):
    """A worker rank's end."""

    def __init__(self, store: Any, secret: bytes, rank: int) -> None:
        super().__init__(store, secret)
        self.rank = rank
        self._seq = 0
        self._sent = 0

    def receive(self) -> dict:
        key = f"wave/{self._seq}"
        backoff = Backoff()
        while not self._has(key):
            backoff.sleep()
        self._seq += 1
        return unpack(self._get(key))[0]

    def send(self, header: Mapping[str, Any], payload: bytes = b"") -> None:
        key = f"msg/{self.rank}/{self._sent}"
        self._sent += 1
        chunks = [payload[i : i + _CHUNK] for i in range(0, len(payload), _CHUNK)]
        for i, chunk in enumerate(chunks):
            self.store.set(f"{key}/{i}", chunk)
        self._set(key, pack({**header, "_chunks": len(chunks),
                             "_sha256": hashlib.sha256(payload).hexdigest()}))

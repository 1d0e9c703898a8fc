"""The control plane of `serve` (ranks started by ``torchrun``): authenticated messages as
keys of the job's store. See [Note: the control plane's trust model] in channel.py.

[Note: messages bound to their job]
A value is taken only by the reader of its own key in its own job. Keys restart at
``wave/0`` and ``msg/R/0`` in every job, and another local user can read and write the
store, so a signature over key and value alone lets a value recorded in one job pass in
the next one with the same secret. Each job therefore agrees on a fresh nonce first, and
every later value is ``HMAC-SHA256(secret, job nonce, key, body) + body``:

- ``hello/{rank}``: worker ``rank``'s own fresh nonce, written when it starts.
- ``job/{rank}``: the front end's answer, its fresh job nonce with an HMAC over the
  rank, the job nonce and the greeting it read. A worker takes the job nonce only from an
  answer to its own nonce, so the answer of another job is refused. When it refuses an
  answer (the front end read a greeting someone else wrote, or holds another secret) it
  greets again with a fresh nonce, at most once a second, and the front end answers the
  new greeting; a greeting that changes after its answer is noted as the sign of a rank
  with another secret. Both keys are deleted once the worker's first message arrives.
- ``wave/{seq}``: the front end's ``seq``-th message to every worker; deleted by the
  front end once the wave ended.
- ``msg/{rank}/{n}``: worker ``rank``'s ``n``-th message to the front end (its header,
  and the SHA-256 and chunk count of its payload), after ``msg/{rank}/{n}/{i}`` payload
  chunks; deleted by the front end once read.

Each key is read once, in sequence, by one reader. A value that fails authentication
(forged without the secret, moved from another key, or replayed from another job) is
refused: logged and left where it is, never taken and never raised, while the reader
waits for the genuine value, which its writer stores over it. When a genuine message
follows a refused one from the same worker, the refused value replaced a message its
worker had written: the front end moves on, and a reply lost that way becomes its
request's error once the worker's ``done`` arrives (`WorkerSet`). Otherwise a genuine
value that never comes (overwritten or deleted after it was written) fails the wave at
its timeout, the error naming the refused key. A payload changed or removed after its
worker wrote it makes that reply an error. Reads never block: ``compare_set``
with a sentinel returns the value or the sentinel at once (`_Signed._peek`), where
``get`` would wait for the store's timeout on a key deleted meanwhile.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from typing import Any, Mapping, Optional

from .channel import Backoff, ChannelError, Message, mac, pack, unpack

log = logging.getLogger(__name__)

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
        raise ValueError(f"dlo_fx.apps.engine.serve needs the job's control-plane secret: set "
                         f"{SECRET_ENV} (hex) or {SECRET_FILE_ENV} (a file of mode 0600) to "
                         "the same value on every rank")
    if len(secret) < 16:
        raise ValueError("the engine's control-plane secret must be at least 16 bytes")
    return secret


_ABSENT = b"\0dlo-fx: absent\0"
_NONCE_BYTES = 16


class _Signed:
    def __init__(self, store: Any, secret: bytes) -> None:
        self.store = store
        self.secret = secret
        self.job: Optional[bytes] = None
        """The job's nonce (hex), once agreed."""
        self.refused = ""
        """How many values this end refused, and the latest ("" if none)."""
        self._refusals = 0
        self._refused_values: dict[str, bytes] = {}
        """The SHA-256 of the value last refused at each key."""

    def _peek(self, key: str) -> Optional[bytes]:
        """The value at ``key``, or ``None``; never waits (see the Note above)."""
        value = self.store.compare_set(key, _ABSENT, _ABSENT)
        return None if value == _ABSENT else bytes(value)

    def _tag(self, key: str, body: bytes) -> bytes:
        assert self.job is not None
        return mac(self.secret, b"dlo-fx-engine-msg", self.job, key.encode(), body)

    def _set(self, key: str, body: bytes) -> None:
        self.store.set(key, self._tag(key, body) + body)

    def _open(self, key: str) -> Optional[bytes]:
        """The authenticated body at ``key``; ``None`` while there is none."""
        value = self._peek(key)
        if value is None:
            return None
        tag, body = value[:32], value[32:]
        if hmac.compare_digest(tag, self._tag(key, body)):
            return body
        self._refuse(key, value, "failed authentication (written by a process without this "
                     "job's secret, or recorded in another job)")
        return None

    def _refuse(self, key: str, value: bytes, why: str) -> None:
        """Refuse ``value`` at ``key`` (reported once while it stays there); its reader
        waits for the genuine value."""
        digest = hashlib.sha256(value).digest()
        if self._refused_values.get(key) != digest:
            self._note(key, why, "; waiting for the genuine one",
                       quiet=key in self._refused_values)
            self._refused_values[key] = digest

    def _note(self, key: str, why: str, then: str = "", quiet: bool = False) -> None:
        """Count a refusal (``quiet``: a key refused before, logged at debug level)."""
        self._refusals += 1
        self.refused = (f"refused {self._refusals} value{'s' if self._refusals > 1 else ''} "
                        f"in the job's store, the latest at {key!r}: it {why}")
        log.log(logging.DEBUG if quiet else logging.WARNING,
                "dlo engine: refused the control message at %r: it %s%s", key, why, then)


class StoreFront(_Signed):
    """The front end's end, on rank 0."""

    def __init__(self, store: Any, secret: bytes, world: int) -> None:
        super().__init__(store, secret)
        self.world = world
        self.job = secrets.token_hex(_NONCE_BYTES).encode()
        self.lost: dict[int, str] = {}
        self._seq = 0
        self._next = [0] * world
        self._published: list[str] = []
        self._greetings: dict[int, Optional[bytes]] = dict.fromkeys(range(world))
        """Ranks whose first message has not arrived: the greeting answered last."""
        self._greeted_again: set[int] = set()

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

    def _answer(self, rank: int) -> None:
        """Answer worker ``rank``'s greeting with the job's nonce (again, if it changed)."""
        greeting = self._peek(f"hello/{rank}")
        if greeting is not None and greeting != self._greetings[rank]:
            if self._greetings[rank] is not None:
                self._note(f"hello/{rank}", f"replaced a greeting the front end had answered: "
                           f"worker rank {rank} refused that answer (it holds another "
                           "control-plane secret than rank 0, or another process wrote a "
                           f"greeting); give every rank the same {SECRET_ENV}",
                           quiet=rank in self._greeted_again)
                self._greeted_again.add(rank)
            self._greetings[rank] = greeting
            assert self.job is not None
            self.store.set(f"job/{rank}", mac(self.secret, b"dlo-fx-engine-job",
                                              str(rank).encode(), self.job, greeting)
                           + self.job)

    def _take(self, rank: int) -> Optional[Message]:
        if rank in self._greetings:
            self._answer(rank)
        key = f"msg/{rank}/{self._next[rank]}"
        # Once a value was refused at ``key``, look at the next key first: a genuine
        # message there means the worker wrote this one before it, so the refused value
        # replaced it and it is lost (read in this order, a message still on its way is
        # never taken for lost).
        ahead = (key in self._refused_values
                 and self._open(f"msg/{rank}/{self._next[rank] + 1}") is not None)
        body = self._open(key)
        if body is None:
            if not ahead:
                return None
            self._next[rank] += 1
            return Message(rank, {"kind": "lost", "key": key}, b"")
        header, _ = unpack(body)
        count, digest = header.pop("_chunks"), header.pop("_sha256")
        chunks = [self._peek(f"{key}/{i}") for i in range(count)]
        payload = b"".join(c for c in chunks if c is not None)
        if None in chunks or hashlib.sha256(payload).hexdigest() != digest:
            why = (f"was altered or removed in the job's store after worker rank {rank} "
                   "wrote it (a process without this job's secret touched it)")
            self._note(key, f"had its payload, which {why}")
            header["error"] = f"ChannelError: the output at {key!r} {why}"
            payload = b""
        for i in range(count):
            self.store.delete_key(f"{key}/{i}")
        self.store.delete_key(key)
        self._next[rank] += 1
        if rank in self._greetings:  # its first message: the greeting is done
            del self._greetings[rank]
            self.store.delete_key(f"hello/{rank}")
            self.store.delete_key(f"job/{rank}")
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
        for rank in self._greetings:  # ranks that never sent a message
            self.store.delete_key(f"hello/{rank}")
            self.store.delete_key(f"job/{rank}")


class StoreWorker(_Signed):
    """A worker rank's end. It greets the front end at once and learns the job's nonce
    before its first message (see [Note: messages bound to their job]), waiting at most
    ``timeout_s`` for it."""

    def __init__(self, store: Any, secret: bytes, rank: int, timeout_s: float = 600.0) -> None:
        super().__init__(store, secret)
        self.rank = rank
        self.timeout_s = timeout_s
        self._nonce = secrets.token_hex(_NONCE_BYTES).encode()
        self._seq = 0
        self._sent = 0
        self._failed = ""
        store.set(f"hello/{rank}", self._nonce)

    def _join(self) -> None:
        """Learn the job's nonce from the front end's answer to this worker's greeting."""
        if self.job is not None:
            return
        if self._failed:
            raise ChannelError(self._failed)
        key, backoff, refused, again = f"job/{self.rank}", Backoff(), None, 0.0
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            value = self._peek(key)
            if value is not None and value != refused:
                tag, job = value[:32], value[32:]
                if hmac.compare_digest(tag, mac(self.secret, b"dlo-fx-engine-job",
                                                str(self.rank).encode(), job, self._nonce)):
                    self.job = job
                    return
                refused = value
                self._refuse(key, value, "does not answer this worker's greeting (another "
                             "job's answer, an answer to a greeting someone else wrote, or "
                             "a front end with another control-plane secret)")
            if value is not None and value == refused and time.monotonic() >= again:
                # Greet again, with a fresh nonce (the front end answers a changed
                # greeting), at most once a second.
                again = time.monotonic() + 1.0
                self._nonce = secrets.token_hex(_NONCE_BYTES).encode()
                self.store.set(f"hello/{self.rank}", self._nonce)
            backoff.sleep()
        self._failed = (f"worker rank {self.rank} got no authenticated answer from the "
                        f"engine's front end (rank 0) within {self.timeout_s:g} s; "
                        + (self.refused or "rank 0 never answered") + ". Check that every "
                        "rank has the same control-plane secret")
        raise ChannelError(self._failed)

    def receive(self) -> dict:
        self._join()
        key = f"wave/{self._seq}"
        backoff = Backoff()
        while (body := self._open(key)) is None:
            backoff.sleep()
        self._seq += 1
        return unpack(body)[0]

    def send(self, header: Mapping[str, Any], payload: bytes = b"") -> None:
        self._join()
        key = f"msg/{self.rank}/{self._sent}"
        self._sent += 1
        chunks = [payload[i : i + _CHUNK] for i in range(0, len(payload), _CHUNK)]
        for i, chunk in enumerate(chunks):
            self.store.set(f"{key}/{i}", chunk)
        self._set(key, pack({**header, "_chunks": len(chunks),
                             "_sha256": hashlib.sha256(payload).hexdigest()}))

"""The engine's control plane: messages between the front end and its workers, and the
loopback transport of a local engine.

[Note: the wave protocol]
The front end and the workers exchange messages, never collectives, so a dead or hung
rank cannot block the front end: it polls its channel, worker liveness and the clock. A
message is a JSON header and optional bytes (a request list, or an output as
safetensors): nothing is unpickled. Front end to every worker: ``wave`` (sequence number,
engine wave number, the requests, which replica runs which) and ``stop``. Worker to
front end: ``ready`` (its rank and what its pipeline declares: limits, forward clock),
``reply`` (one per request, from the first rank of the replica that ran it: the output,
or the error it raised), ``done`` (the rank finished the wave, padding included) and
``fatal`` (why the worker stops).

[Note: the control plane's trust model]
A local engine listens on 127.0.0.1 only, on an ephemeral port, and only until every
worker has connected: then the listening socket is closed. Each connection starts with a
mutual challenge-response over HMAC-SHA256 with the engine's random 32-byte secret
(`handshake`), which the workers get through multiprocessing's process-start pipe
(never argv or the environment); a process that knows the port but not the secret is
refused before it can read a request or send a reply. The process group meets in a ``FileStore`` in a private
(0700) temporary folder and gloo is bound to the loopback interface, so no rendezvous
port is published. What this does not cover: gloo's own loopback connections are not
authenticated (torch.distributed has no authentication); a local user who finds and
connects to them can disturb the collectives, though not read or forge the control
plane. Under ``torchrun`` (`serve`) the control plane lives in the job's store, which
listens where torchrun says; every message there carries an HMAC-SHA256 of its key and
value under a secret from ``DLO_FX_ENGINE_SECRET`` or a 0600 file named by
``DLO_FX_ENGINE_SECRET_FILE``, so forged or replayed messages are refused, and keys are
deleted once read. Messages there are not encrypted: run the job on a network you trust
with what the prompts say.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Mapping, NamedTuple, Optional

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

log = logging.getLogger(__name__)

_META = "dlo_fx_reply"
_HELLO = b"dlo-fx-engine-1\0"
_HANDSHAKE_S = 2


class ChannelError(RuntimeError):
    """The control plane failed: a lost connection, or a message that failed
    authentication."""


class Message(NamedTuple):
    rank: int
    header: dict
    payload: bytes


def pack(header: Mapping[str, Any], payload: bytes = b"") -> bytes:
    """A header (JSON) and bytes as one message body."""
    text = json.dumps(header).encode()
    return struct.pack("<I", len(text)) + text + payload


def unpack(data: bytes) -> tuple[dict, bytes]:
    (size,) = struct.unpack("<I", data[:4])
    return json.loads(data[4 : 4 + size]), bytes(data[4 + size :])


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"\0".join(parts), hashlib.sha256).digest()


def encode_output(output: Any) -> bytes:
    """A pipeline's output (tensor or dict of tensors) as safetensors bytes."""
    if isinstance(output, torch.Tensor):
        tensors, kind = {"output": output}, "tensor"
    elif isinstance(output, Mapping) and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in output.items()):
        tensors, kind = dict(output), "dict"
    else:
        raise TypeError(f"the pipeline returned a {type(output).__name__}; an engine pipeline "
                        "must return a torch.Tensor or a dict of str -> torch.Tensor")
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return save_tensors(tensors, metadata={_META: kind})


def decode_output(blob: bytes) -> Any:
    """Inverse of `encode_output`."""
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    tensors = load_tensors(blob)
    kind = header.get("__metadata__", {}).get(_META)
    return tensors["output"] if kind == "tensor" else tensors


class Backoff:
    """The sleeps of a polling loop: 1 ms, doubling up to ``max_s``, so a busy wave
    costs the CPUs that compute it almost nothing while a reply is still seen fast."""

    def __init__(self, max_s: float = 0.02) -> None:
        self.delay = 0.001
        self.max_s = max_s

    def sleep(self) -> None:
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, self.max_s)


# -- the local transport: one authenticated loopback connection per worker ------------------
def _recv_timeout(conn: Connection, seconds: float) -> None:
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
    finally:
        sock.detach()


def handshake(conn: Connection, secret: bytes, *, server: bool) -> None:
    """Mutual challenge-response: each side proves it holds ``secret`` over the other's
    fresh nonce; ``ChannelError`` when the peer does not."""
    mine = secrets.token_bytes(32)
    if server:
        conn.send_bytes(_HELLO + mine)
        answer = conn.recv_bytes(128)
        theirs, proof = answer[:32], answer[32:]
        if not hmac.compare_digest(proof, mac(secret, b"worker", mine, theirs)):
            raise ChannelError("a connection to the engine failed authentication")
        conn.send_bytes(mac(secret, b"front", theirs, mine))
        return
    hello = conn.recv_bytes(128)
    if not hello.startswith(_HELLO):
        raise ChannelError("the engine's control port answered with an unknown protocol")
    theirs = hello[len(_HELLO):]
    conn.send_bytes(mine + mac(secret, b"worker", theirs, mine))
    try:
        proof = conn.recv_bytes(128)
    except EOFError:
        raise ChannelError("this worker failed authentication: the engine closed the "
                           "connection (a secret of another engine?)") from None
    if not hmac.compare_digest(proof, mac(secret, b"front", mine, theirs)):
        raise ChannelError("the engine's control port failed authentication")


class LocalFront:
    """The front end of a local engine: listens on loopback until every worker rank has
    connected and authenticated, then talks to each over its own connection."""

    def __init__(self, world: int, secret: bytes) -> None:
        self.world = world
        self.secret = secret
        self._listener: Optional[socket.socket] = socket.socket(socket.AF_INET,
                                                                socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(2 * world)
        self._listener.setblocking(False)
        self.address: tuple[str, int] = self._listener.getsockname()
        self.conns: dict[int, Connection] = {}
        self.lost: dict[int, str] = {}
        """Ranks whose connection closed, and how."""

    def _accept(self) -> None:
        assert self._listener is not None
        while len(self.conns) < self.world:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(True)
            conn = Connection(sock.detach())
            try:
                _recv_timeout(conn, _HANDSHAKE_S)  # a silent peer cannot stall the front end
                handshake(conn, self.secret, server=True)
                header, _ = unpack(conn.recv_bytes(4096))
                rank = header.get("rank")
                if not isinstance(rank, int) or not 0 <= rank < self.world or rank in self.conns:
                    raise ChannelError(f"a worker connected as rank {rank!r}")
                _recv_timeout(conn, 0)
            except (ChannelError, OSError, EOFError, ValueError, struct.error) as exc:
                log.warning("dlo engine: refused a control connection from %s: %s", peer, exc)
                conn.close()
                continue
            self.conns[rank] = conn
        self._listener.close()
        self._listener = None

    def receive(self, timeout_s: float) -> list[Message]:
        """Messages that arrived within ``timeout_s`` (accepting workers meanwhile)."""
        waitables: list[Any] = [c for r, c in self.conns.items() if r not in self.lost]
        if self._listener is not None:
            waitables.append(self._listener)
        messages = []
        for ready in wait(waitables, timeout_s):
            if ready is self._listener:
                self._accept()
                continue
            rank = next(r for r, c in self.conns.items() if c is ready)
            try:
                header, payload = unpack(ready.recv_bytes())
            except (EOFError, OSError) as exc:
                self.lost[rank] = f"its control connection closed ({type(exc).__name__})"
                continue
            messages.append(Message(rank, header, payload))
        return messages

    def broadcast(self, header: Mapping[str, Any]) -> None:
        data = pack(header)
        for rank, conn in self.conns.items():
            try:
                conn.send_bytes(data)
            except OSError as exc:
                self.lost[rank] = f"its control connection failed ({exc})"

    def retire(self) -> None:
        """Nothing to clean up between waves (see `StoreFront.retire`)."""

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in self.conns.values():
            conn.close()


class LocalWorker:
    """A worker's end of `LocalFront`."""

    def __init__(self, address: tuple[str, int], secret: bytes, rank: int) -> None:
        sock = socket.create_connection(tuple(address), timeout=30)
        sock.settimeout(None)
        self.conn = Connection(sock.detach())
        handshake(self.conn, secret, server=False)
        self.conn.send_bytes(pack({"rank": rank}))

    def receive(self) -> dict:
        """The next message from the front end (blocking); ``EOFError`` once it is gone."""
        return unpack(self.conn.recv_bytes())[0]

    def send(self, header: Mapping[str, Any], payload: bytes = b"") -> None:
        self.conn.send_bytes(pack(header, payload))

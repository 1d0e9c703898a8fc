"""The engine's control plane: messages between the front end and its workers, and the
loopback transport of a local engine.

[Note: the wave protocol]
A dead or hung rank never blocks the front end: the front end and the workers exchange
messages, never collectives, and the front end polls its channel, worker liveness and the
clock. A message is a JSON header and optional bytes (a request list, or an output as
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
refused before it can read a request or send a reply. Each handshake runs on a thread of
its own and is cut off after ``_HANDSHAKE_S``, so connections that stay silent delay
neither the workers nor the start's deadline (`LocalFront`). The process group meets in
a ``FileStore`` in a private (0700) temporary folder and gloo is bound to the loopback
interface, so no rendezvous port is published. What this does not cover: gloo's own
loopback connections are not authenticated (torch.distributed has no authentication); a
local user who finds and connects to them can disturb the collectives, though not read
or forge the control plane.

Under ``torchrun`` (`serve`) the control plane lives in the job's store, torchrun's
``TCPStore``, which has no authentication: any process that reaches its port (other
users of the node; other hosts, unless a firewall stops them) can list, read, write and
delete its keys. Every message there carries an HMAC-SHA256 under the job's secret
(``DLO_FX_ENGINE_SECRET``, or a 0600 file named by ``DLO_FX_ENGINE_SECRET_FILE``) over a
nonce the ranks agree on for this job, the key and the value (see [Note: messages bound
to their job] in store_channel.py). So such a process cannot make the front end take a
forged reply, or one recorded in an earlier job with the same secret, nor make a worker
run a wave the front end did not send: such values are refused, never taken, never
raised. What it can still do: read every request (prompts, negative prompts, seeds,
``extra_args``) and every output while they sit in the store, since they are signed, not
encrypted; see how many requests, waves and replies there are, their sizes and timing;
and deny service, by deleting or overwriting a message after its writer stored it: that
request gets an error (a reply whose loss the worker's next message proves, at once),
or its wave fails at its timeout, and a torchrun job cannot restart its workers, so its
later waves fail too. It can also disturb the process group, which meets in the same
store over unauthenticated gloo or NCCL connections. The secret protects the answers,
not the prompts: run such jobs where every user who can reach the store's port may read
them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import socket
import struct
import threading
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
_HANDSHAKES = 64


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


def _cut(sock: socket.socket) -> None:
    """End a connection's handshake: its thread's next read ends at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


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
    connected and authenticated, then talks to each over its own connection.

    Each connection's handshake runs on a thread of its own and is cut off after
    ``_HANDSHAKE_S``, so peers that connect and stay silent (or trickle bytes) delay
    neither the workers nor the front end's loop, which checks its deadline every poll;
    at most ``_HANDSHAKES`` run at once (more wait in the listen queue)."""

    def __init__(self, world: int, secret: bytes) -> None:
        self.world = world
        self.secret = secret
        self._listener: Optional[socket.socket] = socket.socket(socket.AF_INET,
                                                                socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(_HANDSHAKES)  # room for the workers behind silent peers
        self._listener.setblocking(False)
        self.address: tuple[str, int] = self._listener.getsockname()
        self.conns: dict[int, Connection] = {}
        self.lost: dict[int, str] = {}
        """Ranks whose connection closed, and how."""
        self.refused = ""
        """How many connections were refused, and the latest ("" if none)."""
        self._refusals = 0
        self._handshakes: dict[int, tuple[socket.socket, float]] = {}
        """Handshakes running, by number: the accepted socket and when it began."""
        self._accepted = 0
        self._shaken: "queue.SimpleQueue[tuple[int, Optional[Connection], Any, str]]" = \
            queue.SimpleQueue()
        """Finished handshakes: ``(number, conn, rank, "")``, or ``(number, None, peer,
        why it was refused)``."""

    def _accept(self) -> None:
        """Start a handshake for every queued connection (as many as may run at once)."""
        while self._listener is not None and len(self._handshakes) < _HANDSHAKES:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(True)
            self._accepted += 1
            self._handshakes[self._accepted] = (sock, time.monotonic())
            # The thread reads a duplicate, so that `_admit` can cut it off by shutting
            # the socket down, whatever the thread does with its descriptor meanwhile.
            conn = Connection(os.dup(sock.fileno()))
            threading.Thread(target=self._handshake, args=(self._accepted, conn, peer),
                             daemon=True, name="dlo-engine-handshake").start()

    def _handshake(self, number: int, conn: Connection, peer: Any) -> None:
        """One connection's handshake, on its own thread; the result goes to `_admit`."""
        try:
            _recv_timeout(conn, _HANDSHAKE_S)
            handshake(conn, self.secret, server=True)
            header, _ = unpack(conn.recv_bytes(4096))
            rank = header.get("rank")
            if not isinstance(rank, int) or not 0 <= rank < self.world:
                raise ChannelError(f"a worker connected as rank {rank!r}")
            _recv_timeout(conn, 0)
        except Exception as exc:
            conn.close()
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._shaken.put((number, None, f"{peer[0]}:{peer[1]}", why))
            return
        self._shaken.put((number, conn, rank, ""))

    def _admit(self) -> None:
        """Take the connections whose handshake finished, and cut off those that ran
        past ``_HANDSHAKE_S`` (on the caller's thread)."""
        while True:
            try:
                number, conn, who, why = self._shaken.get_nowait()
            except queue.Empty:
                break
            self._handshakes.pop(number)[0].close()
            if conn is not None and (who in self.conns or len(self.conns) == self.world):
                conn.close()
                conn, why = None, f"a second connection as rank {who}"
            if conn is not None:
                self.conns[who] = conn
                continue
            self._refusals += 1
            self.refused = (f"refused {self._refusals} connection"
                            f"{'s' if self._refusals > 1 else ''} to the control port, the "
                            f"latest from {who}: {why}")
            log.warning("dlo engine: refused a control connection from %s: %s", who, why)
        late = time.monotonic() - _HANDSHAKE_S
        for sock, began in self._handshakes.values():
            if began < late:
                _cut(sock)
        if len(self.conns) == self.world and self._listener is not None:
            self._listener.close()
            self._listener = None

    def receive(self, timeout_s: float) -> list[Message]:
        """Messages that arrived within ``timeout_s`` (accepting workers meanwhile)."""
        self._admit()
        waitables: list[Any] = [c for r, c in self.conns.items() if r not in self.lost]
        if self._listener is not None and len(self._handshakes) < _HANDSHAKES:
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
        for sock, _ in self._handshakes.values():
            _cut(sock)
            sock.close()
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

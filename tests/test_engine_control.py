"""The engine's control plane and up-front checks, without worker processes (except the
front-end-death case): authentication against a process that knows only the port, and
against silent connections; signed store messages for torchrun, bound to their job
(forged, replayed and overwritten values, also through an engine whose rank 0 runs on a
thread here); limits, and the forward clock."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch
import torch.distributed as dist

from dlo_fx.apps.engine import Engine, ForwardClock, Limits, Request
from dlo_fx.apps.engine.channel import ChannelError, LocalFront, LocalWorker, new_secret
from dlo_fx.apps.engine.reference_pipeline import resident
from dlo_fx.apps.engine.request import plan_waves
from dlo_fx.apps.engine.serve import TorchrunWorkers
from dlo_fx.apps.engine.store_channel import (SECRET_ENV, SECRET_FILE_ENV, StoreFront, StoreWorker,
                                         secret_from_environment)
from distributed import in_child, spawn


class Pump:
    """Runs a `LocalFront`'s receive loop on a thread (the front end accepts while it
    receives) and collects the messages."""

    def __init__(self, front: LocalFront) -> None:
        self.front, self.messages, self._stop = front, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.messages += self.front.receive(0.05)

    def wait(self, until, seconds: float = 10.0) -> None:
        deadline = time.monotonic() + seconds
        while not until() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert until(), "timed out"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_local_control_plane_refuses_a_process_that_only_knows_the_port():
    secret = new_secret()
    front = LocalFront(2, secret)
    assert front.address[0] == "127.0.0.1"
    pump = Pump(front)
    try:
        # A silent peer, then an attacker with a wrong secret: both refused, and neither
        # keeps the front end from accepting the real workers.
        silent = socket.create_connection(front.address)
        attacker = Connection(socket.create_connection(front.address).detach())
        assert attacker.poll(10)
        assert attacker.recv_bytes().startswith(b"dlo-fx-engine")  # only a fresh nonce
        attacker.send_bytes(os.urandom(64))
        with pytest.raises((EOFError, OSError)):
            attacker.recv_bytes()  # refused: closed, with nothing to read
        assert front.conns == {}
        # A worker holding another engine's secret fails the front end's proof.
        with pytest.raises(ChannelError, match="failed authentication"):
            LocalWorker(front.address, new_secret(), 0)
        workers = {rank: LocalWorker(front.address, secret, rank) for rank in (1, 0)}
        pump.wait(lambda: len(front.conns) == 2)
        # Every worker connected: the port is closed, nobody else can even connect.
        with pytest.raises(OSError):
            socket.create_connection(front.address, timeout=2)
        front.broadcast({"kind": "wave", "seq": 0})
        assert workers[0].receive() == {"kind": "wave", "seq": 0}
        workers[1].send({"kind": "done", "seq": 0}, b"xyz")
        pump.wait(lambda: pump.messages)
        (message,) = pump.messages
        assert message.rank == 1 and message.header["kind"] == "done"
        assert message.payload == b"xyz"
        silent.close()
    finally:
        pump.stop()
        front.close()


def test_silent_peers_do_not_delay_the_local_front_end():
    """Issue 40, item 11: connections that never answer the handshake, queued ahead of
    the workers, neither block the front end's receive loop nor delay the workers."""
    secret = new_secret()
    front = LocalFront(2, secret)
    silent = [socket.create_connection(front.address, timeout=5) for _ in range(3)]
    try:
        start = time.monotonic()
        assert front.receive(0.05) == []
        assert time.monotonic() - start < 1.0  # each silent peer took 2 s, one by one
        joined = []
        for rank in (0, 1):
            threading.Thread(target=lambda r=rank: joined.append(LocalWorker(
                front.address, secret, r)), daemon=True).start()
        while len(front.conns) < 2 and time.monotonic() - start < 10:
            began = time.monotonic()
            front.receive(0.05)
            assert time.monotonic() - began < 1.0
        assert sorted(front.conns) == [0, 1] and time.monotonic() - start < 4.0  # 6 s
    finally:
        for sock in silent:
            sock.close()
        front.close()


def test_torchrun_control_messages_are_signed_and_deleted():
    store = dist.HashStore()
    secret = new_secret()
    front = StoreFront(store, secret, 2)
    workers = [StoreWorker(store, secret, r) for r in range(2)]
    front.receive(0)  # answers both workers' greetings: each learns the job's nonce
    for rank, worker in enumerate(workers):
        worker.send({"kind": "ready", "rank": rank})
    assert sorted(m.rank for m in _receive(front, 2)) == [0, 1]
    assert store.num_keys() == 0  # greetings and messages deleted once read
    front.broadcast({"kind": "wave", "seq": 0, "requests": ["a prompt"]})
    assert workers[1].receive()["requests"] == ["a prompt"]
    workers[1].send({"kind": "reply", "seq": 0}, b"x" * (9 << 20))  # chunked past 8 MiB
    (message,) = front.receive(5.0)
    assert message.rank == 1 and len(message.payload) == 9 << 20
    assert store.num_keys() == 1  # only the wave message, until the wave ends
    front.retire()
    assert store.num_keys() == 0


def _receive(front: StoreFront, count: int, seconds: float = 10.0) -> list:
    """``count`` messages from ``front``, waiting at most ``seconds``."""
    messages, deadline = [], time.monotonic() + seconds
    while len(messages) < count and time.monotonic() < deadline:
        messages += front.receive(0.05)
    assert len(messages) == count, messages
    return messages


def _joined(worker: StoreWorker, front: StoreFront) -> None:
    """Let ``worker`` learn the job's nonce from ``front`` (its first send does), pumping
    the front end meanwhile; bounded."""
    sent = threading.Thread(target=worker.send, args=({"kind": "ready"},), daemon=True)
    sent.start()
    _receive(front, 1)
    sent.join(10)
    assert not sent.is_alive()


def test_torchrun_messages_of_another_job_are_refused():
    """Issue 40, item 9: a value recorded in job 1 and written into job 2 (same secret,
    same key) is refused on both sides; the genuine message written after it is taken."""
    from control_attacks import other_job

    secret = new_secret()
    reply = {"kind": "reply", "seq": 0, "wave": 0, "index": 1, "dp_rank": 1}
    recorded = other_job(secret, 1, 2, [({"kind": "ready"}, b""),
                                        (reply, b"job 1's output")])
    store = dist.HashStore()
    front = StoreFront(store, secret, 2)
    worker = StoreWorker(store, secret, 1)
    for key, value in recorded.items():  # before job 2's worker writes these keys
        store.set(key, value)
    assert front.receive(0.2) == []  # job 1's ready: refused, not raised
    _joined(worker, front)
    assert front.receive(0.2) == []  # job 1's reply: refused
    assert "'msg/1/1'" in front.refused and "failed authentication" in front.refused
    worker.send(reply, b"job 2's output")
    (message,) = _receive(front, 1)
    assert message.header["kind"] == "reply" and message.payload == b"job 2's output"

    # The front end's messages of job 1 are refused by job 2's worker, which waits for
    # its own front end's message on the same key.
    old = StoreFront(dist.HashStore(), secret, 2)
    old.broadcast({"kind": "wave", "seq": 0, "requests": ["job 1's prompt"]})
    store.set("wave/0", old.store.get("wave/0"))
    got = []
    reader = threading.Thread(target=lambda: got.append(worker.receive()), daemon=True)
    reader.start()
    reader.join(0.5)
    assert got == [] and "'wave/0'" in worker.refused
    front.broadcast({"kind": "wave", "seq": 0, "requests": ["job 2's prompt"]})
    reader.join(10)
    assert got == [{"kind": "wave", "seq": 0, "requests": ["job 2's prompt"]}]


def test_torchrun_greeting_survives_forged_and_replayed_values():
    """A worker learns the job's nonce only from a value bound to its own fresh nonce: a
    forged greeting read by the front end, or the front end's answer of another job, is
    refused, and the worker joins once the front end answers its genuine greeting."""
    secret = new_secret()
    old_store = dist.HashStore()
    old_front = StoreFront(old_store, secret, 2)
    StoreWorker(old_store, secret, 0)
    old_front.receive(0)
    replayed = old_store.get("job/0")
    store = dist.HashStore()
    front = StoreFront(store, secret, 2)
    worker = StoreWorker(store, secret, 0)
    store.set("hello/0", b"forged")  # overwrites the worker's greeting
    front.receive(0)  # answers the forged one
    store.set("job/0", replayed)  # and another job's answer on top
    _joined(worker, front)
    assert "'job/0'" in worker.refused
    assert store.num_keys() == 0

    # A rank with another secret: it refuses every answer, and both ends say so.
    front = StoreFront(dist.HashStore(), secret, 2)
    stranger = StoreWorker(front.store, new_secret(), 1, timeout_s=2.5)
    failed = []
    sent = threading.Thread(target=lambda: failed.append(pytest.raises(
        ChannelError, stranger.send, {"kind": "ready"})), daemon=True)
    sent.start()
    deadline = time.monotonic() + 10
    while sent.is_alive() and time.monotonic() < deadline:
        assert front.receive(0.05) == []
    assert "same control-plane secret" in str(failed[0].value)
    assert "worker rank 1 refused that answer (it holds another control-plane secret" \
        in front.refused and SECRET_ENV in front.refused


def test_torchrun_unauthenticated_values_are_refused_never_raised():
    """Issue 40, item 10: an unauthenticated value at ``msg/0/0`` is refused (never an
    exception out of the front end), and the genuine message that overwrites it is taken.
    A reply whose payload was changed after its worker wrote it arrives as an error."""
    from control_attacks import forged_reply

    secret = new_secret()
    store = dist.HashStore()
    front = StoreFront(store, secret, 2)
    workers = [StoreWorker(store, secret, r) for r in range(2)]
    store.set("msg/0/0", forged_reply(0))
    store.set("msg/1/0", b"short")
    assert front.receive(0.2) == []
    assert front.refused.startswith("refused 2 values") and "'msg/1/0'" in front.refused
    for worker in workers:
        _joined(worker, front)
    workers[1].send({"kind": "reply", "seq": 0, "index": 1}, b"the output")
    store.set("msg/1/1/0", b"the attacker's output")  # after the worker wrote it
    (message,) = _receive(front, 1)
    assert message.payload == b"" and "altered" in message.header["error"]
    assert "'msg/1/1'" in message.header["error"]


def _torchrun_engine(store, secret: bytes, **kwargs) -> Engine:
    """An engine over a torchrun job of one rank, in this process: rank 0's worker (the
    `control_attacks.echo` pipeline) on its thread, the control plane in ``store``."""
    spec = Engine("control_attacks:echo", 1, **kwargs).spec
    workers = TorchrunWorkers(store, secret, spec, "cpu")
    return Engine("control_attacks:echo", 1, launcher=workers.launch, **kwargs)


def test_torchrun_engine_answers_its_own_job_despite_replays_and_forgeries():
    """Issue 40, items 9 and 10 through the engine: every message job 1's worker wrote,
    recorded and written into job 2 (same secret) before it starts, and an unauthenticated
    value where job 2's second reply goes: job 2 answers its own requests, its workers
    kept."""
    from control_attacks import Store, forged_reply

    secret = new_secret()
    job1 = Store(dist.HashStore())
    with _torchrun_engine(job1, secret, wave_timeout_s=30) as engine:
        (first,) = engine.generate([Request(prompt="job 1", seed=1)])
    assert torch.equal(first.output, torch.full((2, 3), 1.0))
    job2 = dist.HashStore()
    for key, value in job1.sets.items():
        if key.startswith("msg/"):
            job2.set(key, value)
    job2.set("msg/0/3", forged_reply(0, seq=1, wave=1))
    with _torchrun_engine(job2, secret, wave_timeout_s=30) as engine:
        results = engine.generate([Request(prompt="job 2", seed=2),
                                   Request(prompt="job 2 again", seed=3)])
        assert results[0].ok and results[0].output[0, 0] == 2.0  # not job 1's 1.0
        assert results[1].ok and results[1].output[0, 0] == 3.0
        assert engine.generations == 1
        assert "'msg/0/3'" in engine._workers.channel.refused


def test_torchrun_engine_answers_overwritten_messages_with_errors():
    """Issue 40, item 10: genuine messages overwritten by an unauthenticated value right
    after their worker wrote them. A reply (the worker's next message proves it was
    written) becomes that request's error at once, the workers kept; a reply and the
    worker's last message of the wave fail the wave at its timeout. Every error names the
    refused key; nothing escapes `generate`."""
    from control_attacks import Store, forged_reply

    overwritten = {"msg/0/1", "msg/0/3", "msg/0/4"}  # wave 0's reply; wave 1's reply, done
    store = Store(dist.HashStore(), lambda key, value: forged_reply(0) if key in overwritten
                  else value)
    with _torchrun_engine(store, new_secret(), wave_timeout_s=1.5) as engine:
        start = time.monotonic()
        (first,) = engine.generate([Request(prompt="x", seed=1)])  # not at the timeout:
        assert first.output is None and first.dp_rank == 0  # the error says why
        assert engine.generations == 1 and engine._workers is not None
        assert "ChannelError: its reply at 'msg/0/1' in the job's store was replaced" \
            in first.error
        (second,) = engine.generate([Request(prompt="y", seed=2)])
        assert time.monotonic() - start < 10
    assert second.output is None and "timed out after 1.5 s" in second.error
    assert "refused 3 values in the job's store, the latest at 'msg/0/4': it failed " \
        "authentication" in second.error, second.error


def _secrets_from_environment(folder: str) -> list:
    """What `secret_from_environment` says for each environment (in a child process)."""
    os.environ.pop(SECRET_ENV, None)
    os.environ.pop(SECRET_FILE_ENV, None)
    said = []

    def said_now():
        try:
            said.append(secret_from_environment())
        except ValueError as exc:
            said.append(str(exc))

    said_now()
    os.environ[SECRET_ENV] = "ab" * 32
    said_now()
    del os.environ[SECRET_ENV]
    path = os.path.join(folder, "secret")
    with open(path, "wb") as f:
        f.write(b"s" * 32)
    os.chmod(path, 0o644)
    os.environ[SECRET_FILE_ENV] = path
    said_now()
    os.chmod(path, 0o600)
    said_now()
    return said


def test_torchrun_secret_comes_from_the_environment(tmp_path):
    """In a child process: this process's environment is read by the engines the spawned
    jobs start meanwhile (tests/conftest.py)."""
    (said,) = spawn(1, in_child, _secrets_from_environment, str(tmp_path)).values()
    assert SECRET_ENV in said[0]
    assert said[1] == bytes.fromhex("ab" * 32)
    assert "chmod 600" in said[2]
    assert said[3] == b"s" * 32


def test_requests_are_refused_up_front_naming_the_field():
    with pytest.raises(ValueError, match="Request.seed=.*2\\*\\*64"):
        Request(prompt="x", seed=2**70)
    with pytest.raises(ValueError, match="Request.prompt is not valid text"):
        Request(prompt="a \ud800 b")
    with pytest.raises(ValueError, match="Request.negative_prompt is 2097152 bytes"):
        Request(prompt="x", negative_prompt="n" * (2 << 20))
    with pytest.raises(ValueError, match="Request.extra_args is"):
        Request(prompt="x", extra_args={"blob": "b" * (2 << 20)})
    for removed in ("fps", "quality_mode", "lora_scale"):
        with pytest.raises(ValueError, match=f"unknown request field.*'{removed}'"):
            Request.from_dict({"prompt": "x", removed: 1})
    limits = resident(width=64, depth=1, heads=4).limits
    ok = dict(prompt="x", height=64, width=64)
    limits.check(Request(**ok))
    refused = [("height", dict(height=2**19), "at most 2048"),
               ("width", dict(width=4096), "at most 2048"),
               ("height", dict(height=60), "multiple of 16"),
               ("width", dict(width=72), "multiple of 16"),
               ("num_frames", dict(num_frames=5), "at most 1"),
               ("num_inference_steps", dict(num_inference_steps=10**6), "at most 1000"),
               ("num_outputs_per_prompt", dict(num_outputs_per_prompt=64), "at most 16"),
               ("prompt", dict(prompt="p" * (65 << 10)), "reads at most 65536"),
               ("negative_prompt", dict(negative_prompt="n" * (65 << 10)), "at most 65536"),
               ("lora_id", dict(lora_id="style"), "LoRA adapters none")]
    for field, change, why in refused:
        with pytest.raises(ValueError, match=f"request 3: Request.{field}.*{why}"):
            limits.check(Request(**{**ok, **change}), "request 3")
    video = Limits(max_frames=81, frames_multiple=4)
    video.check(Request(prompt="x", num_frames=81))
    with pytest.raises(ValueError, match="num_frames=80.*4k \\+ 1"):
        video.check(Request(prompt="x", num_frames=80))
    with pytest.raises(ValueError, match="Limits.size_multiple=0"):
        Limits(size_multiple=0)
    assert Limits.from_value(limits.to_dict()) == limits


def test_fault_hooks_are_off_by_default():
    request = Request(prompt="x", height=32, width=32, num_inference_steps=2,
                      extra_args={"fault": "raise", "fault_rank": 0, "fault_step": 0})
    pipeline = resident(width=64, depth=1, heads=4)
    assert not pipeline.fault_hooks
    assert pipeline(request).shape == (1, 4, 4, 4)  # the hook did not fire
    pipeline.fault_hooks = True
    with pytest.raises(RuntimeError, match="injected fault on rank 0 at step 0"):
        pipeline(request)


def test_forward_clock_counts_and_pads_on_the_smallest_input():
    calls = []
    clock = ForwardClock(lambda x: calls.append(x.shape) or x)
    clock(torch.zeros(4, 4))
    clock(torch.zeros(2, 2))
    clock(torch.zeros(3, 3))
    clock.pad(2)
    assert calls[3:] == [(2, 2), (2, 2)] and clock.started == clock.finished == 5
    broken = ForwardClock(lambda x: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        broken(torch.zeros(1))
    assert not broken.in_step
    with pytest.raises(RuntimeError, match="has not run its model yet"):
        ForwardClock(lambda x: x).pad(1)


def test_mixed_requests_are_packed_into_the_fewest_waves():
    small = Request(prompt="s", height=32, width=32, num_inference_steps=2)
    big = Request(prompt="b", height=64, width=64, num_inference_steps=4)
    mixed = [small, big, small, big, small]
    assert plan_waves(mixed, 2, mixed=True) == [[1, 3], [0, 2], [4]]  # costliest first
    assert plan_waves(mixed, 2, mixed=False) == [[0, 2], [4], [1, 3]]  # by wave key


FRONT_END = textwrap.dedent("""
    import json, sys, time
    from dlo_fx.apps.engine import Engine, Request
    engine = Engine("dlo_fx.apps.engine.reference_pipeline:build", 2, wave_timeout_s=300,
                    pipeline_kwargs=dict(width=64, depth=2, heads=4, fault_hooks=True))
    engine.start()
    print(json.dumps([p.pid for p in engine._workers.procs]), flush=True)
    hang = {"fault": "hang", "fault_rank": 1, "fault_step": 0}
    engine.run_wave([Request(prompt="x", height=32, width=32, num_inference_steps=2,
                             extra_args=hang)] * 2)
""")


def test_workers_exit_within_5_s_of_the_front_end_being_killed_mid_wave():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", FRONT_END], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        pids = json.loads(proc.stdout.readline())
        time.sleep(2.0)  # the wave is running: rank 1 hangs, rank 0 waits in a gather
        assert all(_alive(pid) for pid in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), "orphaned workers"
    finally:
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

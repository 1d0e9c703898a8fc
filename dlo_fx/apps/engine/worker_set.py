"""Worker sets: one generation of worker processes, seen from the front end.

A `WorkerSet` broadcasts waves on its channel and collects the replies while it watches
the ways a wave can fail as a whole: a worker reports a fatal error, a worker process or
its connection dies, the wave outlives its timeout. Any of them raises `WaveFailed`
(carrying the replies that did arrive); the engine then closes the set (killing its
processes) and starts a fresh one for the next call. `LocalWorkers` starts the processes
itself on this node; `serve.TorchrunWorkers` drives ranks started by ``torchrun``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import shutil
import tempfile
import time
from typing import Any, Optional, Sequence

from .channel import LocalFront, Message, decode_output, new_secret
from .factories import DIFFUSERS
from .limits import Limits
from .request import Request
from .worker import WorkerSpec, split_factory, spawned_worker

log = logging.getLogger(__name__)


class WaveFailed(Exception):
    """A wave (or the start of the workers) failed; the message says why. ``replies``
    holds what did arrive: ``{request index: reply}``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.replies: dict[int, dict] = {}


class WorkerSet:
    """The front end's view of one generation of workers."""

    def __init__(self, channel: Any, spec: WorkerSpec) -> None:
        self.channel = channel
        self.spec = spec
        self.world = spec.topology.world_size
        self.ready: dict[int, dict] = {}
        self.fatal: dict[int, dict] = {}
        self.mixed = False
        """Every rank's pipeline keeps a forward clock (see [Note: the forward clock of a wave])."""
        self.limits = Limits(lora_ids=None)
        """What the pipeline declared it serves (rank 0's, once ready)."""
        self._inbox: list[Message] = []
        self._seq = 0
        self._refused = ""
        """``channel.refused`` when the current wait began: a timeout names what the
        channel refused since (see [Note: messages bound to their job])."""
        self._lost: dict[int, str] = {}
        """Ranks with a message of this wave lost in the store, and its key."""

    # -- what subclasses provide ------------------------------------------------------------
    def dead(self) -> list[str]:
        """Descriptions of workers known to have died (polled; cheap)."""
        return []

    def close(self, *, kill: bool) -> None:
        """Stop the workers: ``kill`` at once (after a failure), or ask them to stop."""

    def settle(self, timeout_s: float) -> None:
        """Give workers whose connection closed up to ``timeout_s`` to finish exiting, so
        that `dead` can say how they exited."""

    # -- the protocol -----------------------------------------------------------------------
    def _pump(self, timeout_s: float) -> None:
        for message in self.channel.receive(timeout_s):
            kind = message.header.get("kind")
            if kind == "fatal":
                self.fatal[message.rank] = message.header.get("report", {})
            elif kind == "ready":
                self.ready[message.rank] = message.header
            else:
                self._inbox.append(message)

    def _check(self, deadline: float, waiting_for: str, timeout_s: float) -> None:
        if self.fatal or self.channel.lost or self.dead():
            raise WaveFailed(self._failure(waiting_for))
        if time.monotonic() > deadline:
            refused = self.channel.refused
            raise WaveFailed(f"timed out after {timeout_s:g} s (wave_timeout_s) while "
                             f"{waiting_for}" + (f"; meanwhile the control plane "
                                                 f"{refused}" if refused != self._refused
                                                 else ""))

    def _failure(self, waiting_for: str) -> str:
        """Why a wave failed: the workers that died, then what the others reported. A death
        makes its peers' collectives fail too (gloo: "Connection closed by peer"), and their
        reports can arrive before the death shows, so a worker whose connection closed, or
        whose peers reported, gets up to a second to finish exiting (`settle`) and be named
        with its exit code."""
        self._pump(0.05)  # a worker may have reported why just before exiting
        if not self.dead():
            self.settle(1.0)
            self._pump(0)
        lost = sorted(self.channel.lost.items())
        dead = self.dead() or [f"worker rank {r}: {why}" for r, why in lost]
        dead = [d for d in dead  # a worker that reported is named by its report
                if not any(re.match(rf"worker rank {r}\b", d) for r in self.fatal)]
        reports = [self._fatal_message()] if self.fatal else []
        if not dead:
            return "; ".join(reports)
        return f"{'; '.join(dead + reports)} while {waiting_for}"

    def _fatal_message(self) -> str:
        for rank, report in sorted(self.fatal.items()):
            log.error("dlo engine: worker rank %d failed:\n%s", rank, report.get("traceback"))
        return "; ".join(f"worker rank {rank} (dp_rank {r.get('dp_rank')}) raised "
                         f"{r.get('error')} (at {r.get('where')})"
                         for rank, r in sorted(self.fatal.items()))

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._refused = self.channel.refused
        while len(self.ready) < self.world:
            self._check(deadline, "starting the workers", timeout_s)
            self._pump(0.02)
        self.mixed = all(h.get("mixed") for h in self.ready.values())
        self.limits = Limits.from_value(self.ready[0].get("limits"))

    def run(self, wave: int, requests: Sequence[Request], assign: Sequence[Optional[int]],
            timeout_s: float) -> dict[int, dict]:
        """Broadcast one wave (``assign[d]``: the request replica ``d`` runs, or ``None``);
        return ``{request index: reply}`` once every rank is done with it."""
        seq = self._seq
        self._seq += 1
        deadline = time.monotonic() + timeout_s
        self._refused = self.channel.refused
        self._lost.clear()
        self.channel.broadcast({"kind": "wave", "seq": seq, "wave": wave,
                                "requests": [r.to_dict() for r in requests],
                                "assign": list(assign)})
        replier = {i: assign.index(i) for i in assign if i is not None}
        replies: dict[int, dict] = {}
        done: set[int] = set()
        try:
            while len(done) < self.world or len(replies) < len(replier):
                self._take_inbox(seq, replier, replies, done)
                if len(done) == self.world and len(replies) == len(replier):
                    break
                waiting = [d for i, d in sorted(replier.items()) if i not in replies]
                self._check(deadline, f"waiting for wave {wave} on dp rank(s) "
                            f"{waiting or sorted(set(range(self.world)) - done)}", timeout_s)
                self._pump(0.02)
        except WaveFailed as exc:
            # What arrived before the failure was noticed (the last pump of `_check`
            # included) is kept: a rank's reply sent before its peer died is complete.
            try:
                self._take_inbox(seq, replier, replies, done)
            except WaveFailed:
                pass
            exc.replies = replies
            raise
        self.channel.retire()
        return replies

    def _take_inbox(self, seq: int, replier: dict, replies: dict, done: set) -> None:
        inbox, self._inbox = self._inbox, []
        for message in inbox:
            self._accept(message, seq, replier, replies, done)

    def _accept(self, message: Message, seq: int, replier: dict, replies: dict,
                done: set) -> None:
        header = message.header
        if header.get("kind") == "lost":  # see [Note: messages bound to their job]
            self._lost[message.rank] = header["key"]
            return
        if header.get("seq") != seq:
            raise WaveFailed(f"worker rank {message.rank} sent a {header.get('kind')!r} for "
                             f"message {header.get('seq')}, expected {seq}")
        if header.get("kind") == "done":
            done.add(message.rank)
            if message.rank in self._lost:
                self._lost_replies(message.rank, replier, replies)
            return
        index = header.get("index")
        if (header.get("kind") != "reply" or index not in replier or index in replies
                or header.get("dp_rank") != replier[index]):
            raise WaveFailed(f"worker rank {message.rank} sent an unexpected reply for request "
                             f"{index} (dp rank {header.get('dp_rank')})")
        reply = dict(header)
        if "error" not in header:
            reply["output"] = decode_output(message.payload)
        replies[index] = reply

    def _lost_replies(self, rank: int, replier: dict, replies: dict) -> None:
        """Worker ``rank`` finished the wave, but a message of it was replaced in the
        store: a reply it owes that has not arrived is that message; answer it with an
        error naming the key."""
        key, topology = self._lost.pop(rank), self.spec.topology
        if not topology.replies(rank):
            return
        for index, dp_rank in replier.items():
            if index not in replies and dp_rank == topology.dp_rank(rank):
                replies[index] = {"dp_rank": dp_rank, "error": (
                    f"ChannelError: its reply at {key!r} in the job's store was replaced by a "
                    "value that failed authentication (a process without this job's secret "
                    "wrote it)")}

    def problem(self) -> Optional[str]:
        """Why this set cannot take a wave (a worker failed or died while idle), or
        ``None`` when it is healthy."""
        try:
            self._pump(0)
        except Exception as exc:  # the control plane itself failed
            return f"the control plane failed ({exc})"
        if self.fatal:
            return self._fatal_message()
        dead = self.dead() + [f"worker rank {r}: {why}" for r, why in self.channel.lost.items()]
        return "; ".join(dead) if dead else None

    def stop(self) -> None:
        self.channel.broadcast({"kind": "stop"})


# [Note: workers fork from a fork server]
# A local worker costs a fork, not a fresh interpreter importing torch, and starts as
# ``spawn`` would start it. Workers start through multiprocessing's ``forkserver``: a
# process started once per front end (the first engine's workers start it) imports torch,
# Dynamo and dlo_fx (and diffusers for the diffusers factory) and then forks every worker;
# the engine pays a start again for every wave that fails closed, since it then starts
# fresh workers. The server is single-threaded and never touches a device, so forking it
# is safe; each worker receives the front end's ``sys.path``, working folder and main
# module from multiprocessing, and its environment from `spawned_worker` (the server's is
# that of the first start). A user's factory module is never imported in the server (its
# import may touch a device or start threads): each worker imports it, as with ``spawn``.
# A worker's parent is the server, not the front end, so the worker watches the front
# end's pid itself (`worker.watch_front_end`).
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "dlo_fx.dynamo.backend",
            "dlo_fx.apps.engine.worker")


def worker_context(pipeline: str) -> Any:
    """The multiprocessing context local workers start from (see the Note above)."""
    ctx = mp.get_context("forkserver")
    preload = list(_PRELOAD)
    module = split_factory(DIFFUSERS)[0]
    if split_factory(pipeline)[0] == module:
        preload += ["diffusers", module]
    # Applies when this call starts the server; a running server keeps its modules (all
    # the more imported: a worker imports what it misses).
    ctx.set_forkserver_preload(preload)
    return ctx


class LocalWorkers(WorkerSet):
    """``world_size`` worker processes on this node (forked from a fork server: see [Note:
    workers fork from a fork server]), each on its own authenticated loopback connection
    (see [Note: the control plane's trust model] in channel.py); their process group meets
    in a ``FileStore`` in a private folder."""

    def __init__(self, spec: WorkerSpec) -> None:
        world = spec.topology.world_size
        secret = new_secret()
        super().__init__(LocalFront(world, secret), spec)
        self._dir = tempfile.mkdtemp(prefix="dlo-engine-")  # mode 0700
        rendezvous = os.path.join(self._dir, "rendezvous")
        ctx = worker_context(spec.pipeline)
        env = dict(os.environ)
        self.procs = [ctx.Process(target=spawned_worker, name=f"dlo-engine-rank{rank}",
                                  args=(rank, spec, self.channel.address, secret, rendezvous,
                                        os.getpid(), env), daemon=True)
                      for rank in range(world)]
        try:
            for proc in self.procs:
                proc.start()
        except BaseException:
            self.close(kill=True)
            raise
        log.info("dlo engine: started %d worker processes (pids %s)", world,
                 [p.pid for p in self.procs])

    def dead(self) -> list[str]:
        return [f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                for rank, p in enumerate(self.procs) if p.exitcode is not None]

    def settle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))

    def close(self, *, kill: bool) -> None:
        if not kill:
            try:
                self.stop()
            except Exception:
                kill = True
        deadline = time.monotonic() + (0 if kill else 10)
        for proc in self.procs:
            if proc.pid is None:  # never started
                continue
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        self.channel.close()
        shutil.rmtree(self._dir, ignore_errors=True)

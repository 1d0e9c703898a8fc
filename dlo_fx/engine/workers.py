"""Worker sets: one generation of worker processes, seen from the front end.

A `WorkerSet` publishes waves on its `WaveChannel` and collects the replies while it
watches three ways a wave can fail: a worker posts an error, a worker process dies, the
wave outlives its timeout. Any of them raises `WaveFailed`; the engine then closes the
set (killing its processes) and starts a fresh one for the next call.
`LocalWorkers` starts the processes itself on this node; `serve.TorchrunWorkers` drives
ranks started by ``torchrun``.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import time
from typing import Any, Optional, Sequence

from .channel import Backoff, WaveChannel
from .request import Request
from .worker import WorkerSpec, spawned_worker

log = logging.getLogger(__name__)


class WaveFailed(Exception):
    """A wave (or the start of the workers) failed; the message says why."""


class WorkerSet:
    """The front end's view of one generation of workers."""

    def __init__(self, channel: WaveChannel, spec: WorkerSpec) -> None:
        self.channel = channel
        self.spec = spec
        self.world = spec.topology.world_size
        self._seq = 0

    # -- what subclasses provide ------------------------------------------------------------
    def dead(self) -> list[str]:
        """Descriptions of workers known to have died (polled; cheap)."""
        return []

    def close(self, *, kill: bool) -> None:
        """Stop the workers: ``kill`` at once (after a failure), or ask them to stop."""

    # -- the protocol -----------------------------------------------------------------------
    def _check(self, deadline: float, waiting_for: str, timeout_s: float) -> None:
        if self.channel.fatal_count():
            raise WaveFailed(self._fatal_message())
        dead = self.dead()
        if dead:
            if self.channel.fatal_count():  # it posted why just before exiting
                raise WaveFailed(self._fatal_message())
            raise WaveFailed(f"{'; '.join(dead)} while {waiting_for}")
        if time.monotonic() > deadline:
            raise WaveFailed(f"timed out after {timeout_s:g} s (wave_timeout_s) while "
                             f"{waiting_for}")

    def _fatal_message(self) -> str:
        reports = self.channel.fatal(self.world)
        for rank, report in sorted(reports.items()):
            log.error("dlo engine: worker rank %d failed:\n%s", rank, report.get("traceback"))
        return "; ".join(f"worker rank {rank} (dp_rank {r['dp_rank']}) raised {r['error']} "
                         f"(at {r['where']})" for rank, r in sorted(reports.items()))

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        backoff = Backoff()
        while self.channel.ready_count(self.world) < self.world:
            self._check(deadline, "starting the workers", timeout_s)
            backoff.sleep()

    def run(self, wave_id: int, requests: Sequence[Request],
            timeout_s: float) -> dict[int, tuple[Any, dict]]:
        """Broadcast one wave; return ``{dp_rank: (output, meta)}`` from every replica."""
        seq = self._seq
        self._seq += 1
        deadline = time.monotonic() + timeout_s
        self.channel.publish(seq, {"wave_id": wave_id,
                                   "requests": [r.to_dict() for r in requests]})
        dp = self.spec.topology.dp_size
        replies: dict[int, tuple[Any, dict]] = {}
        backoff = Backoff()
        while len(replies) < dp:
            if self.channel.reply_count(seq) > len(replies):
                for dp_rank in range(dp):
                    if dp_rank not in replies:
                        reply = self.channel.take_reply(seq, dp_rank)
                        if reply is not None:
                            replies[dp_rank] = reply
                continue
            missing = [d for d in range(dp) if d not in replies]
            self._check(deadline, f"waiting for the replies of dp rank(s) {missing}",
                        timeout_s)
            backoff.sleep()
        return replies

    def problem(self) -> Optional[str]:
        """Why this set cannot take a wave (a worker failed or died while idle), or
        ``None`` when it is healthy."""
        try:
            if self.channel.fatal_count():
                return self._fatal_message()
        except Exception as exc:  # the store itself is gone
            return f"the control store failed ({exc})"
        dead = self.dead()
        return "; ".join(dead) if dead else None

    def stop(self) -> None:
        self.channel.publish(self._seq, {"stop": True})


class LocalWorkers(WorkerSet):
    """``world_size`` worker processes on this node (multiprocessing spawn), talking to a
    ``TCPStore`` this process hosts on the loopback interface; their process group meets
    in the same store."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=spec.timeout_s)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timeout)
        super().__init__(WaveChannel(self._store), spec)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=spawned_worker, name=f"dlo-engine-rank{rank}",
                                  args=(rank, spec, "127.0.0.1", self._store.port),
                                  daemon=True)
                      for rank in range(self.world)]
        for proc in self.procs:
            proc.start()
        log.info("dlo engine: started %d worker processes (pids %s)", self.world,
                 [p.pid for p in self.procs])

    def dead(self) -> list[str]:
        return [f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                for rank, p in enumerate(self.procs) if p.exitcode is not None]

    def close(self, *, kill: bool) -> None:
        if not kill:
            try:
                self.stop()
            except Exception:
                kill = True
        deadline = time.monotonic() + (0 if kill else 10)
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        self._store = None

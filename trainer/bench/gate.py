"""Turn-taking between the systems, and the clock that times each step the same way in all of them.

All four systems are started at once, one launcher (one process group) each, and each rank connects
to the coordinator. The coordinator hands the turn round (A B C D A B C D ...): a system runs
``chunk`` steps, then every rank reports back and blocks until its next turn. Only one system computes
at a time, so they never compete for the cores or the GPU, and a drift in machine load is shared
by all of them instead of landing on whichever ran last.

Messages are JSON lines over a local TCP socket; a random token keeps stray connections out.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class LineConn:
    """JSON lines over a socket, with a receive timeout that still notices dead worker groups."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def recv(self, timeout_s: float | None = None, alive: Callable[[], None] | None = None) -> dict[str, Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            if alive is not None:
                alive()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no message from a worker in time")
            # Poll in short slices only when someone must check liveness; a worker just blocks.
            self.sock.settimeout(1.0 if alive is not None else None)
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not chunk:
                raise ConnectionError("the other side closed the connection")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


# ---------------------------------------------------------------- coordinator side


class Group:
    """One system's launcher process and the connections of its ranks."""

    def __init__(self, system: str, proc: subprocess.Popen, log: Path):
        self.system = system
        self.proc = proc
        self.log = log
        self.conns: dict[int, LineConn] = {}


class WorkerFailed(RuntimeError):
    pass


class Coordinator:
    def __init__(self, token: str):
        self.token = token
        self.server = socket.create_server(("127.0.0.1", 0))
        self.groups: dict[str, Group] = {}

    @property
    def address(self) -> str:
        host, port = self.server.getsockname()[:2]
        return f"{host}:{port}"

    def check_alive(self) -> None:
        for group in self.groups.values():
            code = group.proc.poll()
            if code is not None and code != 0:
                raise WorkerFailed(f"{group.system}: the launcher exited with {code}; see {group.log}")

    def accept_all(self, world_size: int, timeout_s: float) -> None:
        """Wait until every rank of every group has said hello."""
        expected = len(self.groups) * world_size
        deadline = time.monotonic() + timeout_s
        self.server.settimeout(1.0)
        connected = 0
        while connected < expected:
            self.check_alive()
            if time.monotonic() > deadline:
                raise WorkerFailed(f"only {connected} of {expected} ranks connected in {timeout_s:.0f}s")
            try:
                sock, _ = self.server.accept()
            except TimeoutError:
                continue
            conn = LineConn(sock)
            hello = conn.recv(timeout_s=60, alive=self.check_alive)
            if hello.get("token") != self.token or hello.get("system") not in self.groups:
                sock.close()
                continue
            self.groups[hello["system"]].conns[int(hello["rank"])] = conn
            connected += 1

    def turn(self, system: str, timeout_s: float) -> list[dict[str, Any]]:
        """Let ``system`` run its next chunk; returns each rank's message ("yield" or "result")."""
        group = self.groups[system]
        ranks = sorted(group.conns)
        for rank in ranks:
            group.conns[rank].send({"go": True})
        messages = [group.conns[rank].recv(timeout_s, alive=self.check_alive) for rank in ranks]
        for rank, message in zip(ranks, messages, strict=True):
            if "error" in message:
                raise WorkerFailed(f"{system} rank {rank} failed:\n{message['error']}")
        return messages

    def close(self) -> None:
        self.server.close()


# ---------------------------------------------------------------- worker side


class GateClient:
    def __init__(self, address: str, token: str, system: str, rank: int):
        host, port = address.rsplit(":", 1)
        self.conn = LineConn(socket.create_connection((host, int(port))))
        self.conn.send({"token": token, "system": system, "rank": rank})

    def wait_turn(self) -> None:
        message = self.conn.recv()
        if not message.get("go"):
            raise RuntimeError(f"unexpected message from the coordinator: {message}")

    def send(self, message: dict[str, Any]) -> None:
        self.conn.send(message)


class StepClock:
    """Times every system the same way: the wall time from one step-end hook to the next.

    Each system calls ``begin()`` once its engine is built and ``step_end()`` after every optimizer
    step (from a callback in the Trainers, inline in the hand-written loops), so a step's time covers
    the whole loop iteration: data loading, forward, backward, optimizer step and whatever the loop
    does around them. On a GPU the hook first waits for the queued work (``sync``), as all systems
    do in bench mode only. The time spent waiting for the turn is not counted.

    Beside the wall time it records the process's CPU time over the same interval (all its threads).
    On a CPU machine shared with other work it leaves out the time other processes held the cores,
    but it includes the CPU gloo spends polling while a rank waits for the other.

    ``profile``: a callable returning a started profiler context, run over ``profile_steps`` steps
    after the warm-up; those steps are recorded in ``profiled`` and left out of the medians.
    """

    def __init__(
        self,
        gate: GateClient,
        steps: int,
        chunk: int,
        sync: Callable[[], None] = lambda: None,
        release: Callable[[], None] = lambda: None,
        profile: Callable[[], Any] | None = None,
        profile_after: int = 0,
        profile_steps: int = 0,
        on_profile_done: Callable[[Any, float], None] | None = None,
    ):
        self.gate, self.steps, self.chunk = gate, steps, chunk
        self.sync, self.release = sync, release
        self.profile, self.profile_after, self.profile_steps = profile, profile_after, profile_steps
        self.on_profile_done = on_profile_done
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.profiled: list[int] = []
        self._profiler: Any = None
        self._t0 = self._c0 = 0.0

    def begin(self) -> None:
        self._wait_turn()

    def step_end(self) -> None:
        self.sync()
        now, cpu = time.perf_counter(), time.process_time()
        self.times.append(now - self._t0)
        self.cpu_times.append(cpu - self._c0)
        step = len(self.times)
        if self._profiler is not None:
            self.profiled.append(step)
        if self.profile is not None and step == self.profile_after:
            self._profiler = self.profile()
            now, cpu = time.perf_counter(), time.process_time()
        elif self._profiler is not None and step == self.profile_after + self.profile_steps:
            self._profiler.__exit__(None, None, None)
            if self.on_profile_done is not None:
                self.on_profile_done(self._profiler, sum(self.times[-self.profile_steps :]))
            self._profiler, self.profile = None, None
            now, cpu = time.perf_counter(), time.process_time()
        if step % self.chunk == 0 and step < self.steps:
            self.gate.send({"yield": step})
            self._wait_turn()
        else:
            self._t0, self._c0 = now, cpu

    def _wait_turn(self) -> None:
        self.release()
        self.gate.wait_turn()
        self._t0, self._c0 = time.perf_counter(), time.process_time()

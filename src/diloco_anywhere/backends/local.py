"""Replicas as local processes: the embedded default, ``make demo``, and the tests.

Each replica is a process in its own session (so ``diloco stop`` can signal its whole group and
a detached launch outlives the CLI), writing stdout and stderr to ``logs/{replica}.log`` in the
run folder. It inherits this environment, so the store's credentials reach it as they reach
the CLI. Replicas share this machine's cores: each gets ``cores / replicas`` intra-op threads
(``OMP_NUM_THREADS``, unless already set), since oversubscribed cores make replicas drift apart
and the slowest falls out of every round. A replica of one process is forked from a server
that has imported the entrypoint once (``replica_forks.py``): it starts at once, where a fresh
interpreter spends seconds of CPU importing torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from diloco_anywhere.backends.base import (
    Backend,
    Capabilities,
    JobState,
    ReplicaHandle,
    ReplicaSpec,
    SecretHints,
)
from diloco_anywhere.config import RunConfig
from diloco_anywhere.replica_forks import (
    ForkServer,
    ForksUnavailableError,
    forkable,
    forking_enabled,
    start_forked,
)

# Seconds a stopped replica gets to write its last lines and leave (then SIGKILL); platforms
# give 30 s or more, a local run is stopped by a person waiting at the terminal.
STOP_GRACE = 15.0
KILL_WAIT = 30.0  # seconds for a SIGKILLed process to be gone (a loaded machine)


class LocalBackend(Backend):
    name = "local"
    capabilities = Capabilities(
        remote=False, stops_one_replica=True, time_limit="none", exit_codes=True
    )
    secret_hints = SecretHints()  # replicas have this machine's environment, as the CLI has

    def __init__(self, config: RunConfig | None = None) -> None:
        super().__init__(config)
        self._processes: dict[int, subprocess.Popen] = {}  # the ones this process started
        self._forked: dict[int, ForkServer] = {}  # the ones it had forked, by their server
        self._threads: int | None = None  # per replica, fixed by the first launch

    def check(self) -> None:
        """Nothing to check: this Python runs the replicas."""

    def describe(self, specs: list[ReplicaSpec]) -> list[dict[str, object]]:
        """Each process's command; its environment is this one plus the spec's."""
        return [{"replica": spec.replica_id, "command": spec.command(sys.executable)}
                for spec in specs]  # fmt: skip

    def attempt_limit(self) -> float | None:
        """Nothing ends a local process for its age."""
        return None

    def hardware(self) -> str:
        """This machine: no list price."""
        return ""

    def starter(
        self, specs: list[ReplicaSpec], run_dir: Path
    ) -> Callable[[ReplicaSpec], ReplicaHandle]:
        """A process per spec; a later launch (a restart) gives its replicas the thread count
        of the first, so a restarted replica computes exactly as the one it replaces."""
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._threads = self._threads or threads_per_replica(sum(s.processes for s in specs))
        threads = {"OMP_NUM_THREADS": str(self._threads)}
        return lambda spec: self._start(spec, run_dir / "logs" / f"{spec.replica_id}.log", threads)

    def _start(self, spec: ReplicaSpec, log_path: Path, threads: dict[str, str]) -> ReplicaHandle:
        command, environment = spec.command(sys.executable), {**threads, **os.environ, **spec.env}
        try:
            pid = self._fork(command, environment, log_path)
        except ForksUnavailableError:
            pid = self._spawn(command, environment, log_path)
        job = {"pid": pid, "log": str(log_path), "host": socket.gethostname()}
        return ReplicaHandle(spec.replica_id, self.name, job)

    def _fork(self, command: list[str], environment: dict[str, str], log_path: Path) -> int:
        if not (forking_enabled(environment) and forkable(command)):
            raise ForksUnavailableError("a command the fork server does not run")
        server, pid = start_forked(command[3:], environment, os.getcwd(), log_path)
        self._forked[pid] = server
        return pid

    def _spawn(self, command: list[str], environment: dict[str, str], log_path: Path) -> int:
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                command,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._processes[process.pid] = process
        return process.pid

    def _own_exit_code(self, pid: int) -> int | None:
        """The exit code of a replica this backend started, once it ended."""
        if pid in self._forked:
            return self._forked[pid].exit_code(pid)
        return self._processes[pid].poll()

    def state(self, handle: ReplicaHandle) -> JobState:
        """From its process, when it runs on this machine; ``unknown`` from any other (the
        launch record in the bucket is read everywhere, a process id means something on its
        own machine only)."""
        pid = handle.job["pid"]
        if _elsewhere(handle):
            return "unknown"
        if pid in self._processes or pid in self._forked:
            code = self._own_exit_code(pid)
            if code is not None:
                return "exited" if code == 0 else "failed"
            if pid in self._processes or self._forked[pid].answering:
                return "running"
        try:  # our child (a detached launch from this process): reap it if it has ended
            ended, _ = os.waitpid(pid, os.WNOHANG)
            return "running" if ended == 0 else "exited"
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)  # started by another CLI process: alive or not is all we can see
        except ProcessLookupError:
            return "exited"
        except PermissionError:
            return "unknown"
        return "exited" if zombie(pid) else "running"

    def exit_code(self, handle: ReplicaHandle) -> int | None:
        pid = handle.job["pid"]
        own = pid in self._processes or pid in self._forked
        return self._own_exit_code(pid) if own else None

    def logs(self, handle: ReplicaHandle) -> str:
        if _elsewhere(handle):
            raise RuntimeError(f"its log is on {_elsewhere(handle)}: {handle.job['log']}")
        try:
            return Path(handle.job["log"]).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, handle: ReplicaHandle) -> None:
        """SIGTERM the replica's process group and return once it has ended (SIGKILL after
        ``STOP_GRACE`` seconds), as a platform's stop does: a status asked right after a stop
        must not find the replica still running. A process this backend started is its own
        (its ``Popen`` holds the pid), even before it has exec'd the replica; any other pid
        is checked to still run the replica (not a recycled pid)."""
        pid = handle.job["pid"]
        if _elsewhere(handle):
            raise RuntimeError(f"it runs on {_elsewhere(handle)}: stop it there (pid {pid})")
        own = pid in self._processes or pid in self._forked
        if self.state(handle) != "running" or not (own or _is_replica(pid)):
            return
        _signal(pid, signal.SIGTERM)
        if self._running_after(handle, STOP_GRACE):
            _signal(pid, signal.SIGKILL)  # which no process outlives, but not at once:
            self._running_after(handle, KILL_WAIT)  # the kernel ends it, then it is reaped

    def _running_after(self, handle: ReplicaHandle, seconds: float) -> bool:
        """Whether the replica still runs after waiting up to ``seconds`` for it to end."""
        deadline = time.monotonic() + seconds
        while self.state(handle) == "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.state(handle) == "running"


def _elsewhere(handle: ReplicaHandle) -> str | None:
    """The other machine a local replica runs on (None for this one, or a handle that does
    not say: one written before handles named their host)."""
    host = handle.job.get("host")
    return host if host not in (None, socket.gethostname()) else None


def _signal(pid: int, signum: int) -> None:
    """``signum`` to the replica's process group, or to the process itself while it has not
    made its group yet (``start_new_session`` runs ``setsid`` in the child before exec)."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def threads_per_replica(processes: int) -> int:
    """Intra-op threads per process when ``processes`` share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // processes)


def zombie(pid: int) -> bool:
    """Whether ``pid`` has ended but not been reaped: a replica a keeper process started (from
    cron) outlives that process, and where nothing reaps orphans (a container's first process
    may not) it stays a zombie, which ``kill(pid, 0)`` still finds. /proc tells, where there is
    one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def _is_replica(pid: int) -> bool:
    """Whether ``pid`` still runs our replica entrypoint (not a recycled pid), where /proc
    tells (a forked replica has its server's command, ``diloco_anywhere.replica_forks``);
    elsewhere we trust the handle."""
    try:
        return b"diloco_anywhere.replica" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()

"""Local replicas forked from a process that has imported the replica entrypoint once.

A replica's first seconds go to importing torch, torchft and the layers of this package: some 4
s of CPU on a two-core machine, longer than a short local run trains, paid again by every
replica and every restart, all at once on shared cores when a run starts. ``python -m
diloco_anywhere.replica_forks`` (the server) imports the entrypoint once, starts no thread of
its own, and forks each replica the local backend asks for (``start_forked``, the client), as
Python's own ``forkserver`` start method does for multiprocessing (its docs, "Contexts and
start methods").

A forked replica is made to look like one started as ``python -m diloco_anywhere.replica``
where the backend started it: a session of its own, stdin from /dev/null, stdout and stderr
appended to its log, the backend's working directory first on ``sys.path``, the environment
it was given, the module run as ``__main__`` with its arguments (``runpy``, as ``python -m``
runs it), and random generators seeded afresh (a forked child would otherwise draw what its
siblings draw). What is read from the environment while
the entrypoint is imported (``PYTHONPATH``, the thread counts, ``TORCH_*``, ``CUDA_*``, ...)
is the server's: the backend keeps one server per set of those values (``IMPORT_ENVIRONMENT``).
The replica leaves as any interpreter does (threads joined, ``atexit`` run, its exit code
kept); no CUDA context exists before the fork.

The protocol, a JSON object a line: requests ``{"id", "module", "argv", "env", "cwd",
"log"}`` (``module`` runs as ``python -m module argv...`` would run it) on the
server's stdin; on its stdout ``{"id", "pid"}`` (or ``{"id", "error"}``) per request, and
``{"exit": pid, "code": code}`` once it has reaped that child (a signal's code is minus its
number, as ``subprocess.Popen.returncode``). The server ends when its stdin closes (the process
that started it ended); replicas still running go on, as those of a detached launch do.

The client keeps one server per launching process and per set of the variables the imports
read, started on the first replica that needs it and kept for the process's life (a
foreground launch, a keeper pass, a test session's worker, whose later launches fork at once),
at most ``MAX_SERVERS`` of them. A thread reads what each server says. Where no server can
serve (it failed to start, or died), ``start_forked`` raises ``ForksUnavailableError`` and the
backend starts the replica as a process of its own. ``DILOCO_FORK_REPLICAS=0`` turns forking
off (docs/backends.md, "Local"). The client imports nothing heavy: the launcher's side loads
no torch.
"""

from __future__ import annotations

import gc
import importlib
import itertools
import json
import os
import random
import runpy
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

# Environment variables read while the entrypoint is imported (by Python, torch, OpenMP, BLAS,
# fsspec, CUDA): a server serves only requests whose values of these are its own.
IMPORT_ENVIRONMENT = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_",
                      "NCCL_", "FSSPEC_")  # fmt: skip
REAP_EVERY = 0.05  # seconds between looks for ended children
# What a replica imports before its first step, imported once in the server rather than in each
# child: the entrypoint (torch, torchft, every layer below it) and torch._dynamo, which torch
# imports lazily on a process's first optimizer (``torch._compile._disable_dynamo``), 0.75 s of
# CPU a replica on a two-core machine, and the profiler's module its first step imports. None
# starts a thread (tests/backends/test_replica_forks.py: a child's first step imports nothing).
PRELOAD = ("diloco_anywhere.replica", "torch._dynamo", "torch.profiler._cupti_monitor")


def import_environment(environment: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``environment`` the entrypoint's imports read: what a server is keyed by."""
    return tuple(sorted((name, value) for name, value in environment.items()
                        if name.startswith(IMPORT_ENVIRONMENT)))  # fmt: skip


def _say(message: dict[str, Any]) -> None:
    os.write(sys.stdout.fileno(), json.dumps(message).encode() + b"\n")


def _reap(children: set[int]) -> None:
    for pid in list(children):
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            children.discard(pid)
            _say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(request: dict[str, Any]) -> int:
    """Fork a child for ``request`` (0 in the child), answered once the child leads a session of
    its own (as ``Popen(start_new_session=True)`` returns), so that its pid names its process
    group at once. Its log is opened first: one that cannot be written is said to the
    backend, not lost."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    led, leads = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(led)
        os.setsid()
        os.close(leads)
        _become(request, log)
        return 0
    os.close(leads)
    os.read(led, 1)  # the child closed its end: it has its session (or it died)
    os.close(led)
    os.close(log)
    return pid


def _become(request: dict[str, Any], log: int) -> None:
    """In the child: what ``subprocess.Popen`` would have given the replica."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # as `python -m` puts the working directory first
    random.seed()
    import numpy
    import torch

    torch.seed()
    numpy.random.seed()


def serve() -> dict[str, Any]:
    """Fork a replica for every request until stdin closes (then exit); in each child, return
    its request."""
    for module in PRELOAD:  # what every child would import: once, here
        importlib.import_module(module)
    # What the imports made is never collected (it lives as long as the modules): frozen, the
    # children's garbage collector skips it rather than touching every object's header, which
    # copied the server's pages into each child (the gc module's docs, gc.freeze: "avoiding
    # unnecessary copy-on-write in child processes").
    gc.freeze()

    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], REAP_EVERY)
        _reap(children)
        if not readable:
            continue
        chunk = os.read(sys.stdin.fileno(), 1 << 16)
        if not chunk:
            sys.exit(0)
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = json.loads(line)
            try:
                pid = _fork(request)
            except OSError as exc:
                _say({"id": request["id"], "error": str(exc)})
                continue
            if pid == 0:
                return request
            children.add(pid)
            _say({"id": request["id"], "pid": pid})


# -- the client: the local backend's side ------------------------------------------------------

ENV_FORK_REPLICAS = "DILOCO_FORK_REPLICAS"
ANSWER_SECONDS = 300.0  # the server imports torch before its first answer: slow machines


class ForksUnavailableError(RuntimeError):
    """No server can fork this replica: start it as a process of its own."""


class ForkServerGoneError(ForksUnavailableError):
    """The server ended (or never answered): none is started again for its environment."""


def forking_enabled(environment: dict[str, str]) -> bool:
    return environment.get(ENV_FORK_REPLICAS, "1") != "0"


ENTRYPOINT = "diloco_anywhere.replica"


def forkable(command: list[str]) -> bool:
    """Only the entrypoint itself in this interpreter (not torchrun and its ranks)."""
    return command[:3] == [sys.executable, "-m", ENTRYPOINT]


class ForkServer:
    """One server process and what it said: its children's pids and exit codes."""

    def __init__(self, environment: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "diloco_anywhere.replica_forks"],
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C at the terminal is the launcher's, not its
        )
        self._ids = itertools.count()
        self._answers: dict[int, dict] = {}
        self._codes: dict[int, int] = {}
        self._said = threading.Condition()
        self._writing = threading.Lock()
        self._gone = False
        assert self.process.stdout is not None
        threading.Thread(target=self._listen, args=(self.process.stdout,), daemon=True).start()

    def _listen(self, stdout: IO[bytes]) -> None:
        for line in stdout:
            message = json.loads(line)
            with self._said:
                if "exit" in message:
                    self._codes[message["exit"]] = message["code"]
                else:  # a new child: a code kept for an earlier one of its pid is not its
                    self._codes.pop(message.get("pid"), None)
                    self._answers[message["id"]] = message
                self._said.notify_all()
        with self._said:
            self._gone = True
            self._said.notify_all()

    def start(
        self, argv: list[str], environment: dict[str, str], cwd: str, log: Path,
        module: str = ENTRYPOINT,
    ) -> int:  # fmt: skip
        """Fork a process that runs ``python -m module argv...`` (the entrypoint); its pid."""
        request_id = next(self._ids)
        request = {"id": request_id, "module": module, "argv": argv, "env": environment,
                   "cwd": cwd, "log": str(log)}  # fmt: skip
        try:
            assert self.process.stdin is not None
            with self._writing:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                self.process.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise ForkServerGoneError(f"the fork server ended: {exc}") from None
        with self._said:
            self._said.wait_for(lambda: request_id in self._answers or self._gone, ANSWER_SECONDS)
            answer = self._answers.pop(request_id, None)
        if answer is None:
            raise ForkServerGoneError("the fork server ended, or did not answer, before forking")
        if "pid" not in answer:
            raise ForksUnavailableError(f"the fork server could not fork: {answer['error']}")
        return answer["pid"]

    @property
    def answering(self) -> bool:
        """Whether the server still says when its children end."""
        with self._said:
            return not self._gone

    def close(self) -> None:
        """End the server (as the end of this process would): its replicas go on, and their
        exit codes are known to this process only as their pids' ends."""
        if self.process.stdin is not None:
            with self._writing:
                self.process.stdin.close()

    def exit_code(self, pid: int) -> int | None:
        """``pid``'s exit code once the server reaped it (None while it runs)."""
        with self._said:
            return self._codes.get(pid)


MAX_SERVERS = 4  # kept per process; the least recently used ends first (its replicas go on)
_servers: dict[tuple, ForkServer] = {}  # by import environment, least recently used first
_failed: set[tuple] = set()  # environments whose server ended before forking: not tried again
_servers_lock = threading.Lock()


def start_forked(
    argv: list[str], environment: dict[str, str], cwd: str, log: Path
) -> tuple[ForkServer, int]:
    """Fork a replica from the server whose imports read what ``environment`` holds (started
    if there is none): that server and the replica's pid, or ``ForksUnavailableError``."""
    key = import_environment(environment)
    with _servers_lock:
        if key in _failed:
            raise ForksUnavailableError("the fork server for this environment failed before")
        server = _servers.pop(key, None)
        if server is None or server.process.poll() is not None:
            server = ForkServer({**os.environ, **dict(key)})
        _servers[key] = server
        while len(_servers) > MAX_SERVERS:
            _servers.pop(next(iter(_servers))).close()
    try:
        return server, server.start(argv, environment, cwd, log)
    except ForkServerGoneError:
        with _servers_lock:
            _failed.add(key)
        raise


def main() -> None:
    request = serve()
    sys.argv = [request["module"], *request["argv"]]  # runpy puts the module's file first
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

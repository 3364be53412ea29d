"""Local replicas forked from a server that imported the entrypoint once
(``replica_forks.py``): each child looks like ``python -m module`` started by the backend (its
session, log, working directory, environment, arguments, fresh random draws), its exit code
comes back (a signal's as minus its number), the server ends with the process that started it
and leaves its children running, and the local backend falls back to a process of its own
where forking is off or cannot serve."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from diloco_anywhere.backends.local import LocalBackend
from diloco_anywhere.replica_forks import (
    ENV_FORK_REPLICAS,
    ForkServer,
    ForksUnavailableError,
    forkable,
    import_environment,
)
from support.runs import wait_gone

pytestmark = pytest.mark.integration  # every test here starts processes
TESTS = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def server():
    """A server that can import the probe (``tests/`` on its PYTHONPATH)."""
    started = ForkServer({**os.environ, "PYTHONPATH": TESTS})
    yield started
    started.process.stdin.close()
    started.process.wait(30)


def _probe(server, folder: Path, name: str, ending: str, **env: str) -> tuple[int, Path]:
    report = folder / f"{name}.json"
    environment = {**os.environ, "PYTHONPATH": TESTS, **env}
    pid = server.start([str(report), ending], environment, str(folder), folder / f"{name}.log",
                       module="support.fork_probe")  # fmt: skip
    return pid, report


def _exit_code(server, pid: int) -> int:
    deadline = time.monotonic() + 60
    while (code := server.exit_code(pid)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return code


def test_a_forked_child_looks_started_by_the_backend_and_its_exit_code_comes_back(server, tmp_path):
    first, first_report = _probe(server, tmp_path, "a", "3", PROBE="one")
    second, second_report = _probe(server, tmp_path, "b", "kill", PROBE="two")
    assert _exit_code(server, first) == 3
    assert _exit_code(server, second) == -signal.SIGKILL
    seen = [json.loads(report.read_text()) for report in (first_report, second_report)]
    assert [s["probe"] for s in seen] == ["one", "two"]
    for report, pid in ((seen[0], first), (seen[1], second)):
        assert report["argv"][1:] == [str(tmp_path / ("a.json" if pid == first else "b.json")),
                                      "3" if pid == first else "kill"]  # fmt: skip
        assert report["argv"][0].endswith("fork_probe.py")  # as `python -m` sets it
        assert report["main"] == "__main__"
        assert report["cwd"] == report["path0"] == str(tmp_path)
        assert report["session_leader"]
        assert report["stdin"] == ""  # /dev/null
    assert seen[0]["random"] != seen[1]["random"]  # seeded afresh, not the server's state
    assert seen[0]["torch"] != seen[1]["torch"]
    assert (tmp_path / "a.log").read_text() == "probe 3\n"
    assert seen[0]["first_step"] == [], "imported in every replica: add it to PRELOAD"


def test_the_server_ends_with_its_starter_and_leaves_its_children_running(tmp_path):
    server = ForkServer({**os.environ, "PYTHONPATH": TESTS})
    pid, _ = _probe(server, tmp_path, "sleeper", "sleep")
    assert os.getsid(pid) == pid  # its session exists once its pid is known
    server.process.stdin.close()  # what the launching process's exit does
    assert server.process.wait(30) == 0
    os.kill(pid, 0)  # still running
    os.killpg(pid, signal.SIGKILL)
    wait_gone(pid)
    with pytest.raises(ForksUnavailableError, match="ended"):
        _probe(server, tmp_path, "late", "0")


def test_a_log_that_cannot_be_written_is_said_and_the_server_serves_on(server, tmp_path):
    with pytest.raises(ForksUnavailableError, match=r"could not fork: .*No such file"):
        server.start(["x"], dict(os.environ), str(tmp_path), tmp_path / "missing" / "x.log")
    pid, _ = _probe(server, tmp_path, "after", "0")
    assert _exit_code(server, pid) == 0


def test_servers_are_kept_apart_by_what_imports_read():
    base = {"PATH": "/bin", "HOME": "/root", "DILOCO_REPLICA_ID": "local-0"}
    assert import_environment(base) == ()
    assert import_environment({**base, "PYTHONPATH": "src", "OMP_NUM_THREADS": "1"}) == (
        ("OMP_NUM_THREADS", "1"), ("PYTHONPATH", "src")
    )  # fmt: skip
    assert forkable([sys.executable, "-m", "diloco_anywhere.replica", "--config", "r.toml"])
    assert not forkable([sys.executable, "-m", "torch.distributed.run", "--standalone"])
    assert not forkable(["python3", "-m", "diloco_anywhere.replica"])  # another interpreter


def test_with_forking_off_the_local_backend_starts_a_process_of_its_own(
    tmp_path, monkeypatch, run_toml
):
    from diloco_anywhere.config import load_config
    from diloco_anywhere.launching.start.launch import plan_launch

    monkeypatch.setenv(ENV_FORK_REPLICAS, "0")
    config = load_config(run_toml(replicas=2, outer_steps=500))
    plan = plan_launch(config, {"local": 2}, root=tmp_path)
    backend = plan.backends["local"]
    assert isinstance(backend, LocalBackend)
    (handle,) = backend.launch(plan.specs[:1], plan.run_dir)
    pid = handle.job["pid"]
    assert pid not in backend._forked
    assert backend._processes[pid].args[:3] == [sys.executable, "-m", "diloco_anywhere.replica"]
    backend.stop(handle)
    assert backend.state(handle) != "running"


def test_a_replica_of_a_server_that_ended_is_seen_by_its_process(tmp_path, run_toml):
    """The least recently used server ends when a process holds too many: the replicas it
    forked go on, and their backend sees them end through their pids."""
    from diloco_anywhere.config import load_config
    from diloco_anywhere.launching.start.launch import plan_launch

    config = load_config(run_toml(replicas=2, outer_steps=500))
    plan = plan_launch(config, {"local": 2}, root=tmp_path)
    backend = plan.backends["local"]
    (handle,) = backend.launch(plan.specs[:1], plan.run_dir)
    server = backend._forked[handle.job["pid"]]
    server.close()
    server.process.wait(30)
    deadline = time.monotonic() + 30
    while server.answering:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert backend.state(handle) == "running"  # alive, though its server has ended
    backend.stop(handle)
    assert backend.state(handle) == "exited"

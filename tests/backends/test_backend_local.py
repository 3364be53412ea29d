"""The local launcher as ``diloco keep`` uses it: a replica launched again is a new process
that trains as that replica, on its shard; nothing limits an attempt's time here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco_anywhere.backends import local
from diloco_anywhere.backends.local import LocalBackend, zombie
from diloco_anywhere.config import load_config
from diloco_anywhere.launching.start.launch import plan_launch, run_metrics
from support.runs import RUN_TOML, wait_for_starts


def test_nothing_ends_a_local_attempt_and_it_has_no_list_price():
    backend = LocalBackend()
    assert (backend.attempt_limit(), backend.hardware()) == (None, "")


@pytest.mark.integration
def test_a_replica_started_again_is_a_new_process_with_its_id_and_shard(tmp_path, monkeypatch):
    """The one spec of replica local-1 of a 3-replica run, launched, stopped and launched
    again: each time one process, training as local-1 on shard 1 (alone: min_replicas = 1,
    so that it need not wait out the sync timeout for the others, which never start). A stop
    returns once the replica has ended: the first on its SIGTERM, the second SIGKILLed at
    once (no grace), which ends a process soon but not at once (a loaded machine showed it
    running right after)."""
    text = RUN_TOML.format(replicas=3, outer_steps=500)
    (tmp_path / "run.toml").write_text(text.replace("min_replicas = 2", "min_replicas = 1"))
    config = load_config(tmp_path / "run.toml")
    plan = plan_launch(config, {"local": 3}, root=tmp_path)
    backend, spec = plan.backends["local"], plan.specs[1]
    handles = []
    for incarnation in (1, 2):
        (handle,) = backend.launch([spec], plan.run_dir)
        handles.append(handle)
        starts = wait_for_starts(config, "local-1", incarnation)
        assert [start.split(",")[0] for start in starts] == ["shard 1 of 3"] * incarnation
        if incarnation == 2:
            monkeypatch.setattr(local, "STOP_GRACE", 0.0)
        backend.stop(handle)
        assert backend.state(handle) != "running"

    assert [handle.replica_id for handle in handles] == ["local-1", "local-1"]
    assert handles[0].job["pid"] != handles[1].job["pid"]
    assert set(run_metrics(config).read()) == {"local-1"}  # no other replica was started


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_an_ended_process_nobody_reaped_reads_as_ended_not_running():
    """A replica a keeper process started outlives it; where nothing reaps orphans it stays a
    zombie, which ``kill(pid, 0)`` still finds: /proc says it ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while not zombie(child.pid):  # ended, and not reaped: this test is its parent
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not zombie(os.getpid())
    child.wait()
    assert not zombie(child.pid)  # reaped: gone

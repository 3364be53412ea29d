"""A replica of several processes (torchrun, DDP inside the replica; gloo on CPU here).

Only rank 0 of each replica talks to the bucket; the other ranks get every round's result and
the healed state from it. The run must train and finish with every rank of a replica holding
the same global state (the replica checks that before it reports done), and every replica the
same as the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diloco_anywhere.bench.chaos import fingerprint_disagreements
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import load_config
from diloco_anywhere.launching.start.launch import run_metrics
from support.runs import RUN_TOML, diloco, replica_logs, statuses

TWO_PROCESSES = "\n[backends.local]\nprocesses_per_replica = 2\n"


@pytest.mark.integration
def test_replicas_of_two_processes_train_and_only_rank_0_uses_the_bucket(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(RUN_TOML.format(replicas=2, outer_steps=3) + TWO_PROCESSES)
    dry = diloco("launch", "--config", "run.toml", "--dry-run")
    assert [spec["processes"] for spec in json.loads(dry.stdout)["replicas"]] == [2, 2]

    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output + replica_logs(tmp_path, "t")
    assert {row["state"] for row in statuses("run.toml").values()} == {"done"}
    metrics = run_metrics(load_config("run.toml")).read()
    assert fingerprint_disagreements(metrics) == {}
    for replica in metrics.values():
        assert "2 process(es)" in replica.events[0].detail
        assert [sync.committed for sync in replica.syncs] == [True] * 3
        # a step's tokens count both ranks' batches: 2 ranks x 4 sequences x 64 bytes
        assert replica.steps[1].tokens - replica.steps[0].tokens == 2 * 4 * 64
    # one incarnation claimed per replica: the second ranks never joined the bucket's members
    claims = [k for k in Store(str(tmp_path / "store")).list_prefix(RunLayout("t").members())
              if k.endswith("/claim")]  # fmt: skip
    assert sorted(claims) == ["t/members/local-0/0/claim", "t/members/local-1/0/claim"]


def test_a_bad_process_count_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = (
        RUN_TOML.format(replicas=2, outer_steps=3)
        + "\n[backends.local]\nprocesses_per_replica = 0\n"
    )
    (tmp_path / "run.toml").write_text(bad)
    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 1
    expected = (
        "backends.local.processes_per_replica = 0: Input should be greater than or equal to 1"
    )
    assert expected in result.output
    assert not (tmp_path / "store").exists()


LEAVING = """
import atexit, sys
from diloco_anywhere.training.ranks.replica_group import leave_rank
atexit.register(lambda: print("finalized", flush=True))
print("trained", flush=True)
print("buffered, not flushed", end="")
leave_rank(7)
"""


@pytest.mark.integration
@pytest.mark.parametrize(("world_size", "finalized"), [("2", False), ("1", True)])
def test_a_rank_of_several_leaves_without_the_interpreters_finalization(world_size, finalized):
    """``leave_rank``: a rank under torchrun exits with its code and its output flushed but no
    finalization (a gloo worker thread outliving ``destroy_process_group`` then aborted the
    process, and torchrun failed a replica that had trained to the end); a replica of one
    process exits as Python does."""
    ended = subprocess.run([sys.executable, "-c", LEAVING], capture_output=True, text=True,
                           env={**os.environ, "WORLD_SIZE": world_size}, timeout=120)  # fmt: skip
    assert ended.returncode == 7, ended.stderr
    assert ended.stdout.startswith("trained\nbuffered, not flushed")
    assert ("finalized" in ended.stdout) is finalized

"""A foreground launch ends: when every replica has ended, or when the run cannot go on (too
few replicas left to seal a round), with a line per replica that did not finish; interrupted
(Ctrl-C, SIGTERM), it stops the replicas on this machine (launching/keep/supervisor.py,
cli/launch.py)."""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from diloco_anywhere.backends.base import ReplicaHandle
from diloco_anywhere.backends.local import LocalBackend
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.members.membership import departed
from diloco_anywhere.contract import EXIT_BAD_CONFIG
from diloco_anywhere.launching.keep.supervisor import logged_error, outcome
from diloco_anywhere.launching.start.launches import EndRecord, Launches, RestartRecord
from diloco_anywhere.launching.watch.status import ReplicaStatus
from diloco_anywhere.training.records.metrics import MetricsReader, MetricsWriter
from support.runs import diloco, statuses
from support.scripts import (
    BEFORE_JOIN,
    FAILS_BEFORE_JOIN_ON_INDEX_1,
    MISTAKEN,
    MISTAKES,
    SEEDED_ALIKE,
    SEEDED_PER_REPLICA,
)


def _row(replica: str, state: str, platform: str = "local") -> ReplicaStatus:
    return ReplicaStatus(
        replica=replica, platform=platform, state=state, outer_step=1, loss=None,
        eval_loss=None, tokens=0, tokens_per_second=None, bytes_up=0, bytes_down=0,
        last_seen_seconds=None, restarts=0, heals=0, divergences=0, mirror_failures=0,
        superseded=0, clock_skew=None, values={},
    )  # fmt: skip


def _said(**endings: tuple[str, str]) -> dict:
    """Replicas' metrics with their last lifecycle event: {replica: (event, detail)}."""
    store, layout = Store(f"memory://follow-{'-'.join(endings)}"), RunLayout("run")
    for replica, (event, detail) in endings.items():
        MetricsWriter(store, layout, replica, 0, "local").event(event, detail)
    return MetricsReader(store, layout).read()


REFUSED = ("failed", "ModelUnlikeRunError: this replica's model is unlike the run's")


def test_too_few_replicas_left_to_seal_a_round_end_the_launch_naming_each_and_why():
    rows = [_row("local-0", "running"), _row("local-1", "failed"), _row("local-2", "failed")]
    jobs = {"local-0": "running", "local-1": "failed", "local-2": "failed"}
    metrics = _said(**{"local-1": REFUSED, "local-2": ("failed", "SyncFailedError: 5 syncs")})
    ended = outcome(rows, jobs, metrics, {"local-1": 5, "local-2": 1}, 2)
    assert ended.over
    assert ended.hopeless == (
        "the run cannot go on: 2 of its replicas ended for good, and the 1 left (local-0) are "
        "fewer than min_replicas = 2"
    )
    # with a keeper that restarts them, only the one refused for its mistake is gone for good
    assert not outcome(rows, jobs, metrics, {"local-1": 5, "local-2": 1}, 2, lambda _: True).over
    gone = outcome(rows, jobs, metrics, {"local-1": 5, "local-2": 5}, 2, lambda _: True)
    assert gone.hopeless is not None
    assert [e.line() for e in ended.unfinished] == [
        "local-1: failed (exit 5): ModelUnlikeRunError: this replica's model is unlike the run's",
        "local-2: failed (exit 1): SyncFailedError: 5 syncs",
    ]


@pytest.mark.parametrize(
    ("states", "min_replicas", "restarts"),
    [
        (("running", "running", "failed"), 2, False),  # two left can still seal rounds
        (("running", "starting", "failed"), 2, False),
        (("running", "done", "failed"), 3, False),  # the run is trained: the rest finish
        (("running", "failed", "failed"), 2, True),  # the keeper restarts them
        (("running", "running", "running"), 3, False),
    ],
)
def test_a_launch_that_can_still_finish_is_followed_on(states, min_replicas, restarts):
    rows = [_row(f"local-{k}", state) for k, state in enumerate(states)]
    jobs = {row.replica: "exited" if row.state in ("done", "failed") else "running"
            for row in rows}  # fmt: skip
    ended = outcome(rows, jobs, {}, {}, min_replicas, lambda _: restarts)
    assert not ended.over
    assert ended.hopeless is None


def test_a_remote_replica_whose_platform_cannot_say_has_ended_when_it_said_so():
    """A job in state "unknown" kept the launch waiting for ever; the replica's own end wins."""
    rows = [_row("modal-0", "done", "modal"), _row("modal-1", "failed", "modal")]
    jobs = {"modal-0": "unknown", "modal-1": "unknown"}
    metrics = _said(**{"modal-1": REFUSED})
    ended = outcome(rows, jobs, metrics, {}, 1)
    assert ended.over
    assert [e.line() for e in ended.unfinished] == [f"modal-1: failed: {REFUSED[1]}"]
    still = outcome([dataclasses.replace(rows[0], state="running")], {"modal-0": "unknown"},
                    {}, {}, 1)  # fmt: skip
    assert not still.over


def _write_run(tmp_path, script: str, replicas: int = 2, min_replicas: int = 2) -> None:
    (tmp_path / "train.py").write_text(script)
    (tmp_path / "run.toml").write_text(
        f'[run]\nname = "follow"\nstore = "store"\nreplicas = {replicas}\n'
        f"min_replicas = {min_replicas}\n[diloco]\nsync_every = 5\nouter_steps = 200\n"
        f"[task]\ncommand = {json.dumps([sys.executable, 'train.py'])}\n"
    )


def _launch(tmp_path, *options: str) -> subprocess.Popen:
    """`diloco launch` in the foreground, as a user runs it."""
    command = [sys.executable, "-c", "from diloco_anywhere.cli import app; app()", "launch",
               "--config", "run.toml", *options]  # fmt: skip
    return subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _launched_to_the_end(tmp_path, monkeypatch, script: str) -> tuple[int, str]:
    """A foreground launch of ``script``'s replicas in ``tmp_path``, waited for: its exit code
    and what it wrote to stderr."""
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, script)
    launch = _launch(tmp_path)
    try:
        _out, err = launch.communicate(timeout=240)
    finally:
        launch.kill()
    return launch.returncode, err


@pytest.mark.integration
def test_a_foreground_launch_that_cannot_go_on_returns_with_the_replica_that_failed(
    tmp_path, monkeypatch
):
    """The issue's launch that never returned: of two replicas (min_replicas = 2) one stops
    for its mistake, and the other cannot seal a round alone. The launch returns 1, says
    which replica failed and why, and stops the one left."""
    returncode, err = _launched_to_the_end(tmp_path, monkeypatch, SEEDED_PER_REPLICA)
    assert returncode == 1, err
    said = " ".join(err.split())
    assert "the run cannot go on: 1 of its replicas ended for good, and the 1 left " \
           "(local-0) are fewer than min_replicas = 2" in said  # fmt: skip
    assert "local-1: failed (exit 5): ModelUnlikeRunError: this replica's model is unlike" in said
    rows = statuses("run.toml")
    assert rows["local-1"]["state"] == "failed"
    # the one left is stopped by the launch, unless it found first that it cannot go on
    if rows["local-0"]["state"] == "failed":
        assert rows["local-0"]["last_word"].startswith("RunCannotGoOnError"), rows
    else:
        assert rows["local-0"]["state"] == "stopped", rows


@pytest.mark.integration
def test_a_replica_that_never_joined_is_said_gone_for_the_replicas_of_other_platforms(
    tmp_path, monkeypatch
):
    """Replica 1 fails before it joins (an image without the project does the same): nothing
    of it is in the bucket. The launch that finds the run cannot go on says in the bucket that
    it left for good, so that replicas on other platforms, which it does not stop, fail their
    rounds at once instead of after five sync timeouts (``collective/members/departures.py``)."""
    returncode, err = _launched_to_the_end(tmp_path, monkeypatch, FAILS_BEFORE_JOIN_ON_INDEX_1)
    assert returncode == 1, err
    assert "local-1: failed (exit 1)" in " ".join(err.split())
    gone = departed(Store(str(tmp_path / "store")), RunLayout("follow"))["local-1"]
    assert (gone.incarnation, gone.final) == (None, True)  # it never joined
    assert gone.reason.startswith("ended for good (failed (exit 1): ")
    assert gone.reason.endswith("and nothing restarts it")


@pytest.mark.integration
def test_a_foreground_launch_sent_sigterm_stops_the_replicas_it_started(tmp_path, monkeypatch):
    """A CI runner cancelling a job sends SIGTERM: the launch stops its local replicas (they
    run in sessions of their own, so nothing else would) and exits 130."""
    monkeypatch.chdir(tmp_path)
    _write_run(tmp_path, SEEDED_ALIKE)
    launch = _launch(tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "store").exists() or not any(
            row["state"] == "running" for row in statuses("run.toml").values()
        ):
            assert time.monotonic() < deadline
            assert launch.poll() is None
            time.sleep(0.5)
        launch.send_signal(signal.SIGTERM)
        _out, err = launch.communicate(timeout=120)
    finally:
        launch.kill()
    assert launch.returncode == 130, err
    assert "interrupted: stopping the replicas on this machine" in err
    assert {row["state"] for row in statuses("run.toml").values()} == {"stopped"}


def test_after_the_launch_ended_nothing_comes_back_and_following_is_over():
    """The issue's launch that never returned: a replica refused for its mistake (exit 1 then,
    so the keeper's restart counted), the others done, and the keeper's END written. Nothing is
    restarted after END, so the launch is over, whatever ``may_restart`` says."""
    rows = [_row("local-0", "done"), _row("local-1", "failed")]
    jobs = {"local-0": "exited", "local-1": "exited"}
    codes = {"local-0": 0, "local-1": 1}
    assert not outcome(rows, jobs, {}, codes, 1, lambda _: True).over  # it would come back
    ended = outcome(rows, jobs, {}, codes, 1, lambda _: True, launch_ended=True)
    assert ended.over
    assert [e.replica for e in ended.unfinished] == ["local-1"]
    mistaken = outcome(rows, jobs, {}, {**codes, "local-1": EXIT_BAD_CONFIG}, 1, lambda _: True)
    assert mistaken.over  # a mistake's exit code is never restarted


def _mistakes_run(tmp_path) -> None:
    (tmp_path / "train.py").write_text(MISTAKEN)
    (tmp_path / "run.toml").write_text(
        '[run]\nname = "mistakes"\nstore = "store"\nreplicas = 8\nmin_replicas = 1\n'
        "[diloco]\nsync_every = 5\nouter_steps = 3\n[sync]\ngrace = 1.0\n"
        "[keep]\nbackoff = 0.5\n"
        f"[task]\ncommand = {json.dumps([sys.executable, 'train.py'])}\n"
    )


@pytest.mark.integration
def test_mistakes_raised_outside_the_with_end_their_replicas_as_themselves_and_the_launch_returns(
    tmp_path, monkeypatch
):
    """Replica 0 trains the run; replicas 1-6 each raise one of the project's mistakes after
    join but outside `with replica:` (as a Trainer built first raises its shared output_dir),
    replica 7 a run.toml mistake before it joins. Each ends with its mistake's exit code and
    its message in the launch's output; those that joined with a `failed` event, shown by
    `diloco status`, and a final departure where no restart helps; none is restarted; and the
    launch with --restart-on-failure returns within seconds of the keeper's END."""
    monkeypatch.chdir(tmp_path)
    _mistakes_run(tmp_path)
    launch = _launch(tmp_path, "--restart-on-failure")
    try:
        _out, err = launch.communicate(timeout=240)
    finally:
        launch.kill()
    returned = time.time()
    said = " ".join(err.split())
    assert launch.returncode == 1, err  # the replicas that did not finish, each on a line
    store, layout = Store(str(tmp_path / "store")), RunLayout("mistakes")
    launches = Launches(store, layout)
    end = launches.read(launches.numbers()[-1]).end
    assert end is not None, err
    assert end.reason == "done", end
    assert returned - end.at < 10
    events = MetricsReader(store, layout).read()
    gone = departed(store, layout)
    for index, (name, _module) in MISTAKES.items():
        replica, exited = f"local-{index}", 6 if name == "RunCannotGoOnError" else None
        code = exited or {"NotSyncingError": 4, "TrainingOutsideDilocoError": 4,
                          "ModelUnlikeRunError": 5}.get(name, EXIT_BAD_CONFIG)  # fmt: skip
        assert f"{replica}: failed (exit {code}): {name}: {name} outside the with" in said
        assert [e.event for e in events[replica].events] == ["failed"]
        assert gone[replica].final == (name != "RunCannotGoOnError")  # the others' doing
    assert (f"local-{BEFORE_JOIN}: failed (exit {EXIT_BAD_CONFIG}): replica 7's settings: "
            "raised before join") in said  # fmt: skip
    rows = statuses("run.toml")
    assert rows["local-0"]["state"] == "done"
    assert all(row["restarts"] == 0 for row in rows.values())  # no mistake restarted
    status = diloco("status", "--config", "run.toml").stdout
    assert "local-2 failed: SharedOutputDirError: SharedOutputDirError outside the with" in status


def test_a_replica_s_last_error_is_read_from_its_log_where_the_platform_can_show_it(tmp_path):
    """The launch's line for a replica that left no word in the bucket: its last `error:`
    line; none where its log is out of reach (another machine's local process)."""
    log = tmp_path / "local-7.log"
    log.write_text("error: an early one\nTraceback ...\nerror: replica 7's settings\n"
                   "[task] command ['python', 'train.py'] exited 2: not retried\n")  # fmt: skip
    here = ReplicaHandle("local-7", "local", {"log": str(log), "host": socket.gethostname()})
    assert logged_error(LocalBackend(), here) == "replica 7's settings"
    elsewhere = ReplicaHandle("local-7", "local", {"log": str(log), "host": "another-host"})
    assert logged_error(LocalBackend(), elsewhere) is None


def test_of_two_keepers_claiming_one_restart_or_ending_one_launch_one_acts(tmp_path):
    """Create-only records, each keeper's bytes its own (a nonce): the second claim and the
    second END are refused; a claim given back (its job could not start) can be made again."""
    launches = Launches(Store(str(tmp_path)), RunLayout("run"))

    def restart(keeper: str) -> RestartRecord:
        return RestartRecord(replica_id="local-0", attempt=1, reason="failed", detail="exit 1",
                             counted=1, streak=1, host=keeper, at=1.0, nonce=keeper)  # fmt: skip

    def end(keeper: str) -> EndRecord:
        return EndRecord(reason="done", detail="the last outer step is committed", host=keeper,
                         at=1.0, nonce=keeper)  # fmt: skip

    assert launches.claim_restart(0, restart("a"))
    assert not launches.claim_restart(0, restart("b"))
    launches.release_restart(0, restart("a"))
    assert launches.claim_restart(0, restart("b"))
    assert launches.end(0, end("a"))
    assert not launches.end(0, end("b"))

"""``diloco launch | status | logs | stop | report`` on local replica processes, end to end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from diloco_anywhere.backends.base import ReplicaHandle, ReplicaSpec
from diloco_anywhere.bucket.format.layout import RunLayout, parse_contributor
from diloco_anywhere.bucket.format.record import decode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.policy import CollectiveConfig, LeasePolicy
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.config import load_config
from diloco_anywhere.launching.cost.model_size import parameter_count
from diloco_anywhere.launching.keep.supervisor import Supervisor
from diloco_anywhere.launching.start.launch import (
    in_last_launch_order,
    load_handles,
    mark_stopped,
    plan_launch,
    run_launches,
    run_metrics,
    start,
)
from diloco_anywhere.launching.start.launches import Launches, LaunchTakenError
from diloco_anywhere.training.checkpoints.commits import committed_rounds
from diloco_anywhere.training.checkpoints.objects import Spools
from diloco_anywhere.training.checkpoints.reader import materialized
from diloco_anywhere.training.checkpoints.replica_states import read_replica_state, saved_rounds
from support.runs import as_streaming, diloco, evaluated_losses, kill_all, statuses


@pytest.mark.integration
def test_a_two_replica_run_finishes_and_reports(run_toml, tmp_path):
    config = run_toml()
    result = diloco("launch", "--config", config)
    assert result.exit_code == 0, result.output
    assert "Run summary" in result.stdout
    assert "loss plot:" in result.stdout
    assert result.output.count("run t: 2 replicas, 2 outer steps") == 1  # the live one went
    rows = statuses(config)
    assert {row["state"] for row in rows.values()} == {"done"}
    assert {row["outer_step"] for row in rows.values()} == {2}
    assert {row["own_data"] for row in rows.values()} == {None}  # the built-in task's is the run's
    # the held-out loss is taken at the global weights: every replica gets the same number
    assert len({row["eval_loss"] for row in rows.values()}) == 1
    # ... every eval_every (2) outer steps only: not after the first
    for metrics in run_metrics(load_config(config)).read().values():
        assert [sync.eval_loss is None for sync in metrics.syncs] == [True, False]

    report = diloco("report", "--config", config, "--json")
    assert report.exit_code == 0, report.output
    summary = json.loads(report.stdout)
    assert (summary["replicas"], summary["outer_steps"], summary["inner_steps_per_replica"]) == (
        2, 2, 10,
    )  # fmt: skip
    assert summary["data_parallel_bytes_per_replica"] > summary["bytes_up_per_replica"] > 0
    with open(summary["plot"], "rb") as plot:
        assert plot.read(8) == b"\x89PNG\r\n\x1a\n"

    logs = diloco("logs", "local-1", "--config", config)
    assert logs.exit_code == 0
    assert "replica local-1 done" in logs.stdout

    # Launched again, a finished run resumes at its end: each replica heals from the final
    # checkpoint and is done at once; no step is trained twice.
    again = diloco("launch", "--config", config)
    assert again.exit_code == 0, again.output
    assert "resuming it (--fresh starts over)" in again.output
    metrics = run_metrics(load_config(config)).read()
    for replica in metrics.values():
        assert replica.incarnations == [0, 1]
        assert [sync.round for sync in replica.syncs] == [0, 1]
        healed, resumed, done = replica.events[-3:]
        assert "healed from checkpoint 1: replayed 0 rounds" in healed.detail
        assert resumed.detail == "own state of round 1 restored: exact, the round healed to"
        assert done.event == "done"


@pytest.mark.integration
def test_a_streaming_run_evaluates_the_weights_every_replica_agreed_on(run_toml):
    """At a sync only the synced fragment holds the agreed weights; the other has trained on
    locally, differently on each replica. The held-out loss is taken of every fragment's
    agreed weights, so every replica reports the same number at every outer step."""
    config = as_streaming(run_toml())
    result = diloco("launch", "--config", config)
    assert result.exit_code == 0, result.output
    losses = evaluated_losses(config)
    assert sorted(losses) == [1, 2]
    assert all(len(values) == 1 for values in losses.values()), losses


@pytest.mark.integration
def test_a_sparse_streaming_run_agrees_and_keeps_each_fragments_accumulator(run_toml):
    """SparseLoCo over two fragments: every replica reports the same held-out loss at every
    outer step (their global weights agree), and each saved its error feedback with its own
    state: one accumulator per fragment, the two the model's size together."""
    config = as_streaming(run_toml())
    path = Path(config)
    path.write_text(path.read_text().replace('codec = "fp32"', 'codec = "sparse"'))
    result = diloco("launch", "--config", config)
    assert result.exit_code == 0, result.output
    losses = evaluated_losses(config)
    assert sorted(losses) == [1, 2]
    assert all(len(values) == 1 for values in losses.values()), losses
    loaded = load_config(config)
    store, layout = Store(loaded.store_url()), RunLayout(loaded.run.name)
    for replica in ("local-0", "local-1"):
        newest = saved_rounds(store, layout, replica)[0]
        with Spools() as spools:
            _, refs = read_replica_state(store, layout, replica, newest, 1 << 30, spools)
            tree = materialized(refs)
        sizes = {stream: buffer.numel() for stream, buffer in tree["feedback"].items()}
        assert sorted(sizes) == ["0", "1"]
        assert sum(sizes.values()) == parameter_count(loaded)[0]
        assert all(float(buffer.abs().sum()) > 0 for buffer in tree["feedback"].values())


@pytest.mark.integration
def test_a_killed_replica_leaves_the_others_to_finish(run_toml):
    """min_replicas = 2 of 3: once local-2 is SIGKILLed, the others seal without it.

    The kill must land while the run goes on: forked replicas trained all 12 rounds in 5 s on
    a loaded machine, between two looks of ``diloco status`` (whose metrics also lag rounds).
    So the test looks in the store for local-2's manifest of round 1 (it synced round 0; a
    look takes milliseconds), then freezes local-0 and local-1: local-2, alone, can seal no
    round more, so it is alive when it is killed. Woken, the two seal the rest without it."""
    config = run_toml(replicas=3, outer_steps=12)
    assert diloco("launch", "--config", config, "--detach").exit_code == 0
    state = json.loads(Path(".diloco/t/launch.json").read_text())
    pids = {handle["replica_id"]: handle["job"]["pid"] for handle in state["replicas"]}
    store, deadline = Store(load_config(config).store_url()), time.monotonic() + 120
    layout = RunLayout("t")
    while layout.manifest(1, 0, "local-2", 0) not in store.list_prefix(layout.manifests(1, 0)):
        assert time.monotonic() < deadline, statuses(config)
        time.sleep(0.05)
    held = [pids["local-0"], pids["local-1"]]
    for pid in held:
        os.killpg(pid, signal.SIGSTOP)
    os.kill(pids["local-2"], signal.SIGKILL)
    for pid in held:
        os.killpg(pid, signal.SIGCONT)
    while {statuses(config)[r]["state"] for r in ("local-0", "local-1")} != {"done"}:
        assert time.monotonic() < deadline, statuses(config)
        time.sleep(0.5)
    rows = statuses(config)
    assert rows["local-2"]["state"] == "exited"
    assert rows["local-2"]["outer_step"] < rows["local-0"]["outer_step"] == 12


def _checkpoint_committed(config: Path) -> bool:
    loaded = load_config(config)
    return bool(committed_rounds(Store(loaded.store_url()), RunLayout(loaded.run.name)))


def _first_checkpoints_writer(config: str) -> str:
    """The replica that commits the run's first checkpoint (round 0's): the first of its
    SEAL's contributors (``checkpoints/writer.py``)."""
    loaded = load_config(config)
    layout = RunLayout(loaded.run.name)
    seal = decode_record(Store(loaded.store_url()).get(layout.seal(0, 0)), Seal, key="seal")
    return parse_contributor(seal.contributors[0])[0]


@pytest.mark.integration
def test_a_run_killed_whole_resumes_where_it_was_and_loses_no_round(run_toml):
    """Every replica SIGKILLed mid-run; the same launch again resumes from the bucket."""
    outer_steps = 8
    config = run_toml(replicas=2, outer_steps=outer_steps)
    assert diloco("launch", "--config", config, "--detach").exit_code == 0
    pids = {handle["replica_id"]: handle["job"]["pid"] for handle in
            json.loads(Path(".diloco/t/launch.json").read_text())["replicas"]}  # fmt: skip
    deadline = time.monotonic() + 120
    while min((row["outer_step"] for row in statuses(config).values()), default=0) < 3:
        assert time.monotonic() < deadline, statuses(config)
        time.sleep(0.2)
    # Killed mid-run once the first checkpoint is committed (it is written in the background
    # after the first commit: its time is not a step count's). Meanwhile the replica that does
    # not commit it is frozen, so that the run cannot end first: every round needs both. On a
    # loaded machine the run once trained to its end before the checkpoint was seen.
    committer = _first_checkpoints_writer(config)
    [other] = set(pids) - {committer}
    os.kill(pids[other], signal.SIGSTOP)
    while not _checkpoint_committed(config):
        assert time.monotonic() < deadline, statuses(config)
        time.sleep(0.2)
    kill_all(config)
    killed_at = max(row["outer_step"] for row in statuses(config).values())

    resumed = diloco("launch", "--config", config)
    assert resumed.exit_code == 0, resumed.output
    metrics = run_metrics(load_config(config)).read()
    # No committed round lost or repeated: the run ends at step 8 after round 7, one commit per
    # round. (A round sealed just before the kill has no sync line: the resumed replicas
    # replayed it.)
    for replica in metrics.values():
        last = replica.syncs[-1]
        assert (last.round, last.outer_step, last.committed) == (outer_steps - 1, outer_steps, True)
    for replica in metrics.values():
        assert replica.incarnations == [0, 1]  # metrics go on in the same run
        second = replica.events_by_incarnation[1]
        healed = next(event for event in second if event.event == "healed")
        assert "healed from checkpoint" in healed.detail
        rounds = [sync.round for sync in replica.syncs]
        assert rounds == sorted(rounds)  # the second incarnation starts where the first ended
        assert max(rounds) == outer_steps - 1
    assert killed_at < outer_steps

    # against the same run uninterrupted (started over): the same held-out loss within 5%
    uninterrupted = diloco("launch", "--config", config, "--fresh")
    assert uninterrupted.exit_code == 0, uninterrupted.output
    clean = run_metrics(load_config(config)).read()
    resumed_loss = next(iter(metrics.values())).latest_eval_loss()
    clean_loss = next(iter(clean.values())).latest_eval_loss()
    assert abs(resumed_loss / clean_loss - 1) < 0.05, (resumed_loss, clean_loss)


def _keep_until(supervisor: Supervisor, wanted: str, deadline: float) -> list[str]:
    """Let the supervisor's keeper pass until one says ``wanted``; every note it said."""
    notes: list[str] = []
    while not any(wanted in note for note in notes):
        assert time.monotonic() < deadline, notes
        notes += supervisor.restart_failed()
        time.sleep(0.1)
    return notes


@pytest.mark.integration
def test_the_supervisor_restarts_a_killed_replica_but_not_one_stopped_on_purpose(run_toml):
    plan = plan_launch(load_config(run_toml(replicas=2, outer_steps=200)), {"local": 2})
    supervisor = Supervisor(plan, start(plan), max_restarts=1)
    mark_stopped(plan.config, ["local-1"])  # what `diloco stop` records before it signals
    try:
        for handle in supervisor.handles:
            os.killpg(handle.job["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        notes = _keep_until(supervisor, "restarted", deadline)
        assert notes[-1] == "local-0 restarted (attempt 1): its local job failed (exit -9)"
        assert not any("local-1" in note for note in notes)
        assert [supervisor.state(h) for h in supervisor.handles] == ["running", "failed"]
        assert [h.job["pid"] for h in load_handles(plan.config)] == [
            h.job["pid"] for h in supervisor.handles
        ]  # the bucket's record: attempt 1 of local-0 is its current job
        os.killpg(supervisor.handles[0].job["pid"], signal.SIGKILL)
        notes = _keep_until(supervisor, "not restarted", deadline)  # at most max_restarts
        assert notes[-1].startswith("local-0 ended and is not restarted: its local job failed")
        assert notes[-1].endswith("out of restarts ([keep] max_restarts = 1)")
        assert not supervisor.restarting
    finally:
        for handle in supervisor.handles:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(handle.job["pid"], signal.SIGKILL)


def test_a_bad_run_toml_prints_every_problem_and_starts_nothing(run_toml, tmp_path):
    (tmp_path / "run.toml").write_text('[run]\nreplicas = 0\n[diloco]\ncodec = "fp4"\n')
    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 1
    assert "run.replicas = 0: Input should be greater than or equal to 1" in result.output
    assert "diloco.codec = 'fp4'" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / ".diloco").exists()
    assert not (tmp_path / "store").exists()


def test_dry_run_prints_each_replica_spec_and_starts_nothing(run_toml, tmp_path):
    config = run_toml(replicas=3)
    result = diloco("launch", "--config", config, "--backend", "local", "--dry-run")
    assert result.exit_code == 0, result.output
    specs = json.loads(result.stdout)["replicas"]
    assert [spec["replica_id"] for spec in specs] == ["local-0", "local-1", "local-2"]
    assert [spec["env"]["DILOCO_REPLICA_INDEX"] for spec in specs] == ["0", "1", "2"]
    assert {spec["env"]["DILOCO_STORE"] for spec in specs} == {str(tmp_path / "store")}
    assert specs[0]["args"] == ["--config", config]
    assert not (tmp_path / ".diloco").exists()
    assert not (tmp_path / "store").exists()
    ahead = json.loads(result.stdout)["forecast"]  # also said to the user, on stderr
    assert [(p["platform"], p["attempts"]) for p in ahead["limits"]["platforms"]] == [("local", 1)]
    assert ahead["cost"]["unpriced"]  # local processes have no list price: the JSON says so
    # nothing is billed: one line, not a table of $0.00 before every local launch (make demo)
    said = [line for line in result.stderr.splitlines() if line.strip()]
    assert said == ["on this machine, with a local store: nothing billed; about 1 min (assumed "
                    "1 s per inner step: set [budget] step_seconds)"]  # fmt: skip
    with (tmp_path / "run.toml").open("a") as file:
        file.write("[budget]\nhourly_usd = { local = 2.0 }\n")  # priced: the whole estimate
    priced = diloco("launch", "--config", config, "--backend", "local", "--dry-run")
    assert "local: no attempt limit; one attempt" in priced.stderr
    assert "cost estimate at list prices" in priced.stderr


def test_a_platform_time_limit_shorter_than_the_run_is_planned_with_the_keeper(run_toml, tmp_path):
    """The dry run says when HF Jobs' timeout ends each attempt and who starts the next."""
    config = run_toml(replicas=2, outer_steps=100)  # 500 inner steps
    with (tmp_path / "run.toml").open("a") as file:
        file.write('[budget]\nstep_seconds = 36.0\n[backends.hf_jobs]\ntimeout = "2h"\n'
                   '[image]\nref = "ghcr.io/o/p:1"\n')  # fmt: skip
    text = (tmp_path / "run.toml").read_text().replace('store = "store"', 'store = "s3://b/r"')
    (tmp_path / "run.toml").write_text(text)
    result = diloco("launch", "--config", config, "--backend", "hf_jobs", "--dry-run")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["forecast"]["limits"]
    assert plan["run_hours"] == 5.0
    assert [(p["attempts"], p["attempt_ends_hours"]) for p in plan["platforms"]] == [
        (3, [2.0, 4.0, 5.0])
    ]
    assert "the keeper (`diloco keep`) starts the next attempt" in result.output


@pytest.mark.integration
def test_stop_ends_the_replicas_and_they_say_so(run_toml):
    config = run_toml(replicas=2, outer_steps=200)
    assert diloco("launch", "--config", config, "--detach").exit_code == 0
    deadline = time.monotonic() + 120
    while min((row["outer_step"] for row in statuses(config).values()), default=0) < 1:
        assert time.monotonic() < deadline, statuses(config)
        time.sleep(0.5)
    assert diloco("stop", "--config", config).exit_code == 0
    while {row["state"] for row in statuses(config).values()} != {"stopped"}:
        assert time.monotonic() < deadline, statuses(config)
        time.sleep(0.5)
    assert all(row["outer_step"] < 200 for row in statuses(config).values())


@pytest.mark.integration
def test_a_replica_stopped_before_its_first_metrics_line_shows_stopped(run_toml):
    """Stopped while still importing torch: the bucket has nothing from it, its process has
    ended, and `diloco stop` ended it; status says so at once."""
    config = run_toml(replicas=2, outer_steps=200)
    assert diloco("launch", "--config", config, "--detach").exit_code == 0
    assert diloco("stop", "--config", config).exit_code == 0
    assert {row["state"] for row in statuses(config).values()} == {"stopped"}


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """Another working folder, as on a fresh CI runner: no .diloco/ of the first launch."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def _launched_from_another_folder(config: str, elsewhere: Path) -> list[int]:
    """Launch ``config`` (detached) from the folder above ``elsewhere``, then go there; the
    launched processes' ids."""
    os.chdir(elsewhere.parent)
    assert diloco("launch", "--config", config, "--detach").exit_code == 0
    os.chdir(elsewhere)
    return _pids(config)


def _pids(config: str) -> list[int]:
    return [handle.job["pid"] for handle in load_handles(load_config(config))]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _wait_for_states(config: str, states: set[str], deadline: float) -> None:
    while {row["state"] for row in statuses(config).values()} - states:
        assert time.monotonic() < deadline, statuses(config)
        time.sleep(0.5)


@pytest.mark.integration
def test_a_launch_from_another_folder_is_refused_while_the_run_goes_and_status_and_stop_work_there(
    run_toml, elsewhere
):
    """The launch is recorded in the run's bucket: a second launcher that has none of the
    first one's files (a fresh CI runner) is refused, naming the replicas that still run, and
    `status` and `stop` work from its folder."""
    config = run_toml(replicas=2, outer_steps=200)
    pids = _launched_from_another_folder(config, elsewhere)
    try:
        refused = diloco("launch", "--config", config, "--detach")
        assert refused.exit_code == 1, refused.output
        assert "run t is still going: local-0 (local job running), local-1 (local job " in (
            refused.output
        )
        assert "`diloco stop`" in refused.output
        assert _pids(config) == pids  # nothing started, the record is the first launch's
        assert set(statuses(config)) == {"local-0", "local-1"}
        assert diloco("stop", "--config", config).exit_code == 0
        _wait_for_states(config, {"stopped"}, time.monotonic() + 60)
        assert not (elsewhere / ".diloco" / "t" / "launch.json").exists()
    finally:
        _kill(pids)


def test_a_job_whose_platform_cannot_say_counts_as_running(run_toml, elsewhere):
    """A local replica launched on another machine: its state there is unknown, which may be
    running, so the launch is refused (docs/backends.md)."""
    loaded = load_config(run_toml(replicas=2))
    launches = run_launches(loaded)
    record = launches.begin(plan_launch(loaded, {"local": 2}).specs, None, {}, time.time())
    job = {"pid": 1, "log": "/var/log/local-0.log", "host": "another-machine"}
    launches.started(record.number, ReplicaHandle("local-0", "local", job), 0, time.time())
    refused = diloco("launch", "--config", str(loaded.source), "--detach")
    assert refused.exit_code == 1
    assert "local-0 (local job unknown, its platform cannot say)" in refused.output
    assert statuses(str(loaded.source))["local-0"]["state"] == "unknown"
    stop = diloco("stop", "--config", str(loaded.source))
    assert stop.exit_code == 1
    assert "it runs on another-machine: stop it there" in stop.output


@pytest.mark.integration
def test_a_replica_started_some_other_way_is_seen_by_its_lease(run_toml, elsewhere):
    """No launch names it, but its lease advances: the launch is refused; once it has left,
    the same launch starts (a replica that left cleanly costs no waiting)."""
    loaded = load_config(run_toml(replicas=2, outer_steps=1))
    config = CollectiveConfig(lease=LeasePolicy(period=0.2))
    store = Store(loaded.store_url())
    with BucketCollective(store, "t", "local-0", config):
        refused = diloco("launch", "--config", str(loaded.source), "--detach")
    assert refused.exit_code == 1
    assert "local-0 (its lease advances)" in refused.output
    launched = diloco("launch", "--config", str(loaded.source))
    assert launched.exit_code == 0, launched.output


@pytest.mark.integration
def test_fresh_stops_the_last_launch_from_any_folder_and_starts_over(run_toml, elsewhere):
    config = run_toml(replicas=2, outer_steps=200)
    first = _launched_from_another_folder(config, elsewhere)
    try:
        again = diloco("launch", "--config", config, "--detach", "--fresh")
        assert again.exit_code == 0, again.output
        assert "--fresh: stopping the 2 replicas of the last launch first" in again.output
        second = _pids(config)
        assert set(second).isdisjoint(first)
        for pid in first:  # ended (and reaped: this process started them)
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert run_launches(load_config(config)).numbers() == [0]  # the run started over
        assert diloco("stop", "--config", config).exit_code == 0
    finally:
        _kill(first + _pids(config))


def test_two_launchers_cannot_both_start_the_run(tmp_path):
    """Each takes the number after the newest launch it checked: whichever comes second,
    at once or after the first has started, is refused."""
    first = Launches(Store(str(tmp_path)), RunLayout("t"))
    second = Launches(Store(str(tmp_path)), RunLayout("t"))
    checked = [max(launches.numbers(), default=-1) + 1 for launches in (first, second)]
    record = first.begin((), None, {}, 1.0, checked[0])
    with pytest.raises(LaunchTakenError, match="launch 0 of run t was taken by another"):
        second.begin((), None, {}, 2.0, checked[1])
    assert first.latest().record == record


def test_a_launch_keeps_each_replica_ids_index_whatever_the_order_of_its_backends(run_toml):
    """The index follows the order of the platforms: the last launch's order is kept (new
    platforms after it), so reordering ``--backend`` moves no replica id to another shard."""
    config = load_config(run_toml(replicas=3))
    assert in_last_launch_order(config, {"local": 1, "hf_jobs": 1}) == {"local": 1, "hf_jobs": 1}
    before = (
        ReplicaSpec("hf_jobs-0", 0, "hf_jobs", {}, ()),
        ReplicaSpec("local-0", 1, "local", {}, ()),
    )
    run_launches(config).begin(before, None, {}, time.time())
    counts = in_last_launch_order(config, {"modal": 1, "local": 2, "hf_jobs": 1})
    assert list(counts.items()) == [("hf_jobs", 1), ("local", 2), ("modal", 1)]

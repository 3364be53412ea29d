"""Checkpoint mirrors: every committed checkpoint reaches each mirror intact (its COMMIT last),
a mirror that fails is reported in the run's status without holding training back, and a run
whose store is destroyed resumes from its mirror (``diloco launch --resume-from``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.cli.tables import status_table
from diloco_anywhere.config import RunConfig, load_config
from diloco_anywhere.launching.start.launch import run_metrics
from diloco_anywhere.launching.watch.status import ReplicaStatus
from diloco_anywhere.training.checkpoints.commits import committed_rounds
from diloco_anywhere.training.checkpoints.reader import load_checkpoint, read_checkpoint
from diloco_anywhere.training.checkpoints.writer import CheckpointPolicy
from diloco_anywhere.training.recovery.mirrors import MirrorWriter, ResumeError, resume_from
from support.checkpoints import diloco_like_state, write_checkpoint
from support.hf import use_gateway
from support.proxy import FaultProxy
from support.runs import RUN_TOML, diloco, kill_all, statuses

RUN = RunLayout("t")


def _write_run_toml(tmp_path, monkeypatch, mirrors: list[str], outer_steps: int, every: int):
    monkeypatch.chdir(tmp_path)
    text = RUN_TOML.format(replicas=2, outer_steps=outer_steps)
    checkpoint = f"\n[checkpoint]\nevery = {every}\nkeep = 2\nmirrors = {mirrors!r}\n"
    (tmp_path / "run.toml").write_text(text + checkpoint.replace("'", '"'))


def _launch(tmp_path, monkeypatch, mirrors: list[str], every: int = 1) -> None:
    _write_run_toml(tmp_path, monkeypatch, mirrors, outer_steps=3, every=every)
    result = diloco("launch", "--config", "run.toml")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("where", ["folder", "hf"])
def test_every_committed_checkpoint_reaches_the_mirror_intact(
    where, standins, tmp_path, monkeypatch
):
    """A folder next to run.toml (relative, as run.store), or a Hugging Face bucket (its
    gateway's stand-in) while the store is on disk. Checkpoints after the first round and the
    last: a copy still running when the next checkpoint commits would skip that one, but the
    run's last waits for it."""
    url = "mirror"
    if where == "hf":
        gateway = standins("hf")
        use_gateway(gateway, monkeypatch)
        url = f"{gateway.url}/mirror-{tmp_path.name}"
    _launch(tmp_path, monkeypatch, [url], every=100)
    config = load_config(tmp_path / "run.toml")
    primary, mirror = Store(config.store_url()), Store(config.mirror_urls()[0])
    rounds = committed_rounds(primary, RUN)
    assert rounds == [2, 0]
    assert committed_rounds(mirror, RUN) == rounds
    for round_ in rounds:
        copied, original = (
            load_checkpoint(mirror, RUN, round_),
            load_checkpoint(primary, RUN, round_),
        )
        assert copied.commit == original.commit  # same sizes and checksums of the same objects
    assert all(row["mirror_failures"] == 0 for row in statuses("run.toml").values())


def test_a_copy_under_way_makes_a_checkpoint_skip_that_mirror_but_never_the_last(
    s3_run, standins, monkeypatch, tmp_path
) -> None:
    """The mirror does not answer (held at a proxy) while round 1's copy is under way: round
    2's is skipped, and round 3's, the run's last, waits for it and is copied."""
    url, layout = s3_run[0], RunLayout("run")
    store, checkpoints = Store(str(tmp_path / "store")), []
    for round_ in (1, 2, 3):
        write_checkpoint(store, round_, diloco_like_state(round_))
        checkpoints.append(read_checkpoint(store, layout, round_))
    failures: list[str] = []
    with FaultProxy(standins("s3").storage_options["endpoint_url"]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        writer = MirrorWriter(
            [url], layout, CheckpointPolicy.of(RunConfig(), keep=5), report=failures.append
        )
        proxy.hold()
        writer.copy(checkpoints[0])
        writer.copy(checkpoints[1])  # round 1's copy cannot have finished: skipped
        threading.Timer(0.5, proxy.release).start()
        writer.copy(checkpoints[2], last=True)  # waits for round 1's, then copies
        writer.close()
        assert committed_rounds(Store(url), layout) == [3, 1]
    assert failures == []


@pytest.mark.integration
def test_a_failing_mirror_is_reported_and_training_goes_on(tmp_path, monkeypatch):
    (tmp_path / "not-a-folder").write_text("a file where the mirror's folder would be")
    _launch(tmp_path, monkeypatch, [str(tmp_path / "not-a-folder" / "mirror")])
    rows = statuses("run.toml")
    assert {(row["state"], row["outer_step"]) for row in rows.values()} == {("done", 3)}
    assert sum(row["mirror_failures"] for row in rows.values()) >= 1
    console = Console(width=200, record=True)
    console.print(status_table([ReplicaStatus(**row) for row in rows.values()], "t"))
    assert "mirror failed" in console.export_text()


def _signal_all(signum: int) -> None:
    for handle in json.loads(Path(".diloco/t/launch.json").read_text())["replicas"]:
        os.kill(handle["job"]["pid"], signum)


def _sealed_rounds(store: Store) -> list[int]:
    keys = store.list_prefix(f"{RUN.run}/rounds")
    return sorted({int(key.split("/")[2]) for key in keys if key.endswith("/SEAL")})


@pytest.mark.integration
def test_a_run_whose_store_is_destroyed_mid_run_resumes_from_its_mirror(tmp_path, monkeypatch):
    """Mid-run, once the mirror has a checkpoint of round 3, the replicas are frozen where they
    are, their store destroyed (a file in its place: every read and write fails) and the
    replicas killed; an empty store and ``--resume-from mirror`` finish the run from the
    mirror's latest checkpoint, the lost rounds trained again. Then the same run uninterrupted
    (``--fresh``, over the same mirror): the held-out loss is within 2%."""
    outer_steps = 12  # checkpoints after rounds 0, 3, 7 and 11
    _write_run_toml(tmp_path, monkeypatch, ["mirror"], outer_steps=outer_steps, every=4)
    primary, mirror = tmp_path / "store", Store(str(tmp_path / "mirror"))
    assert diloco("launch", "--config", "run.toml", "--detach").exit_code == 0
    deadline = time.monotonic() + 180
    while not [r for r in committed_rounds(mirror, RUN) if r >= 3]:
        assert time.monotonic() < deadline, "no checkpoint after round 3 reached the mirror"
        time.sleep(0.2)
    _signal_all(signal.SIGSTOP)  # the replicas hold where they are (mid-round, mid-write)
    primary.rename(tmp_path / "destroyed")
    primary.write_text("the store is gone: every read and write fails")
    kill_all("run.toml")
    sealed = _sealed_rounds(Store(str(tmp_path / "destroyed")))  # what the store had
    shutil.rmtree(tmp_path / "destroyed")
    primary.unlink()  # a new, empty store in its place (`diloco infra up`)

    planned = diloco("launch", "--config", "run.toml", "--resume-from", "mirror", "--dry-run")
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.stdout)["resume_from"]
    assert (plan["mirror"], plan["store"], plan["damaged"]) == (mirror.url, "empty", [])
    assert [c["round"] for c in plan["checkpoints"]] == committed_rounds(mirror, RUN)
    assert not primary.exists()  # a dry run writes nothing

    resumed = diloco("launch", "--config", "run.toml", "--resume-from", "mirror")
    assert resumed.exit_code == 0, resumed.output
    restored = committed_rounds(mirror, RUN)
    metrics = run_metrics(load_config(tmp_path / "run.toml")).read()
    first_rounds = {replica.syncs[0].round for replica in metrics.values()}
    [checkpoint] = {round_ - 1 for round_ in first_rounds}  # healed from it, then its next round
    assert checkpoint in (3, 7)  # 7 only if this test was held up for four rounds
    said = f"resuming from the checkpoint of round {checkpoint} in {mirror.url}"
    assert "".join(said.split()) in "".join(resumed.output.split())  # rich wraps lines
    for replica in metrics.values():
        healed = next(event for event in replica.events if event.event == "healed")
        assert f"healed from checkpoint {checkpoint}: replayed 0 rounds" in healed.detail
        last = replica.syncs[-1]
        assert (last.round, last.outer_step, last.committed) == (outer_steps - 1, outer_steps, True)
    lost = [round_ for round_ in sealed if round_ > checkpoint]
    print(f"resumed from the checkpoint of round {checkpoint}; rounds lost, trained again: {lost}")
    assert max(restored) == outer_steps - 1  # the resumed run goes on mirroring

    uninterrupted = diloco("launch", "--config", "run.toml", "--fresh")
    assert uninterrupted.exit_code == 0, uninterrupted.output
    clean = run_metrics(load_config(tmp_path / "run.toml")).read()
    assert all(row["mirror_failures"] == 0 for row in statuses("run.toml").values())
    resumed_loss = next(iter(metrics.values())).latest_eval_loss()
    clean_loss = next(iter(clean.values())).latest_eval_loss()
    print(f"held-out loss: resumed {resumed_loss:.4f}, uninterrupted {clean_loss:.4f}")
    assert abs(resumed_loss / clean_loss - 1) < 0.02, (resumed_loss, clean_loss)


@pytest.mark.parametrize("behind", [30.0, 300.0])
def test_the_latest_checkpoint_is_the_mirrors_newest_whatever_its_writers_clocks(
    tmp_path, monkeypatch, behind
) -> None:
    """Round 3 is committed after round 6 (an earlier run's), by a replica whose clock is
    ``behind`` seconds slow: its COMMIT says it is older. The mirror's own time decides."""
    layout, mirror = RunLayout("run"), Store(str(tmp_path / "mirror"))
    write_checkpoint(mirror, 6, diloco_like_state(6))
    time.sleep(0.05)  # beyond a filesystem clock tick (a few ms): the second COMMIT is later
    slow = time.time() - behind
    monkeypatch.setattr(time, "time", lambda: slow)  # the committing replica's clock
    write_checkpoint(mirror, 3, diloco_like_state(3))
    monkeypatch.undo()
    assert (
        read_checkpoint(mirror, layout, 3).commit.time
        < read_checkpoint(mirror, layout, 6).commit.time
    )
    resumed = resume_from(mirror.url, Store(str(tmp_path / "store")), layout)
    assert (resumed.round, resumed.earlier) == (3, (6,))


def test_resuming_takes_the_latest_intact_checkpoint(tmp_path) -> None:
    """Latest by commit time: the mirror's round 6 was committed before round 3 (an earlier run
    of the same name went further), and round 5 is damaged."""
    layout, mirror = RunLayout("run"), Store(str(tmp_path / "mirror"))
    store = Store(str(tmp_path / "store"))
    with pytest.raises(ResumeError, match=r"no checkpoint of run run in .* \(none committed\)"):
        resume_from(str(tmp_path / "mirror"), store, layout)
    for round_ in (6, 3, 5):
        write_checkpoint(mirror, round_, diloco_like_state(round_))
    shard = read_checkpoint(mirror, layout, 5).commit.shards[0].key
    mirror.delete(shard)
    mirror.put(shard, b"damaged")
    resumed = resume_from(str(tmp_path / "mirror"), store, layout)
    assert (resumed.round, resumed.damaged, resumed.earlier) == (3, (5,), (6,))
    assert "checkpoints of rounds 5 are damaged" in resumed.describe()
    assert "rounds 6 were committed before it, by an earlier run" in resumed.describe()
    resumed_here, original = read_checkpoint(store, layout, 3), read_checkpoint(mirror, layout, 3)
    # every object read back checked against its COMMIT, and the COMMITs alike: the same bytes
    assert (resumed_here.commit, resumed_here.commit_bytes) == (
        original.commit,
        original.commit_bytes,
    )
    resumed_here.spools.release()
    original.spools.release()


def test_resuming_refuses_a_store_that_has_the_run_and_fresh_deletes_only_what_it_replaces(
    tmp_path,
) -> None:
    layout, mirror_url = RunLayout("run"), str(tmp_path / "mirror")
    store = Store(str(tmp_path / "store"))
    write_checkpoint(store, 2, diloco_like_state(2))
    with pytest.raises(ResumeError, match=r"run run still has objects in .*add --fresh"):
        resume_from(mirror_url, store, layout)
    with pytest.raises(ResumeError, match="is the run's store itself"):
        resume_from(store.url, store, layout, fresh=True)
    with pytest.raises(ResumeError, match="none committed"):  # an empty mirror: nothing deleted
        resume_from(mirror_url, store, layout, fresh=True)
    assert committed_rounds(store, layout) == [2]
    write_checkpoint(Store(mirror_url), 4, diloco_like_state(4))
    assert resume_from(mirror_url, store, layout, fresh=True).round == 4
    assert committed_rounds(store, layout) == [4]

"""The async all-reduce: Work objects, futures, rounds in flight, across processes."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch

from diloco_anywhere.bench.store import sample_tensor
from diloco_anywhere.bench.tools.processes import worker_context
from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.errors import RoundTimeoutError
from diloco_anywhere.collective.mean import weighted_mean
from diloco_anywhere.collective.members.membership import Heartbeat, claim_incarnation
from diloco_anywhere.collective.policy import CollectiveConfig, LeasePolicy, RoundPolicy
from diloco_anywhere.training.checkpoints.writer import prune_checkpoints
from diloco_anywhere.training.records.metrics import MetricsReader, MetricsWriter

CONFIG = CollectiveConfig(
    round=RoundPolicy(min_replicas=1, grace=5.0, timeout=60.0), lease=LeasePolicy(period=5.0)
)
SHAPE = (40, 25)


def tensor(replica: int, round_: int) -> torch.Tensor:
    return sample_tensor("gaussian", 1000, seed=100 * round_ + replica).view(SHAPE)


def _replica(url, index, barrier, results):
    with BucketCollective(Store(url), "run", f"r{index}", CONFIG) as collective:
        barrier.wait()  # every replica has claimed and leased before the first round
        first = collective.allreduce(tensor(index, 0), round_=0, weight=index + 1)
        second = collective.allreduce(tensor(index, 1), round_=1, fragment=1, weight=1.0)
        future = second.get_future()
        first.wait(timeout=60)
        means = [first.tensor, future.wait()]
        results.put((index, [m.numpy().tobytes() for m in means], means[0].shape))


@pytest.mark.integration
def test_rounds_in_flight_across_processes_agree_with_the_reference(tmp_path):
    context = worker_context()
    barrier, results = context.Barrier(3), context.Queue()
    processes = [
        context.Process(target=_replica, args=(str(tmp_path), i, barrier, results))
        for i in range(3)
    ]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    expected = [
        weighted_mean([(tensor(i, 0).reshape(-1), float(i + 1)) for i in range(3)]),
        weighted_mean([(tensor(i, 1).reshape(-1), 1.0) for i in range(3)]),
    ]
    for _, means, shape in outcomes:
        assert shape == SHAPE
        assert means == [e.numpy().tobytes() for e in expected]


def test_allreduce_returns_before_the_round_ends_and_errors_reach_wait_and_future():
    store, layout = Store("memory://allreduce-async"), RunLayout("run")
    silent = claim_incarnation(store, layout, "silent")
    Heartbeat(store, layout, silent, LeasePolicy()).beat()  # a member that never contributes
    config = CollectiveConfig(round=RoundPolicy(min_replicas=2, grace=0.1, timeout=1.0))
    with BucketCollective(store, "run", "me", config) as collective:
        data = torch.ones(8)
        work = collective.allreduce(data, round_=0)
        data.zero_()  # the collective copied it
        assert not work.done()
        with pytest.raises(TimeoutError):
            work.wait(timeout=0.1)
        future = work.get_future()
        with pytest.raises(RoundTimeoutError, match=r"missing silent-0 \(joined, sent nothing\)"):
            work.wait()
        with pytest.raises(RoundTimeoutError):
            future.wait()


def test_a_replica_alone_seals_as_soon_as_every_member_is_in():
    """With an hour of grace, only the every-member-is-in path can seal (else pytest-timeout)."""
    config = CollectiveConfig(round=RoundPolicy(min_replicas=1, grace=3600.0, timeout=3600.0))
    with BucketCollective(Store("memory://allreduce-alone"), "run", "solo", config) as collective:
        work = collective.allreduce(torch.arange(6.0).view(2, 3), round_=0)
        work.wait()
        assert work.tensor.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert work.result().seal.contributors == ("solo-0",)


def test_rounds_older_than_keep_rounds_are_deleted():
    store = Store("memory://allreduce-gc")
    config = CollectiveConfig(round=RoundPolicy(grace=3600.0, timeout=3600.0), keep_rounds=2)
    with BucketCollective(store, "run", "solo", config) as collective:
        for round_ in range(5):
            for fragment in (0, 1):
                collective.allreduce(torch.ones(4), round_=round_, fragment=fragment).wait()
    kept = {tuple(key.split("/")[2:5]) for key in store.list_prefix("run/rounds")}
    with_data = {(r, f) for r, f, kind in kept if kind != "SEAL"}
    assert with_data == {(f"{r:010d}", f) for r in (3, 4) for f in ("0", "1")}
    # a collected round keeps its SEAL: a replica that far behind fails instead of resealing
    assert {(r, f) for r, f, kind in kept if kind == "SEAL"} == {
        (f"{r:010d}", f) for r in range(5) for f in ("0", "1")
    }


def test_a_collection_that_fails_is_logged_and_the_rounds_go_on(caplog):
    """Garbage collection is off the round's path: when what it needs cannot be read (here
    the newest checkpoint healing replays from), the round stands, the failure is logged, and
    the next round's collection tries again."""
    store = Store("memory://allreduce-gc-fails")
    config = CollectiveConfig(round=RoundPolicy(grace=3600.0, timeout=3600.0), keep_rounds=1)

    def checkpoints_unreadable() -> int:
        raise StoreError("list 'run/checkpoints' failed: the store's credentials expired")

    caplog.set_level(logging.WARNING)
    with BucketCollective(
        store, "run", "solo", config, retained_after=checkpoints_unreadable
    ) as collective:
        for round_ in range(3):
            mean = torch.ones(4)
            collective.allreduce(mean, round_=round_).wait()
            assert torch.equal(mean, torch.ones(4))  # a mean of one: its own contribution
    assert caplog.text.count("garbage collection after round") == 3
    assert "the store's credentials expired" in caplog.text
    kept = {key.split("/")[2] for key in store.list_prefix("run/rounds") if "SEAL" not in key}
    assert kept == {f"{r:010d}" for r in range(3)}  # nothing collected


KILL_CONFIG = CollectiveConfig(
    round=RoundPolicy(
        min_replicas=2, grace=1.0, timeout=60.0, mode="sharded", expected_replicas=3,
        orphan_grace=2.0,
    ),
    lease=LeasePolicy(period=1.0),
)  # fmt: skip


def _member(url, index, barrier, doomed, results):
    with BucketCollective(Store(url), "run", f"r{index}", KILL_CONFIG) as collective:
        barrier.wait()
        if index == 2:
            doomed.set()
            time.sleep(3600)  # SIGKILLed by the test while the others are in round 0
        works = [collective.allreduce(tensor(index, r), round_=r) for r in range(3)]
        seal = works[-1].result().seal  # waits for the last round, so for all of them
        results.put((index, [w.tensor.numpy().tobytes() for w in works], seal))


@pytest.mark.integration
def test_survivors_of_a_sigkilled_member_seal_without_it(tmp_path):
    """r2 dies holding a live lease: round 0 seals after the grace window; once its lease
    lapses, later rounds no longer wait for it."""
    context = worker_context()
    barrier, doomed, results = context.Barrier(3), context.Event(), context.Queue()
    processes = [
        context.Process(target=_member, args=(str(tmp_path), i, barrier, doomed, results))
        for i in range(3)
    ]
    for process in processes:
        process.start()
    assert doomed.wait(timeout=120)
    os.kill(processes[2].pid, signal.SIGKILL)
    outcomes = [results.get(timeout=120) for _ in range(2)]
    for process in processes:
        process.join(timeout=30)
    expected = [
        weighted_mean([(tensor(i, r).reshape(-1), 1.0) for i in range(2)]).numpy().tobytes()
        for r in range(3)
    ]
    for _, means, seal in outcomes:
        assert means == expected
        assert (seal.contributors, seal.mode) == (("r0-0", "r1-0"), "sharded")


def test_a_contribution_from_another_buffer_is_averaged_into_the_tensor_and_left_as_it_was():
    """Error feedback sends its accumulator, not DiLoCo's pseudo-gradient, and the mean goes
    into the pseudo-gradient: ``source`` is what is sent, ``tensor`` what receives."""
    store = Store("memory://allreduce-source")
    config = CollectiveConfig(round=RoundPolicy(min_replicas=2, grace=30.0, timeout=30.0))
    with (
        BucketCollective(store, "run", "a", config) as a,
        BucketCollective(store, "run", "b", config) as b,
    ):
        received = [torch.zeros(6), [torch.zeros(2), torch.zeros(4)]]
        sources = [torch.full((6,), 1.0), torch.full((6,), 3.0)]
        works = [
            collective.allreduce(tensor, round_=0, source=source)
            for collective, tensor, source in zip((a, b), received, sources, strict=True)
        ]
        for work in works:
            work.wait()
        with pytest.raises(ValueError, match="source has 5 values, the tensors 6"):
            a.allreduce(torch.zeros(6), round_=1, source=torch.zeros(5))
    assert received[0].tolist() == [2.0] * 6
    assert [tensor.tolist() for tensor in received[1]] == [[2.0] * 2, [2.0] * 4]
    assert [source.tolist() for source in sources] == [[1.0] * 6, [3.0] * 6]


def test_a_replica_that_starts_mid_round_counts_in_it():
    """The first replica's round began when it was the only member; min_replicas = 2 and an
    hour of grace mean only a refreshed member list can let it seal (else pytest-timeout)."""
    store = Store("memory://allreduce-late-joiner")
    config = CollectiveConfig(
        round=RoundPolicy(min_replicas=2, grace=3600.0, timeout=3600.0),
        lease=LeasePolicy(period=0.2),
    )
    with BucketCollective(store, "run", "first", config) as first:
        work = first.allreduce(torch.ones(4), round_=0)
        time.sleep(0.5)
        with BucketCollective(store, "run", "second", config) as second:
            joined = second.allreduce(torch.full((4,), 3.0), round_=0)
            joined.wait()
            assert joined.tensor.tolist() == [2.0] * 4
        work.wait()
        assert work.tensor.tolist() == [2.0] * 4
    assert work.result().seal.contributors == ("first-0", "second-0")


def test_a_round_a_straggler_still_needs_is_kept():
    """The straggler's lease says it finished round 0 of fragment 0 only: rounds from 1 on stay
    (it must still read their results); round 0 goes once it is keep_rounds old."""
    store, layout = Store("memory://allreduce-straggler"), RunLayout("run")
    straggler = claim_incarnation(store, layout, "slow")
    Heartbeat(store, layout, straggler, LeasePolicy(), progress=lambda: {0: 0}).beat()
    config = CollectiveConfig(round=RoundPolicy(grace=0.0, timeout=30.0), keep_rounds=2)
    with BucketCollective(store, "run", "fast", config) as fast:
        for round_ in range(6):
            fast.allreduce(torch.ones(4), round_=round_).wait()
    with_data = {key.split("/")[2] for key in store.list_prefix("run/rounds") if "SEAL" not in key}
    assert with_data == {f"{r:010d}" for r in range(1, 6)}


STRAYS = [".DS_Store", "rounds/.DS_Store", "rounds/0000000000/.DS_Store",
          "rounds/0000000001/0/.DS_Store", "rounds/0000000001/0/parts/~lock", "metrics/.DS_Store",
          "metrics/local-0/.DS_Store", "members/.DS_Store", "members/solo/0/#claim#",
          "checkpoints/.DS_Store", "checkpoints/0000000001/.DS_Store"]  # fmt: skip


def test_files_that_are_not_keys_in_a_runs_folders_are_skipped_and_named_once(tmp_path, caplog):
    """A Finder's .DS_Store, an editor's lock file: what this tool never writes is skipped by
    every listing (named in the log once), so rounds, garbage collection, metrics and
    checkpoint pruning go on."""
    for stray in STRAYS:
        (tmp_path / "run" / stray).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "run" / stray).write_bytes(b"junk")
    store, layout = Store(f"file://{tmp_path}"), RunLayout("run")
    config = CollectiveConfig(round=RoundPolicy(grace=3600.0, timeout=60.0), keep_rounds=1)
    caplog.set_level(logging.WARNING)
    with BucketCollective(store, "run", "solo", config) as collective:
        for round_ in range(4):
            collective.allreduce(torch.ones(4), round_=round_).wait()
    MetricsWriter(store, layout, "local-0", 0, "local").event("started")
    assert list(MetricsReader(store, layout).read()) == ["local-0"]
    prune_checkpoints(store, layout, keep=2, newest=3)
    data = {key for key in store.list_prefix("run/rounds") if not key.endswith("SEAL")}
    assert {key.split("/")[2] for key in data} == {f"{3:010d}"}  # collected up to round 2
    assert "garbage collection" not in caplog.text
    for stray in STRAYS[1:]:  # the run folder's own is listed by nobody
        assert caplog.text.count(f"skipping 'run/{stray}'") == 1, stray

"""Incarnation claims, leases, liveness, and zombies left out of rounds."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from diloco_anywhere.bench.store import sample_tensor
from diloco_anywhere.bucket.codec import make_codec
from diloco_anywhere.bucket.layout import Participant, RunLayout
from diloco_anywhere.bucket.record import encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import finish_round
from diloco_anywhere.collective.mean import weighted_mean
from diloco_anywhere.collective.membership import (
    Heartbeat,
    Lease,
    LeasePolicy,
    claim_incarnation,
    live_members,
    member_progress,
)
from diloco_anywhere.collective.round import Round, RoundPolicy

RUN = RunLayout("run")
POLICY = LeasePolicy(period=10.0)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_claims_count_up_per_replica(tmp_path):
    store = Store(str(tmp_path))
    assert [claim_incarnation(store, RUN, "a") for _ in range(3)] == [0, 1, 2]
    assert claim_incarnation(store, RUN, "b") == 0


def _claim(url, results):
    results.put(claim_incarnation(Store(url), RUN, "same-replica"))


def test_racing_processes_get_distinct_incarnations(tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_claim, args=(str(tmp_path), results)) for _ in range(6)]
    for process in processes:
        process.start()
    claimed = sorted(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(timeout=30)
    assert claimed == list(range(6))


def test_a_member_is_live_for_this_and_the_last_period_only():
    store, clock = Store("memory://live-periods"), Clock(1000.0)
    me = Participant("a", claim_incarnation(store, RUN, "a"))
    Heartbeat(store, RUN, me, POLICY, clock).beat()  # period 100
    for now, live in [(1000.0, [me]), (1019.9, [me]), (1020.0, []), (990.0, [])]:
        assert live_members(store, RUN, POLICY, now) == live, now


def test_only_the_newest_incarnation_is_a_member():
    store, clock = Store("memory://live-newest"), Clock(500.0)
    old = Participant("a", claim_incarnation(store, RUN, "a"))
    new = Participant("a", claim_incarnation(store, RUN, "a"))
    Heartbeat(store, RUN, old, POLICY, clock).beat()  # the zombie keeps beating
    assert live_members(store, RUN, POLICY, 500.0) == []  # the newest has no lease yet
    Heartbeat(store, RUN, new, POLICY, clock).beat()
    assert live_members(store, RUN, POLICY, 500.0) == [new]


def test_old_leases_are_deleted_by_their_owner():
    store, clock = Store("memory://lease-gc"), Clock(0.0)
    heartbeat = Heartbeat(store, RUN, Participant("a", 0), POLICY, clock)
    for period in range(5):
        clock.now = period * POLICY.period
        heartbeat.beat()
    assert store.list_prefix(RUN.members()) == [RUN.lease("a", 0, 3), RUN.lease("a", 0, 4)]


def test_heartbeat_thread_beats_every_period_until_stopped():
    store = Store("memory://lease-thread")
    me = Participant("a", claim_incarnation(store, RUN, "a"))
    policy = LeasePolicy(period=0.2)
    heartbeat = Heartbeat(store, RUN, me, policy).start()
    time.sleep(0.7)
    heartbeat.stop()
    assert live_members(store, RUN, policy, time.time()) == [me]
    stopped = store.list_prefix(RUN.members())
    assert len(stopped) >= 3  # the claim and at least two leases
    time.sleep(0.5)
    assert store.list_prefix(RUN.members()) == stopped
    assert live_members(store, RUN, policy, time.time() + 0.5) == []


def test_zombie_contribution_is_ignored():
    """An old incarnation still running contributes, but only the newest is a member."""
    store, now = Store("memory://zombie"), time.time()
    zombie = Participant("a", claim_incarnation(store, RUN, "a"))
    restarted = Participant("a", claim_incarnation(store, RUN, "a"))
    other = Participant("b", claim_incarnation(store, RUN, "b"))
    for participant in (zombie, restarted, other):
        Heartbeat(store, RUN, participant, POLICY).beat()
    members = live_members(store, RUN, POLICY, now)
    assert members == [restarted, other]
    tensors = {p: sample_tensor("gaussian", 1000, seed=i) for i, p in enumerate([*members, zombie])}
    received = {p: tensor.clone() for p, tensor in tensors.items()}  # each receives its mean
    results = {}

    def replica(me: Participant) -> None:
        round_ = Round(store, RUN, 0, 0, me, members, RoundPolicy(grace=5, timeout=30))
        round_.contribute(received[me], 1.0, make_codec("fp32"))
        results[me] = finish_round(round_)

    # The zombie starts once the restarted replica has contributed and before the other one:
    # it then sees exactly as many contributions as there are members, its own included.
    threads = []
    for participant, delay in ((restarted, 0.0), (zombie, 0.3), (other, 1.5)):
        time.sleep(delay)
        threads.append(threading.Thread(target=replica, args=(participant,)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    expected = weighted_mean([(tensors[restarted], 1.0), (tensors[other], 1.0)])
    for me, result in results.items():
        assert result.seal.contributors == ("a-1", "b-0")
        assert bool((received[me] == expected).all())


@pytest.mark.parametrize(
    "key",
    ["run/members/a/x/claim", "run/members/a/0/lease-x", "run/rounds/1", "other/members/a/0/claim"],
)
def test_foreign_keys_under_members_are_ignored(key):
    assert RUN.parse_member_key(key) is None


@pytest.mark.parametrize("fragment", ["x", "\u00b2", "1" * 30])
def test_a_lease_with_a_bad_fragment_is_unreadable_not_fatal(fragment, caplog):
    """The fragment keys of a lease's ``finished`` are JSON strings: they are checked as digits
    when the lease is read, so one bad lease costs its member's progress (which keeps every
    round), not the round of whoever collects garbage."""
    store, layout, policy = Store(f"memory://bad-lease-{fragment}"), RunLayout("run"), LeasePolicy()
    now = time.time()
    member = Participant("r", 0)
    lease = Lease.model_construct(
        replica="r", incarnation=0, period=policy.current(now), finished={fragment: 3}
    )
    store.put(layout.lease("r", 0, policy.current(now)), encode_record(lease))
    with caplog.at_level("WARNING"):
        assert member_progress(store, layout, [member], policy, now) == {member.name: {}}
    assert "unreadable lease" in caplog.text

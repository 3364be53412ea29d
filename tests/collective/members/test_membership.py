"""Membership across clouds: incarnation claims, fencing of zombies, liveness judged on the
reader's clock alone, and skew made visible."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_anywhere.bench.store import sample_tensor
from diloco_anywhere.bench.tools.processes import worker_context
from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.bucket.format.framing import WireFormatError
from diloco_anywhere.bucket.format.layout import Participant, RunLayout
from diloco_anywhere.bucket.format.record import encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.errors import RoundTimeoutError
from diloco_anywhere.collective.mean import weighted_mean
from diloco_anywhere.collective.members.membership import (
    SKEW_SHOWN,
    Heartbeat,
    Lease,
    LeasePolicy,
    Liveness,
    Membership,
    MembershipView,
    SupersededError,
    claim_incarnation,
    member_progress,
    newest_leases,
    watch_live,
)
from diloco_anywhere.collective.policy import CollectiveConfig, RoundPolicy
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.collective.round import Round
from diloco_anywhere.training.records.metrics import MetricsReader
from support.rounds import finish_in_threads

RUN = RunLayout("run")
POLICY = LeasePolicy(period=10.0)
SKEWS = [-300.0, -30.0, 30.0, 300.0]  # seconds: +-30 s and +-5 min


class Clock:
    """A clock the test moves by hand: nothing in these tests sleeps through a period."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def beating(store: Store, replica: str, skew: float = 0.0, **kwargs) -> Heartbeat:
    """A claimed incarnation of ``replica`` whose wall clock is ``skew`` seconds off."""
    claim = claim_incarnation(store, RUN, replica)
    return Heartbeat(store, RUN, claim, POLICY, Clock(1.8e9 + skew), **kwargs)


# -- claims ------------------------------------------------------------------------------------


def test_claims_count_up_per_replica(tmp_path):
    store = Store(str(tmp_path))
    assert [claim_incarnation(store, RUN, "a").incarnation for _ in range(3)] == [0, 1, 2]
    assert claim_incarnation(store, RUN, "b").incarnation == 0


def _claim(url, results):
    results.put(claim_incarnation(Store(url), RUN, "same-replica").incarnation)


@pytest.mark.integration
def test_racing_processes_get_distinct_incarnations(tmp_path):
    context = worker_context()
    results = context.Queue()
    processes = [context.Process(target=_claim, args=(str(tmp_path), results)) for _ in range(6)]
    for process in processes:
        process.start()
    claimed = sorted(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(timeout=30)
    assert claimed == list(range(6))


# -- liveness on the reader's clock --------------------------------------------------------------


@pytest.mark.parametrize("skew", [0.0, *SKEWS])
def test_a_member_is_live_while_its_beat_changes_on_the_readers_clock(skew):
    """The writer's wall clock (skewed by up to 5 minutes) plays no part: only whether the
    beat this reader sees has changed within ``expiry`` of the reader's own monotonic clock."""
    store, reader_clock = Store(f"memory://live-{skew}"), Clock(50.0)
    heartbeat = beating(store, "a", skew)
    me = heartbeat.me
    liveness = Liveness(POLICY, reader_clock)
    view = lambda: MembershipView.read(store, RUN)  # noqa: E731
    assert liveness.live(view()) == []  # claimed, no lease yet
    heartbeat.beat()
    assert liveness.live(view()) == [me]  # first sight: live until proven otherwise
    reader_clock.sleep(POLICY.expiry - 0.1)
    assert liveness.live(view()) == [me]
    reader_clock.sleep(0.1)
    assert liveness.live(view()) == []  # unchanged for a whole expiry: dead
    heartbeat.beat()
    assert liveness.live(view()) == [me]  # it beat again: live, counted from now
    reader_clock.sleep(POLICY.expiry - 0.1)
    assert liveness.live(view()) == [me]


def test_only_the_newest_incarnation_is_a_member():
    store = Store("memory://live-newest")
    zombie = beating(store, "a")
    newer = claim_incarnation(store, RUN, "a")
    zombie.beat()  # the zombie keeps beating
    liveness = Liveness(POLICY, Clock())
    assert liveness.live(MembershipView.read(store, RUN)) == []  # the newest has no lease yet
    Heartbeat(store, RUN, newer, POLICY).beat()
    assert liveness.live(MembershipView.read(store, RUN)) == [newer.participant]


def test_old_leases_are_deleted_by_their_owner_and_all_of_them_when_it_leaves():
    store = Store("memory://lease-gc")
    heartbeat = beating(store, "a")
    for _ in range(5):
        heartbeat.beat()
    claim = RUN.claim("a", 0)
    assert store.list_prefix(RUN.members()) == [claim, RUN.lease("a", 0, 3), RUN.lease("a", 0, 4)]
    heartbeat.stop()
    assert store.list_prefix(RUN.members()) == [claim]  # nobody waits for a replica that left


def test_a_beat_costs_four_requests_and_a_clock_measurement_one_more_every_30():
    """What a heartbeat costs each lease period (docs/collective.md, "Membership"): one
    listing, its own claim read back, its lease put, its lease two beats old deleted."""
    store = Store("memory://beat-cost")
    membership = Membership(store, RUN, "a", LeasePolicy(period=3600.0))  # beat 0
    membership.heartbeat.beat()
    before = store.stats()
    for _ in range(60):  # beats 2 to 61
        membership.heartbeat.beat()
    spent = store.stats() - before
    assert (spent.lists, spent.puts, spent.deletes) == (60, 60, 60)
    assert spent.gets == 60 + 2  # the claim every beat; the lease's time at beats 30 and 60
    membership.leave()


def test_a_launcher_watching_the_run_sees_live_members_at_once_and_dead_ones_after_expiry():
    """``watch_live`` has no earlier observation: it returns as soon as every member's lease
    has advanced, and otherwise after one expiry with those that did."""
    store, clock = Store("memory://watch-live"), Clock()
    live, dead = beating(store, "live", 300.0), beating(store, "dead", -300.0)
    live.beat()
    dead.beat()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        live.beat()

    assert watch_live(store, RUN, POLICY, clock, sleep) == [live.me]
    assert clock.now == pytest.approx(POLICY.expiry)  # waited out the dead one's lease
    dead.stop()  # left cleanly: its leases are gone
    clock.now = 0.0
    assert watch_live(store, RUN, POLICY, clock, sleep) == [live.me]
    assert clock.now == pytest.approx(POLICY.period / 2)  # one look after the first


def test_a_launcher_waits_as_long_as_the_slowest_lease_says():
    """The run's replicas beat every minute, the launcher's run.toml says every 10 s: it still
    sees them live, waiting as long as their leases say they need."""
    store, clock = Store("memory://watch-slow"), Clock()
    claim = claim_incarnation(store, RUN, "slow")
    slow = Heartbeat(store, RUN, claim, LeasePolicy(period=60.0), Clock())
    slow.beat()
    beats_at = iter([50.0, 110.0, 170.0])
    next_beat = next(beats_at)

    def sleep(seconds: float) -> None:
        nonlocal next_beat
        clock.sleep(seconds)
        if clock.now >= next_beat:
            slow.beat()
            next_beat = next(beats_at)

    assert watch_live(store, RUN, POLICY, clock, sleep) == [slow.me]
    assert 50.0 <= clock.now <= 60.0


@pytest.mark.parametrize("skews", [(30.0, -30.0, 0.0), (300.0, -300.0, 0.0)])
def test_replicas_whose_clocks_disagree_complete_every_round_with_everyone(skews):
    """Three replicas' wall clocks are up to 5 minutes apart. With an hour of grace only
    "every live member is in" can seal, so a replica its peers judged dead (as periods of a
    skewed wall clock made them before) would be left out of a SEAL. Several leases pass
    between rounds, so every replica is judged by beats it saw advance, not only by a first
    sight (the expiry itself is tested on a clock the test moves)."""
    store = Store(f"memory://skewed-{skews[0]}")
    config = CollectiveConfig(
        round=RoundPolicy(min_replicas=1, grace=3600.0, timeout=120.0),
        lease=LeasePolicy(period=0.2, misses=50),  # 10 s: room for a loaded machine
    )
    collectives = [
        BucketCollective(store, "run", f"r{i}", config, wall_clock=lambda s=skew: time.time() + s)
        for i, skew in enumerate(skews)
    ]
    seals, pause = {}, threading.Event()

    def replica(index: int) -> None:
        for round_ in range(3):
            work = collectives[index].allreduce(torch.full((4,), float(index)), round_=round_)
            work.wait()
            seals[index, round_] = work.result().seal.contributors
            pause.wait(5 * config.lease.period)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(len(skews))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for collective in collectives:
        collective.close()
    assert set(seals.values()) == {("r0-0", "r1-0", "r2-0")}
    assert len(seals) == 3 * len(skews)


# -- skew made visible ---------------------------------------------------------------------------


@pytest.mark.parametrize("skew", SKEWS)
def test_the_heartbeat_measures_its_clock_against_the_stores_and_says_so(skew, caplog):
    store = Store(f"memory://skew-{skew}")
    heartbeat = Heartbeat(
        store, RUN, claim_incarnation(store, RUN, "a"), POLICY, lambda: time.time() + skew
    )
    with caplog.at_level(logging.WARNING):
        heartbeat.beat()
    assert heartbeat.skew == pytest.approx(skew, abs=1.0)
    assert f"{skew:+.1f} s off the store's" in caplog.text
    heartbeat.beat()  # the next lease carries it, for `diloco status`
    leases = newest_leases(store, RUN, MembershipView.read(store, RUN), [heartbeat.me])
    assert leases[heartbeat.me.name].skew == pytest.approx(skew, abs=1.0)


def test_a_clock_in_step_with_the_store_is_not_reported(caplog):
    store = Store("memory://skew-none")
    heartbeat = Heartbeat(store, RUN, claim_incarnation(store, RUN, "a"), POLICY, time.time)
    with caplog.at_level(logging.WARNING):
        heartbeat.beat()
    assert abs(heartbeat.skew) < SKEW_SHOWN
    assert "off the store's" not in caplog.text


# -- fencing ---------------------------------------------------------------------------------------


def poll_once(round_: Round) -> Seal | None:
    """One iteration of a replica's wait for the SEAL (sealing if it is ready): the SEAL, or
    None while there is none."""
    round_.policy = replace(round_.policy, timeout=0.0)
    try:
        return round_.wait_for_seal()
    except RoundTimeoutError:
        return None


def tensor(index: int) -> torch.Tensor:
    return sample_tensor("gaussian", 3000, seed=index)


A0, A1, B0 = Participant("a", 0), Participant("a", 1), Participant("b", 0)
MODES = ("gather", "sharded")


def round_of(store, me, members, mode, **changes) -> Round:
    policy = RoundPolicy(
        min_replicas=2, grace=0.0, timeout=60.0, mode=mode, expected_replicas=2,
        part_elements=1024, **changes,
    )  # fmt: skip
    return Round(store, RUN, 0, 0, me, members, policy)


def claimed(store, *participants: Participant) -> None:
    for participant in participants:
        assert claim_incarnation(store, RUN, participant.replica).incarnation == (
            participant.incarnation
        )


@pytest.mark.parametrize("mode", MODES)
def test_a_zombie_that_sees_its_newer_incarnation_cannot_seal_both(mode):
    """The reported failure: zombie ``a-0``'s refreshed member list held ``a-1`` and, added
    as "our lease was late", itself; it sealed the two without ``b``, and every replica
    applied one replica's two copies. Now a member list with a newer incarnation of its own
    id supersedes it before it can seal."""
    store = Store(f"memory://zombie-seals-{mode}")
    claimed(store, A0, B0)
    values = {A0: tensor(0), A1: tensor(1), B0: tensor(2)}
    received = {p: v.clone() for p, v in values.items()}
    policy = round_of(store, B0, [B0], mode).policy
    zombie = Round(store, RUN, 0, 0, A0, [A0, B0], policy, lambda: [A0, A1, B0], 0.0)
    claimed(store, A1)
    newer = round_of(store, A1, [A1, B0], mode)
    zombie.contribute(received[A0], 1.0, make_codec("fp32"))
    newer.contribute(received[A1], 1.0, make_codec("fp32"))
    with pytest.raises(SupersededError, match="a-1"):
        poll_once(zombie)  # two contributions are in and grace is over: it sealed them
    assert poll_once(newer) is None  # a-1 alone is not enough (min_replicas = 2)
    other = round_of(store, B0, [A1, B0], mode)
    other.contribute(received[B0], 1.0, make_codec("fp32"))
    outcomes = finish_in_threads({A1: newer, B0: other})
    expected = weighted_mean([(values[A1], 1.0), (values[B0], 1.0)])
    for me in (A1, B0):
        assert outcomes[me].seal.contributors == ("a-1", "b-0")
        assert outcomes[me].seal.claims == {"a": 1, "b": 0}
        assert torch.equal(received[me], expected)


@pytest.mark.parametrize("mode", MODES)
def test_a_zombie_lists_the_claims_before_it_seals(mode):
    """The zombie's round began before ``a-1`` was claimed; its member list still says it is
    ``a``'s member, and every member's contribution is in. The claims it lists right before
    sealing say otherwise: it stops, and ``b`` and ``a-1`` seal without it."""
    store = Store(f"memory://zombie-lists-{mode}")
    claimed(store, A0, B0)
    values = {A0: tensor(0), A1: tensor(1), B0: tensor(2)}
    received = {p: v.clone() for p, v in values.items()}
    zombie = round_of(store, A0, [A0, B0], mode)
    other = round_of(store, B0, [A1, B0], mode)
    claimed(store, A1)
    zombie.contribute(received[A0], 1.0, make_codec("fp32"))
    other.contribute(received[B0], 1.0, make_codec("fp32"))
    with pytest.raises(SupersededError, match="a-1"):
        poll_once(zombie)  # before: it sealed ("a-0", "b-0")
    newer = round_of(store, A1, [A1, B0], mode)
    newer.contribute(received[A1], 1.0, make_codec("fp32"))
    outcomes = finish_in_threads({A1: newer, B0: other})
    for me in (A1, B0):
        assert outcomes[me].seal.contributors == ("a-1", "b-0")


@pytest.mark.parametrize("mode", MODES)
def test_a_peer_with_a_stale_member_list_never_seals_a_zombie(mode):
    """``b`` began its round when ``a-0`` was the member; ``a-1`` claimed since and the
    zombie contributed. ``b`` lists the claims before sealing, leaves the zombie out and,
    its member list refreshed, waits for ``a-1``."""
    store = Store(f"memory://stale-members-{mode}")
    claimed(store, A0, B0)
    values = {A0: tensor(0), A1: tensor(1), B0: tensor(2)}
    received = {p: v.clone() for p, v in values.items()}
    zombie = round_of(store, A0, [A0, B0], mode)
    zombie.contribute(received[A0], 1.0, make_codec("fp32"))
    claimed(store, A1)
    refreshed = threading.Event()

    def members() -> list[Participant]:
        refreshed.set()
        return [A1, B0]

    other = Round(store, RUN, 0, 0, B0, [A0, B0], replace(zombie.policy), members, 0.0)
    other.contribute(received[B0], 1.0, make_codec("fp32"))
    assert poll_once(other) is None  # before: it sealed ("a-0", "b-0")
    assert refreshed.is_set()
    newer = round_of(store, A1, [A1, B0], mode)
    newer.contribute(received[A1], 1.0, make_codec("fp32"))
    outcomes = finish_in_threads({A1: newer, B0: other})
    for me in (A1, B0):
        assert outcomes[me].seal.contributors == ("a-1", "b-0")
    assert isinstance(finish_in_threads({A0: zombie})[A0], SupersededError)


@pytest.mark.parametrize(
    ("contributors", "claims", "problem"),
    [
        (("a-0", "b-0"), {"a": 1, "b": 0}, "a-0 is older than incarnation a-1"),
        (("a-0", "a-1"), {"a": 1}, "two incarnations of replica 'a'"),
        (("a-0", "a-1", "b-0"), {}, "two incarnations of replica 'a'"),
    ],
)
def test_readers_refuse_a_seal_that_counts_a_zombie_naming_its_key(contributors, claims, problem):
    store = Store(f"memory://bad-seal-{len(contributors)}-{len(claims)}")
    seal = Seal.model_construct(
        run="run", round=0, fragment=0, contributors=contributors, mode="gather",
        sealed_by="a-0", claims=claims,
    )  # fmt: skip
    store.put(RUN.seal(0, 0), encode_record(seal))
    reader = Round(store, RUN, 0, 0, B0, [], RoundPolicy())
    with pytest.raises(WireFormatError, match=problem) as refused:
        reader.read_seal()
    assert RUN.seal(0, 0) in str(refused.value)


def test_a_seal_naming_a_newer_incarnation_tells_the_zombie_reading_it():
    store = Store("memory://seal-supersedes")
    seal = Seal(run="run", round=0, fragment=0, contributors=("a-1",), mode="gather",
                sealed_by="a-1", claims={"a": 1})  # fmt: skip
    store.put(RUN.seal(0, 0), encode_record(seal))
    with pytest.raises(SupersededError, match="a-1"):
        Round(store, RUN, 0, 0, A0, [], RoundPolicy()).read_seal()


PLAYERS = (A0, A1, B0, Participant("c", 0))
Action = st.one_of(
    st.just(("claim", A1)),
    st.tuples(st.sampled_from(["start", "contribute", "poll"]), st.sampled_from(PLAYERS)),
)


@settings(max_examples=60)
@given(actions=st.lists(Action, min_size=1, max_size=30), mode=st.sampled_from(MODES))
def test_no_interleaving_seals_a_zombie_or_two_incarnations(actions, mode):
    """Zombie ``a-0`` and its restart ``a-1`` (claimed at any point), ``b`` and ``c``: each
    starts its round with the member list it would see then, contributes and polls in any
    order. Whatever SEAL results names one incarnation per replica, none older than a claim
    that existed when it was put; every reader accepts it, but the zombie reading a SEAL that
    counts ``a-1``, which learns it is superseded."""
    store = Store(f"memory://interleavings-{uuid.uuid4().hex}")
    claimed(store, A0, B0, PLAYERS[3])
    rounds: dict[Participant, Round] = {}
    contributed: set[Participant] = set()
    claims_when_sealed = None
    for action, who in actions:
        newest = MembershipView.read(store, RUN).newest()
        if action == "claim" and "a" in newest and newest["a"] == 0:
            claimed(store, A1)
        elif action == "start" and who not in rounds and newest.get(who.replica, -1) >= 0:
            if newest[who.replica] == who.incarnation:  # a superseded process starts nothing
                members = [Participant(r, i) for r, i in newest.items()]
                rounds[who] = round_of(store, who, members, mode)
        elif action == "contribute" and who in rounds and who not in contributed:
            rounds[who].contribute(tensor(PLAYERS.index(who)), 1.0, make_codec("fp32"))
            contributed.add(who)
        elif action == "poll" and who in contributed:
            try:
                poll_once(rounds[who])
            except SupersededError:
                assert who == A0
        if claims_when_sealed is None and store.list_prefix(RUN.seal(0, 0)):
            claims_when_sealed = MembershipView.read(store, RUN).newest()
    if claims_when_sealed is None:
        return
    seal = Round(store, RUN, 0, 0, B0, [], RoundPolicy()).read_seal()
    replicas = [name.rpartition("-")[0] for name in seal.contributors]
    assert len(replicas) == len(set(replicas))
    for name in seal.contributors:
        replica, _, incarnation = name.rpartition("-")
        assert int(incarnation) == claims_when_sealed[replica]
    zombie_reads = Round(store, RUN, 0, 0, A0, [], RoundPolicy())
    if "a-1" in seal.contributors:  # the zombie reading it learns that it is superseded
        with pytest.raises(SupersededError):
            zombie_reads.read_seal()
    else:  # a-0 sealed before a-1 was claimed (then a's member), or a not in the round
        assert zombie_reads.read_seal() == seal


# -- a zombie ends itself ----------------------------------------------------------------------


def test_a_zombie_learns_it_is_superseded_at_its_next_beat():
    """Within one lease period: its heartbeat lists the claims every beat."""
    store, ended = Store("memory://zombie-beat"), []
    zombie = Membership(store, RUN, "a", POLICY, on_superseded=ended.append)
    zombie.heartbeat.stop(leave=False)  # beats by hand below
    newer = Membership(store, RUN, "a", POLICY)
    with pytest.raises(SupersededError, match="incarnation a-1 claimed replica a"):
        zombie.heartbeat.beat()
    assert len(ended) == 1
    with pytest.raises(SupersededError):
        zombie.members()
    with pytest.raises(SupersededError):
        zombie.heartbeat.beat()
    assert len(ended) == 1  # told once
    assert newer.members() == [A1]
    newer.leave()


def test_a_process_whose_run_was_started_over_is_superseded():
    """``launch --fresh`` deletes the run and a new process claims number 0 again: the old
    one's claim is gone, or holds another nonce; either way it stops."""
    store, ended = Store("memory://started-over"), []
    old = Membership(store, RUN, "a", POLICY, on_superseded=ended.append)
    old.heartbeat.stop(leave=False)
    store.delete_prefix(RUN.run)
    with pytest.raises(SupersededError, match="is gone"):
        old.heartbeat.beat()
    store2, ended2 = Store("memory://started-over-again"), []
    old = Membership(store2, RUN, "a", POLICY, on_superseded=ended2.append)
    old.heartbeat.stop(leave=False)
    store2.delete_prefix(RUN.run)
    again = Membership(store2, RUN, "a", POLICY)
    assert again.me == old.me  # the same number, another process
    with pytest.raises(SupersededError, match="another process claimed"):
        old.heartbeat.beat()
    assert len(ended2) == 1
    assert again.members() == [A0]


def test_a_superseded_collective_refuses_every_round_and_the_newer_one_goes_on():
    store, ended = Store("memory://zombie-collective"), threading.Event()
    config = CollectiveConfig(round=RoundPolicy(grace=3600.0, timeout=60.0),
                              lease=LeasePolicy(period=0.05))  # fmt: skip
    zombie = BucketCollective(store, "run", "a", config, on_superseded=lambda _: ended.set())
    with BucketCollective(store, "run", "a", config) as newer:
        assert ended.wait(timeout=60)  # a bound, not a timing assumption
        with pytest.raises(SupersededError):
            zombie.allreduce(torch.ones(2), round_=0)
        work = newer.allreduce(torch.ones(2), round_=0)
        work.wait()
        assert work.result().seal.contributors == ("a-1",)
    zombie.close()


# -- readers of bucket objects ---------------------------------------------------------------


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
    store, member = Store(f"memory://bad-lease-{fragment}"), Participant("r", 0)
    lease = Lease.model_construct(replica="r", incarnation=0, beat=0, finished={fragment: 3})
    store.put(RUN.claim("r", 0), b"")
    store.put(RUN.lease("r", 0, 0), encode_record(lease))
    with caplog.at_level("WARNING"):
        view = MembershipView.read(store, RUN)
        assert member_progress(store, RUN, view, [member]) == {member.name: {}}
    assert "unreadable lease" in caplog.text


ZOMBIE_RUN = """
[run]
name = "z"
store = "store"
replicas = 1
[diloco]
sync_every = 5
outer_steps = 100000
[sync]
lease_period = 0.5
[task]
device = "cpu"
[task.options]
preset = "tiny"
batch_size = 2
corpus_bytes = 100000
"""


@pytest.mark.integration
def test_a_replica_process_superseded_by_a_newer_incarnation_ends_itself(tmp_path):
    """A platform restarted ``local-0`` while the first process still ran: the first sees the
    newer claim at its next beat, records why and exits 3 (not a failure to retry), on its
    own, while it trains."""
    # here, not at the top: the processes the claim race spawns import this module
    from diloco_anywhere.contract import EXIT_SUPERSEDED

    (tmp_path / "run.toml").write_text(ZOMBIE_RUN)
    layout, store = RunLayout("z"), Store(str(tmp_path / "store"))
    process = subprocess.Popen(
        [sys.executable, "-m", "diloco_anywhere.replica", "--config", "run.toml",
         "--replica-id", "local-0"],
        cwd=tmp_path, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not MetricsReader(store, layout).read().get("local-0", None) or not any(
            line.event == "started"
            for line in MetricsReader(store, layout).read()["local-0"].events
        ):
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        restarted = claim_incarnation(store, layout, "local-0")  # the platform's new process
        code = process.wait(timeout=120)
        stderr = process.stderr.read()
    finally:
        process.kill()
    assert code == EXIT_SUPERSEDED, stderr
    assert f"incarnation local-0-{restarted.incarnation} claimed replica local-0" in stderr
    events = MetricsReader(store, layout).read()["local-0"].events_by_incarnation[0]
    assert events[-1].event == "superseded"

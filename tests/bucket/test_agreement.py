"""The records every replica must start with are decided by the replicas' votes
(bucket/agreement.py): the replica unlike the others is the one refused, whichever came first."""

from __future__ import annotations

import threading

import pytest

from diloco_anywhere.bucket.agreement import (
    INDEX_DIGITS,
    Electorate,
    Vote,
    agree,
    decision,
    read_votes,
    votes_prefix,
)
from diloco_anywhere.bucket.format.record import Record, encode_record
from diloco_anywhere.bucket.store import Store


class Plan(Record):
    width: int


def _electorate(index: int, replicas: int = 3, least: int = 1, **kwargs) -> Electorate:
    settings = {"grace": 10.0, "timeout": 600.0, "poll": 0.01, **kwargs}
    return Electorate(index, f"local-{index}", replicas, least, **settings)


def _votes(*data: bytes) -> list[Vote]:
    return [Vote(index, f"local-{index}", each, each) for index, each in enumerate(data) if each]


@pytest.mark.parametrize(
    ("votes", "waited", "decided"),
    [
        (_votes(b"wide"), 0.0, None),  # one of three, grace not over: others may outvote it
        (_votes(b"wide"), 10.0, b"wide"),  # grace over, min_replicas (1) in: as a round seals
        (_votes(b"wide", b"", b""), 599.0, b"wide"),
        (_votes(b"wide", b"narrow", b"narrow"), 0.0, b"narrow"),  # the majority, at once
        (_votes(b"", b"narrow", b"narrow"), 0.0, b"narrow"),  # 2 of 3 cannot be outvoted
        (_votes(b"wide", b"narrow"), 0.0, None),  # 1 to 1 while the third may come
        (_votes(b"wide", b"narrow"), 10.0, None),  # split evenly: wait for the third
        (_votes(b"wide", b"narrow"), 600.0, b"wide"),  # at the timeout a tie goes to the lowest
        (_votes(b"narrow", b"wide", b"other"), 0.0, b"narrow"),  # everyone voted: a tie again
        ([], 1e9, None),
    ],
)
def test_the_votes_decide_as_a_first_round_seals(votes, waited, decided):
    assert decision(votes, _electorate(0), waited) == decided


def test_without_min_replicas_in_only_the_timeout_decides():
    """A replica that came first waits for ``min_replicas`` votes as its first round would,
    however long: the others may be on a platform that starts in minutes."""
    electorate = _electorate(0, replicas=3, least=2)
    assert decision(_votes(b"wide"), electorate, 10.0) is None
    assert decision(_votes(b"wide"), electorate, 300.0) is None
    assert decision(_votes(b"wide"), electorate, 600.0) == b"wide"


def test_a_replica_first_by_minutes_with_another_model_is_outvoted_by_the_late_ones(tmp_path):
    """Of three replicas (min_replicas = 2) the wider one started alone minutes before the
    others (a local one, the others on a platform that starts slowly): it waited for them,
    and their model is the run's, for it too."""
    store, key = Store(str(tmp_path)), "run/initial-state"
    now = [0.0]
    minutes = {"clock": lambda: now[0], "sleep": lambda _: None, "since": 0.0}
    early = _electorate(2, least=2, **minutes)
    store.overwrite(f"{votes_prefix(key)}/000002-local-2", encode_record(Plan(width=16)))
    now[0] = 240.0  # four minutes alone: no decision
    assert decision(read_votes(store, key, Plan), early, now[0]) is None
    store.overwrite(f"{votes_prefix(key)}/000001-local-1", encode_record(Plan(width=8)))
    assert agree(store, key, Plan(width=8), _electorate(0, least=2)).record.width == 8  # 2 of 3
    late = agree(store, key, Plan(width=16), early)
    assert late.record.width == 8
    assert late.holders == ("local-0", "local-1")


def test_the_replica_that_starts_first_with_another_model_is_outvoted(tmp_path):
    """The issue's case: of three replicas, the one with a wider model votes first and waits
    (grace not over); the two alike vote while it waits and their model is the run's, for it
    too."""
    store, key = Store(str(tmp_path)), "run/initial-state"
    results: dict[int, object] = {}

    def vote(index: int, width: int) -> None:
        results[index] = agree(store, key, Plan(width=width), _electorate(index, grace=30.0))

    first = threading.Thread(target=vote, args=(2, 16))
    first.start()
    while not store.list_prefix(votes_prefix(key)):
        first.join(0.01)
    later = [threading.Thread(target=vote, args=(index, 8)) for index in (0, 1)]
    for thread in later:
        thread.start()
    for thread in (first, *later):
        thread.join(30)
        assert not thread.is_alive()
    assert {index: result.record.width for index, result in results.items()} == {
        0: 8, 1: 8, 2: 8
    }  # fmt: skip
    assert results[2].holders == ("local-0", "local-1")
    assert results[2].named() == "held by local-0, local-1"


def test_a_replica_after_the_decision_takes_it_at_once_and_its_vote_names_it(tmp_path):
    store, key = Store(str(tmp_path)), "run/plan"
    agree(store, key, Plan(width=8), _electorate(0, replicas=2, grace=0.0))  # alone: allowed
    never = _electorate(3, replicas=4, grace=1e9, timeout=1e9)  # would wait for ever
    assert agree(store, key, Plan(width=16), never).record == Plan(width=8)  # without waiting
    assert agree(store, key, Plan(width=8), never).holders == ("local-0", "local-3")
    assert [vote.index for vote in read_votes(store, key, Plan)] == [0, 3]


def test_a_vote_that_is_not_a_record_is_left_out_and_said(tmp_path, caplog):
    store, key = Store(str(tmp_path)), "run/plan"
    store.put(f"{votes_prefix(key)}/000001-local-1", b"not a record")
    result = agree(store, key, Plan(width=8), _electorate(0, replicas=2, grace=0.0))
    assert result.record == Plan(width=8)
    assert result.holders == ("local-0",)
    assert "a vote left out" in caplog.text
    assert "000001-local-1" in caplog.text


def test_a_replica_waiting_on_the_votes_says_in_its_log_what_it_waits_for(tmp_path, caplog):
    """Every SAY_EVERY seconds of waiting: how many voted, split how, and how long at most;
    at the timeout the votes there are decide."""
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    clock = {"clock": lambda: now[0], "sleep": sleep, "since": 0.0, "poll": 10.0}
    store = Store(str(tmp_path))
    store.overwrite(
        f"{votes_prefix('run/plan')}/{1:0{INDEX_DIGITS}d}-local-1", encode_record(Plan(width=2))
    )  # another replica's vote, still waiting
    caplog.set_level("INFO", logger="diloco_anywhere.bucket.agreement")
    wide = _electorate(0, least=3, timeout=100.0, **clock)
    assert agree(store, "run/plan", Plan(width=4), wide).record == Plan(width=4)  # the lowest
    said = [r.getMessage() for r in caplog.records if "replicas voted" in r.getMessage()]
    assert said[0] == ("run/plan: 2 of the run's 3 replicas voted, split 2 ways (min_replicas = "
                       "3); waiting for more, 70 s at most ([sync] timeout)")  # fmt: skip

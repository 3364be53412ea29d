"""Replicas that left for good are known to the others through the bucket: a round that can
no longer reach min_replicas fails at once naming who stopped and why, instead of waiting out
its timeout (collective/members/departures.py, Round's ``hopeless``)."""

from __future__ import annotations

import time

import pytest
import torch

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.errors import RoundHopelessError, RoundTimeoutError
from diloco_anywhere.collective.members.departures import hopeless, newest_departures
from diloco_anywhere.collective.members.membership import claim_incarnation, depart_for, departed
from diloco_anywhere.collective.policy import CollectiveConfig, LeasePolicy, RoundPolicy

REFUSED = "failed: ModelUnlikeRunError: this replica's model is unlike the run's"


def _config(replicas: int = 3, least: int = 2, timeout: float = 120.0) -> CollectiveConfig:
    return CollectiveConfig(
        round=RoundPolicy(min_replicas=least, expected_replicas=replicas, timeout=timeout),
        lease=LeasePolicy(period=0.2, misses=50),
    )


def test_a_round_that_cannot_reach_min_replicas_fails_at_once_naming_who_left_and_why():
    store, config = Store("memory://departures-hopeless"), _config()
    for name in ("local-1", "local-2"):  # both refused for a mistake: they will not come back
        BucketCollective(store, "run", name, config).close(reason=REFUSED, final=True)
    survivor = BucketCollective(store, "run", "local-0", config)
    started = time.monotonic()
    with pytest.raises(RoundHopelessError) as error:
        survivor.allreduce(torch.ones(4), round_=0).result()
    survivor.close(wait=False)
    assert time.monotonic() - started < 30  # a lease period or two, not the 120 s timeout
    assert str(error.value) == (
        "round 0 fragment 0 cannot seal: min_replicas = 2, and 2 of the run's 3 replicas "
        f"stopped for good (local-1: {REFUSED}; local-2: {REFUSED}); fix each, then `diloco "
        "replace` it, or lower run.min_replicas"
    )


def test_replicas_that_may_come_back_keep_the_round_waiting():
    """Left without a mistake (a crash a restart may fix), or replaced by a newer incarnation
    since: not final. The round waits for them until its timeout, as before."""
    store, config = Store("memory://departures-not-final"), _config(timeout=2.0)
    BucketCollective(store, "run", "local-1", config).close(reason="failed: OSError", final=False)
    BucketCollective(store, "run", "local-2", config).close(reason=REFUSED, final=True)
    claim_incarnation(store, RunLayout("run"), "local-2")  # `diloco replace local-2`
    departed = newest_departures(store, RunLayout("run"), {"local-1": 0, "local-2": 1})
    assert {r: (d.reason, d.final) for r, d in departed.items()} == {
        "local-1": ("failed: OSError", False)
    }
    assert hopeless(departed, 3, 2) is None
    survivor = BucketCollective(store, "run", "local-0", config)
    with pytest.raises(RoundTimeoutError) as error:
        survivor.allreduce(torch.ones(4), round_=0).result()
    survivor.close(wait=False)
    said = str(error.value)
    assert "missing local-1 (left: failed: OSError); 1 of the run's 3 replicas never joined" in said
    assert "start the missing replicas" in said


def test_a_replica_that_never_joined_and_was_given_up_on_counts_as_gone_until_it_joins():
    """An image without the project fails before ``join``: nothing of it is in the bucket, so
    the keeper that gives up on it says it left for good (``depart_for``), and the others'
    rounds know at once; a later incarnation (``diloco replace``, fixed) is not concerned."""
    store, layout, config = Store("memory://departures-never"), RunLayout("run"), _config()
    depart_for(store, layout, "hf_jobs-0", "the keeper gave up on it: failed at its start")
    depart_for(store, layout, "k8s-0", "the keeper gave up on it: failed at its start")
    assert {r: d.incarnation for r, d in departed(store, layout).items()} == {
        "hf_jobs-0": None, "k8s-0": None
    }  # fmt: skip
    survivor = BucketCollective(store, "run", "local-0", config)
    with pytest.raises(RoundHopelessError, match="hf_jobs-0: the keeper gave up on it"):
        survivor.allreduce(torch.ones(4), round_=0).result()
    survivor.close(wait=False)
    claim_incarnation(store, layout, "k8s-0")  # replaced, fixed: it comes back
    assert set(departed(store, layout)) == {"hf_jobs-0"}


def test_a_replica_given_up_on_after_joining_is_gone_as_its_newest_incarnation():
    store, layout = Store("memory://departures-given-up"), RunLayout("run")
    BucketCollective(store, "run", "local-1", _config()).close(reason="failed: OOM", final=False)
    depart_for(store, layout, "local-1", "the keeper gave up on it: out of restarts")
    gone = departed(store, layout)["local-1"]
    assert (gone.incarnation, gone.final) == (0, True)
    assert gone.reason == "the keeper gave up on it: out of restarts"


def test_enough_replicas_left_seal_rounds_without_the_one_that_stopped():
    store, config = Store("memory://departures-enough"), _config(replicas=3, least=2)
    BucketCollective(store, "run", "local-2", config).close(reason=REFUSED, final=True)
    left = [BucketCollective(store, "run", f"local-{k}", config) for k in (0, 1)]
    works = [collective.allreduce(torch.full((4,), float(k)), round_=0)
             for k, collective in enumerate(left)]  # fmt: skip
    assert {work.result().seal.contributors for work in works} == {("local-0-0", "local-1-0")}
    for collective in left:
        collective.close()

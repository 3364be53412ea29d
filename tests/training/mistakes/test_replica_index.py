"""One running replica per data shard index (``training/mistakes/replica_index.py``): ids from
launchers that do not know of each other (``local-1`` and ``extra-1`` both default to index 1) are
refused, naming both, while restarts, replicas that left and replicas that died keep working."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.members.membership import LeasePolicy, run_hopeless
from diloco_anywhere.collective.policy import CollectiveConfig
from diloco_anywhere.config import parse_config
from diloco_anywhere.contract import EXIT_BAD_CONFIG
from diloco_anywhere.launching.start.launch import run_metrics
from diloco_anywhere.training.mistakes.replica_index import DuplicateIndexError, take_index
from diloco_anywhere.training.replica import Replica

RUN = "indexed"
REPLICAS = 4
QUICK = CollectiveConfig(lease=LeasePolicy(period=0.2))  # expiry 0.6 s


@pytest.fixture
def join(tmp_path):
    """``join(id)``: a collective of ``id`` in the run (closed after the test)."""
    store, opened = Store(str(tmp_path / "store")), []

    def joined(replica: str, config: CollectiveConfig | None = None) -> BucketCollective:
        opened.append(BucketCollective(store, RUN, replica, config))
        return opened[-1]

    yield joined
    for collective in opened:
        collective.close(wait=False)


def test_a_replica_given_a_running_replicas_index_is_refused_naming_both(join) -> None:
    take_index(join("local-1"), 1, REPLICAS)
    with pytest.raises(DuplicateIndexError) as refused:
        take_index(join("extra-1"), 1, REPLICAS)
    said = str(refused.value)
    assert "replica index 1 is local-1's, which is running (incarnation local-1-0)" in said
    assert "extra-1 was given it too" in said
    assert "0..3: --replica-index or $DILOCO_REPLICA_INDEX" in said
    take_index(join("extra-2"), 2, REPLICAS)  # another index: no one else holds it


def test_of_two_replicas_taking_one_index_together_exactly_one_is_refused(join) -> None:
    """Both record the index before either lists: the later record is refused, the earlier
    goes on, whichever lists first."""
    first, second = join("b-1"), join("a-1")  # the earlier record is the greater name's
    first.store.put(first.layout.replica_index(1, first.me), first.me.name.encode())
    with pytest.raises(DuplicateIndexError, match="replica index 1 is b-1's"):
        take_index(second, 1, REPLICAS)
    take_index(first, 1, REPLICAS)  # its record stands; a-1's is the later one


def test_a_replica_restarted_beside_the_one_that_took_its_index_is_refused(join) -> None:
    """b-1 held index 1 and left; a-1 took it meanwhile: b-1's restart is the later record."""
    holder = join("b-1")
    take_index(holder, 1, REPLICAS)
    holder.close()
    take_index(join("a-1"), 1, REPLICAS)
    with pytest.raises(DuplicateIndexError, match="replica index 1 is a-1's"):
        take_index(join("b-1"), 1, REPLICAS)


def test_the_same_id_restarted_keeps_its_index(join) -> None:
    take_index(join("local-1"), 1, REPLICAS)
    take_index(join("local-1"), 1, REPLICAS)  # a new incarnation supersedes the old one


def test_an_index_whose_holder_left_is_free(join) -> None:
    holder = join("local-1")
    take_index(holder, 1, REPLICAS)
    holder.close()  # deletes its leases: nobody waits for it
    take_index(join("extra-1"), 1, REPLICAS)


def test_an_index_whose_holder_died_is_free_once_its_lease_expired(join) -> None:
    """A SIGKILLed replica leaves its last lease behind: older than the expiry (store times
    alike), it holds nothing."""
    holder = join("local-1", QUICK)
    take_index(holder, 1, REPLICAS)
    holder.membership.heartbeat.stop(leave=False)
    time.sleep(3 * QUICK.lease.expiry)
    take_index(join("extra-1", QUICK), 1, REPLICAS)


@pytest.mark.integration
def test_a_replica_process_with_a_running_replicas_index_exits_2_naming_both(
    join, tmp_path
) -> None:
    """As a user meets it: a replica started by hand next to a launched one, its index taken
    from its id's trailing number; exit 2 is never retried by a platform or the keeper."""
    take_index(join("local-1"), 1, REPLICAS)
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\nname = "{RUN}"\nstore = "store"\nreplicas = {REPLICAS}\n')
    ended = subprocess.run(
        [sys.executable, "-m", "diloco_anywhere.replica", "--config", str(config),
         "--replica-id", "extra-1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ended.returncode == EXIT_BAD_CONFIG, ended.stderr
    assert "replica index 1 is local-1's" in ended.stderr
    assert "extra-1 was given it too" in ended.stderr


def test_a_duplicate_is_refused_before_it_votes_and_the_run_it_leaves_is_hopeless(
    join, tmp_path
) -> None:
    """local-1 runs; extra-1, given its index in a run that needs both of its 2 replicas, is
    refused as it joins: before it votes on what the run starts with (a vote that would wait
    for the other replica up to the sync timeout), saying why in its metrics and leaving for
    good, so that the run's rounds, which can never reach min_replicas now, fail at once."""
    take_index(join("local-1"), 1, 2)
    config = parse_config(
        f'[run]\nname = "{RUN}"\nstore = "{tmp_path / "store"}"\nreplicas = 2\n'
        "min_replicas = 2\n[sync]\ntimeout = 120.0\n",
        "run.toml",
    )
    with pytest.raises(SystemExit) as refused:  # a mistake's exit code: never retried
        Replica(config, "extra-1", 1)
    assert refused.value.code == EXIT_BAD_CONFIG
    assert isinstance(refused.value.__cause__, DuplicateIndexError)
    store, layout = Store(str(tmp_path / "store")), RunLayout(RUN)
    assert [key for key in store.list_prefix(RUN) if "votes" in key] == []  # it never voted
    (failed,) = [e for e in run_metrics(config).read()["extra-1"].events if e.event == "failed"]
    assert failed.detail.startswith("DuplicateIndexError: replica index 1 is local-1's")
    hopeless = run_hopeless(store, layout, replicas=2, least=2)
    assert hopeless is not None
    assert "1 of the run's 2 replicas stopped for good (extra-1: failed: Duplicate" in hopeless

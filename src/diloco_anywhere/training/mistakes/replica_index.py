"""One running replica per data shard index: a replica that joins with an index another running
replica holds is refused, naming both ids.

The index is what a ``[task] command`` script or a Trainer shards its own data by
(``TaskContext.replica_index``), and what the run's claimed data prefers
(``data/claims.py``). Ids come from launchers that do not know of each other (two ``diloco
launch`` of one run from two workflows, a replica started by hand, an Indexed Job's base), and
the index defaults to the id's trailing number, so ``local-1`` and ``extra-1`` both get 1.

Once it has claimed its incarnation and written its first lease, each replica's leader records
``{run}/indices/{index}/{replica}-{incarnation}`` (create-only), then lists who else took its
index. Another id's incarnation holds it while that incarnation is its id's newest and its
newest lease is younger than the lease expiry when our record was written; every time is the
store's own (no machine's clock is compared with another's, as in ``membership.py``). Of two
holders the later record leaves (the same second: the greater name), so a replica restarted
beside one that took its index meanwhile is the one refused, and of two that start together
exactly one is: the later lister sees both records.
"""

from __future__ import annotations

from diloco_anywhere.bucket.format.layout import Participant, parse_contributor
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.members.membership import MembershipView
from diloco_anywhere.config import ConfigError


class DuplicateIndexError(ConfigError):
    """Another running replica holds this replica's data shard index: a restart would meet it
    again (exit 2, never retried)."""


def take_index(collective: BucketCollective, index: int, replicas: int) -> None:
    """Record that this replica holds ``index``; ``DuplicateIndexError`` naming the running
    replica that took it first, if there is one."""
    store, layout, me = collective.store, collective.layout, collective.me
    mine = layout.replica_index(index, me)
    store.put(mine, me.name.encode())
    taken_at = store.modified(mine)
    view, expiry = collective.membership.view(), collective.config.lease.expiry
    for holder in _holders(collective, view, index):
        key = layout.replica_index(index, holder)
        try:
            first = (store.modified(key), holder.name) < (taken_at, me.name)
            running = taken_at - _alive_at(collective, view, holder) < expiry
        except FileNotFoundError:  # it left meanwhile
            continue
        if first and running:
            raise DuplicateIndexError(_refusal(me.replica, holder, index, replicas))


def _holders(collective: BucketCollective, view: MembershipView, index: int) -> list[Participant]:
    """The newest incarnations of the other replica ids that took ``index``."""
    folder, newest = f"{collective.layout.replica_indices(index)}/", view.newest()
    holders = []
    for key in collective.store.list_prefix(folder.rstrip("/")):
        try:
            replica, incarnation = parse_contributor(key.removeprefix(folder))
        except ValueError:
            continue  # not a record of ours
        if replica != collective.me.replica and newest.get(replica) == incarnation:
            holders.append(Participant(replica, incarnation))
    return holders


def _alive_at(collective: BucketCollective, view: MembershipView, member: Participant) -> float:
    """When the store took ``member``'s newest lease (``FileNotFoundError`` without one)."""
    beat = view.beats.get(member)
    if beat is None:
        raise FileNotFoundError(member.name)
    lease = collective.layout.lease(member.replica, member.incarnation, beat)
    return collective.store.modified(lease)


def _refusal(me: str, holder: Participant, index: int, replicas: int) -> str:
    return (
        f"replica index {index} is {holder.replica}'s, which is running (incarnation "
        f"{holder.name}), and {me} was given it too: two replicas of one index would shard "
        f"their data alike. Give {me} an index no running replica holds (0..{replicas - 1}: "
        f"--replica-index or $DILOCO_REPLICA_INDEX, or launch every replica of the run from "
        f"one `diloco launch`), or stop {holder.replica} first"
    )

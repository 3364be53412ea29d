"""The units of the run's data a replica trains, claimed in the bucket (``data/claims.py``).

The replica's leader (its only process, or rank 0 of a ``torchrun`` replica) records or checks
the run's data plan, then claims each round's units for all its processes and hands each
process its own (the same number each: every rank trains the round's steps): the other ranks
hold no store of their own, and one replica's processes must never race each other for units.
"""

from __future__ import annotations

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.config import RunConfig
from diloco_anywhere.data.claims import Claims, DataPlan, agree_on_plan
from diloco_anywhere.data.source import Assigner
from diloco_anywhere.data.stream import UnitsOf
from diloco_anywhere.training.mistakes import stop_if_hopeless
from diloco_anywhere.training.ranks.replica_group import ReplicaGroup


def claimed_units(
    config: RunConfig, index: int, group: ReplicaGroup, collective: BucketCollective | None
) -> Assigner:
    """``index``: the replica's data shard, whose share of each round it claims first
    (``Claims._candidates``): the units a round has at the reference pace (``round_steps``)."""
    diloco, ranks = config.diloco, group.world_size
    share_units = ranks * diloco.round_steps // diloco.step_quantum

    def assign(plan: DataPlan) -> UnitsOf:
        claims = None
        if group.is_leader:
            if collective is None:
                raise ValueError("a replica's leader claims its data through its collective")
            layout = RunLayout(config.run.name)
            check = stop_if_hopeless(collective.hopeless, "agreeing on the run's data plan")
            electorate = config.electorate(index, collective.me.replica, collective.joined, check)
            agree_on_plan(collective.store, layout, plan, electorate)
            claims = Claims(
                collective.store, layout, collective.me.name, config.run.min_replicas,
                index=index, replicas=config.run.replicas, share_units=share_units,
            )  # fmt: skip

        def units_of(round_: int, count: int) -> list[int]:
            units = claims.units(round_, ranks * count) if claims is not None else None
            return group.broadcast(units)[group.rank :: ranks]

        return units_of

    return assign

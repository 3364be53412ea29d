"""A sharded replica: FSDP2 inside it, and every rank syncing its own shard through the bucket.

With ``[run] sharding = "fsdp"`` and ``processes_per_replica = N``, each replica wraps its model
with FSDP2 (``fully_shard``): the parameters become DTensors and rank r holds shard r of every
one of them, and of the global weights and outer momentum DiLoCo keeps. torchft's DiLoCo
already works on the local shards (``local_sgd.py``: ``extract_local_tensor``,
``DTensor.from_local``), so each rank's pseudo-gradient is its own shard, 1/N of the model.

Rank r of every replica exchanges its shard in a round namespace of its own (``RunLayout``
``rank``: ``{run}/ranks/{r}/``), with a collective, membership and lease of its own, in
parallel with the other ranks: the bytes through any one host fall by N. The mean of shard r is
over the replicas whose rank r is in that rank's SEAL; every replica reads the same SEALs, so
every replica applies the same means.

A replica commits a sync only if every one of its ranks' rounds committed; the ranks decide
together (``managers/sharded.py``). Replicas whose rank counts differ cannot exchange shard by
shard: the first replica records the run's sharding in the bucket and a replica unlike it is
refused.
"""

from __future__ import annotations

import logging
from typing import Literal

from torch import nn

from diloco_anywhere.bucket.agreement import Electorate, agree
from diloco_anywhere.bucket.format.framing import Count
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import Record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import ConfigError
from diloco_anywhere.training.ranks.replica_group import ReplicaGroup

log = logging.getLogger(__name__)


class ShardingMismatchError(ConfigError):
    """This replica cannot exchange with the run's: another sharding or rank count (a
    configuration error: restarting it would only fail again)."""


class Sharding(Record):
    """How a run's replicas hold the model: what every replica must match."""

    sharding: Literal["ddp", "fsdp"]
    ranks: Count  # the parts one replica exchanges: its processes with fsdp, else 1

    def describe(self) -> str:
        if self.sharding == "ddp":
            return "unsharded (ddp: rank 0 exchanges the whole model)"
        return f"sharded over {self.ranks} rank(s) (fsdp)"


def check_sharding(store: Store, layout: RunLayout, mine: Sharding, electorate: Electorate) -> None:
    """Vote for ``mine`` as the run's sharding (``bucket/agreement.py``), and refuse this
    replica if the run's is another, saying what to change."""
    key = layout.sharding()
    agreed = agree(store, key, mine, electorate)
    if agreed.record != mine:
        raise ShardingMismatchError(
            f"this replica is {mine.describe()}; the run's replicas are "
            f"{agreed.record.describe()} ({key}, {agreed.named()}). Every replica of a run "
            f"needs the same [run] sharding and, with fsdp, the same processes_per_replica on "
            f"every backend (a new run name starts over)"
        )


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards as units of their own, before the model itself: the members of
    every outermost stack of blocks (an ``nn.ModuleList`` or ``nn.Sequential`` of two or more
    modules of one class, holding parameters: a transformer's layers). Each unit's parameters
    are gathered only while it runs, so a forward never holds the whole model unsharded; a
    stack inside a unit (experts in a block) stays in its unit."""
    units: list[nn.Module] = []
    inside: set[int] = set()  # ids of the modules within a unit already chosen
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        members = list(module.children())
        uniform = len(members) >= 2 and len({type(member) for member in members}) == 1
        if uniform and next(module.parameters(), None) is not None:
            units += members
            inside |= {id(sub) for member in members for sub in member.modules()}
    return units


def shard_model(model: nn.Module, group: ReplicaGroup) -> nn.Module:
    """Wrap ``model`` with FSDP2 over the replica's ranks, in place: each of ``shard_units``,
    then the model itself (embeddings, head). Build the inner optimizer after this: the
    parameters are DTensors from here on (torch.distributed.fsdp.fully_shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (group.world_size,))
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def check_sharded(model: nn.Module, group: ReplicaGroup) -> None:
    """Refuse to train a model whose sharding is not the run's, either way, before its first
    step: a sharded replica's model not sharded (every rank would exchange the whole model in
    its own namespace, and the ranks drift apart), or a replica of several processes declared
    unsharded whose model is (a trainer that applies FSDP2 itself, torchtitan's: rank 0 would
    exchange only its own shard as the whole model, and the others take rank 0's shard as
    theirs). A configuration error: a restart would meet it again."""
    from torch.distributed.tensor import DTensor

    if group.world_size == 1:
        return
    parameters = list(model.named_parameters())
    if group.sharded:
        plain = [name for name, p in parameters if not isinstance(p, DTensor)]
        if plain:
            raise ShardingMismatchError(
                f"run.sharding = 'fsdp', but parameter {plain[0]} is not sharded: pass the "
                f"model through replica.parallelize(model) before building the inner optimizer"
            )
        return
    # a rank holding part of a parameter (a replicated DTensor, HSDP's over one shard, is whole)
    sharded = [
        n for n, p in parameters if isinstance(p, DTensor) and p.to_local().numel() < p.numel()
    ]
    if sharded:
        raise ShardingMismatchError(
            f"run.sharding = 'ddp', but parameter {sharded[0]} is sharded over the replica's "
            f"{group.world_size} processes (FSDP or tensor parallelism): set [run] sharding = "
            f'"fsdp" in run.toml, so that every rank syncs its own shard'
        )


def reshard(model: nn.Module) -> None:
    """Back to the shards after a forward without backward (the held-out evaluation): FSDP2
    keeps the root's parameters gathered after its forward until a backward reshards them,
    and DiLoCo, checkpoints and healing read the parameters as DTensors."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()

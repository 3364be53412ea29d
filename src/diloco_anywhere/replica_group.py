"""One replica, several processes (``torchrun``): only rank 0 talks to the bucket.

A replica with several GPUs runs one process per GPU under ``torchrun``, with DDP inside the
replica for the inner steps (gradients all-reduced over NCCL, or gloo on CPU). Their global
state is one: DiLoCo's pseudo-gradients are equal on every rank, so rank 0 (the leader) alone
claims the replica's membership, runs the bucket rounds, writes metrics and checkpoints and
heals; the other ranks get each round's result, and after a heal the whole global state, from
the leader over a process group of the replica's own. Nothing a rank receives comes from a
bucket: objects broadcast here are this replica's own, between its own processes.

The sync traffic uses a second gloo group, so a round finishing on a background thread never
interleaves with DDP's all-reduces on the training thread.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from diloco_anywhere.collective.allreduce import (
    BucketCollective,
    CollectiveConfig,
    RoundResult,
    Work,
)
from diloco_anywhere.layout import Participant


@dataclass(frozen=True)
class TensorSpec:
    """A tensor leaf as the other ranks allocate it before receiving it."""

    shape: torch.Size
    dtype: torch.dtype


@dataclass(frozen=True)
class ReplicaGroup:
    """This process's place in its replica: rank 0 of 1 unless started by ``torchrun``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sync_group: Any = None  # the gloo group for results and state (None alone)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls, device_type: str) -> ReplicaGroup:
        """Join the replica's process group when ``torchrun`` set ``WORLD_SIZE`` > 1."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls()
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        return cls(
            rank=dist.get_rank(),
            world_size=world_size,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            sync_group=dist.new_group(backend="gloo"),
        )

    def broadcast(self, value: Any) -> Any:
        """The leader's ``value`` on every rank (a small object of this replica's own)."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.sync_group)
        return box[0]

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The leader's CPU ``tensor`` into ``tensor`` on every rank."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=0, group=self.sync_group)
        return tensor

    def share_state(self, tree: dict[str, Any]) -> dict[str, Any]:
        """The leader's global state tree (structure, then tensors) on every rank."""
        if self.world_size == 1:
            return tree
        leaves, spec = pytree.tree_flatten(tree)
        described = [
            TensorSpec(leaf.shape, leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf
            for leaf in leaves
        ]
        spec, described = self.broadcast((spec, described))
        received = []
        for index, leaf in enumerate(described):
            if isinstance(leaf, TensorSpec):
                mine = leaves[index] if self.is_leader else None
                buffer = (
                    mine.detach().cpu().contiguous()
                    if mine is not None
                    else torch.empty(leaf.shape, dtype=leaf.dtype)
                )
                leaf = self.broadcast_tensor(buffer)
            received.append(leaf)
        return pytree.tree_unflatten(received, spec)

    def check_same_state(self, checksum: int) -> None:
        """Raise on any rank whose global state differs from the leader's."""
        leader = self.broadcast(checksum)
        if checksum != leader:
            raise RuntimeError(
                f"rank {self.rank} of this replica holds another global state than rank 0 "
                f"({checksum:08x} vs {leader:08x})"
            )


class LeaderCollective:
    """Rank 0's collective: the bucket's, and every round's outcome sent on to the others."""

    def __init__(self, bucket: BucketCollective, group: ReplicaGroup) -> None:
        self.bucket, self.group = bucket, group
        self.me, self.config, self.store = bucket.me, bucket.config, bucket.store
        self.layout = bucket.layout
        group.broadcast(bucket.me)

    def allreduce(self, tensor: torch.Tensor | list[torch.Tensor], **kwargs: Any) -> Work:
        work = self.bucket.allreduce(tensor, **kwargs)
        shared: Future[RoundResult] = Future()

        def share(done: Work) -> None:  # on the round's thread, in round order
            try:
                result = done.result()
            except Exception as exc:
                self.group.broadcast(exc)
                shared.set_exception(exc)
                return
            self.group.broadcast((result.seal, result.fingerprint, result.mean.numel()))
            self.group.broadcast_tensor(result.mean)
            shared.set_result(result)

        work.add_done_callback(share)
        return Work(shared, work.shape)

    def observe(self, round_: int, fragment: int = 0) -> RoundResult | None:
        return self.bucket.observe(round_, fragment)

    def close(self, wait: bool = True) -> None:
        self.bucket.close(wait)


class FollowerCollective:
    """Another rank's collective: each round's outcome as rank 0 got it from the bucket."""

    def __init__(self, config: CollectiveConfig, group: ReplicaGroup) -> None:
        self.config, self.group = config, group
        self.me: Participant = group.broadcast(None)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="replica-sync")

    def allreduce(self, tensor: torch.Tensor | list[torch.Tensor], **_: Any) -> Work:
        tensors = tensor if isinstance(tensor, list) else [tensor]
        shape = (
            torch.Size([sum(t.numel() for t in tensors)])
            if isinstance(tensor, list)
            else tensor.shape
        )
        return Work(self._executor.submit(self._receive), shape)

    def _receive(self) -> RoundResult:
        outcome = self.group.broadcast(None)
        if isinstance(outcome, Exception):
            raise outcome
        seal, fingerprint, numel = outcome
        mean = self.group.broadcast_tensor(torch.empty(numel))
        return RoundResult(mean, seal, fingerprint)

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=not wait)


SyncCollective = BucketCollective | LeaderCollective | FollowerCollective

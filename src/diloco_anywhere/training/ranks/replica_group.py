"""One replica, several processes (``torchrun``): with DDP, only rank 0 talks to the bucket.

A replica with several GPUs runs one process per GPU under ``torchrun``, with DDP inside the
replica for the inner steps (gradients all-reduced over NCCL, or gloo on CPU). Their global
state is one: DiLoCo's pseudo-gradients are equal on every rank, so rank 0 (the leader) alone
claims the replica's membership, runs the bucket rounds, writes metrics and checkpoints and
heals; the other ranks get each round's result, and after a heal the whole global state, from
the leader over a process group of the replica's own. Nothing a rank receives comes from a
bucket: objects broadcast here are this replica's own, between its own processes.

Every exchange happens on the training thread at points where all ranks are (``should_commit``,
healing, the end of training), over a second gloo group, apart from DDP's all-reduces. The
other ranks adopt the leader's decision for every sync, never one of their own (a timeout only
they saw would split the replica's global state).

A sharded replica (``sharding = "fsdp"``) uses the same group to agree, but every rank talks to
the bucket for its own shard (``sharding.py``). The managers of each rank are in ``managers/``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree


def _destroy_at_exit() -> None:
    """The process group torn down before the interpreter finalizes (PyTorch's
    ``destroy_process_group``, as its docs ask of every program), unless the script did it
    itself."""
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_rank(code: int) -> None:
    """End this rank of a replica of several processes with ``code``, its work done, without
    the interpreter's finalization. ``destroy_process_group`` does not end a gloo group that
    DDP still references: its worker threads live on into finalization, and one that drops
    its last reference to a finished collective's tensors then needs the GIL the dying
    interpreter no longer grants, and the process aborts ("terminate called without an active
    exception", SIGABRT; pytorch/pytorch#179291). Under load it did, for a follower rank that
    had trained to the end, and torchrun failed the replica. A process of its own (no torchrun)
    exits as usual."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        sys.exit(code)
    _destroy_at_exit()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    sharded: bool = False  # FSDP2 inside the replica: every rank syncs its own shard

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(
        cls, device_type: str, timeout: timedelta, *, sharded: bool = False
    ) -> ReplicaGroup:
        """Join the replica's process group when ``torchrun`` set ``WORLD_SIZE`` > 1 (or
        started a ``sharded`` replica of one process: FSDP2 needs a device mesh even of one).
        ``timeout`` bounds a rank's wait for the others: a round, or a heal, at most. A
        trainer that set up its processes' group itself (torchtitan's) keeps it."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1 and not (sharded and "TORCHELASTIC_RUN_ID" in os.environ):
            return cls(sharded=sharded)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timeout)
            atexit.register(_destroy_at_exit)
        return cls(
            rank=dist.get_rank(),
            world_size=world_size,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            sync_group=dist.new_group(backend="gloo", timeout=timeout),
            sharded=sharded,
        )

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (a small object of this replica's own), in rank order, on
        every rank: what the ranks of a sharded replica decide together from."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.sync_group)
        return values

    def broadcast(self, value: Any) -> Any:
        """The leader's ``value`` on every rank (a small object of this replica's own)."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.sync_group)
        return box[0]

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The leader's ``tensor`` into ``tensor`` on every rank (through a CPU copy where it
        lives elsewhere: the sync group is gloo's)."""
        if self.world_size > 1:
            host = tensor.detach().cpu()
            dist.broadcast(host, src=0, group=self.sync_group)
            if host.data_ptr() != tensor.data_ptr():
                tensor.detach().copy_(host)
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

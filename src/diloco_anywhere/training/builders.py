"""What a replica trains with, built from run.toml: the collective's configuration, the device,
the model's fragments (Streaming DiLoCo), the outer optimizers, the bucket-backed manager and
the module the inner steps run through (DDP or FSDP2 inside a replica).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from os import getpid
from socket import gethostname

import torch
import torch.distributed as dist
from torch import nn
from torchft.local_sgd import DiLoCo

from diloco_anywhere.bucket.feedback import ErrorFeedback
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.config import RunConfig
from diloco_anywhere.data.source import DataSource, DataUse, fixed_units
from diloco_anywhere.task import TaskContext
from diloco_anywhere.training.managers.bucket import BucketManager
from diloco_anywhere.training.managers.group import make_manager
from diloco_anywhere.training.pacing.data_units import claimed_units
from diloco_anywhere.training.pacing.pace import Pacer
from diloco_anywhere.training.ranks.replica_group import ReplicaGroup
from diloco_anywhere.training.ranks.sharding import shard_model
from diloco_anywhere.training.state.global_state import GlobalState
from diloco_anywhere.training.state.parameter_names import stored_names

SINGLE_PROCESS = ReplicaGroup()


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: CUDA when there is a GPU, else CPU; under ``torchrun`` each process of a
    replica takes the GPU of its local rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    return torch.device("cuda", local_rank) if device == torch.device("cuda") else device


class _Fragment(nn.Module):
    """Some of a model's parameters, as the module torchft's DiLoCo takes per fragment."""

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(parameters)


def split_fragments(model: nn.Module, count: int) -> list[nn.Module]:
    """``count`` fragments of consecutive parameters with about equal numbers of elements
    (Streaming DiLoCo syncs one at a time). ``named_parameters`` lists a tied weight once, so
    it belongs to exactly one fragment."""
    if count == 1:
        return [model]
    parameters = list(model.parameters())
    if len(parameters) < count:
        raise ValueError(
            f"{count} fragments, but the model has {len(parameters)} parameters: lower "
            f"diloco.fragments in run.toml"
        )
    cumulative = list(itertools.accumulate(p.numel() for p in parameters))
    edges = [0]
    for k in range(1, count):  # cut where k/count of the elements are behind, >= 1 per fragment
        cut = bisect.bisect_left(cumulative, cumulative[-1] * k / count) + 1
        edges.append(min(max(cut, edges[-1] + 1), len(parameters) - (count - k)))
    edges.append(len(parameters))
    return [_Fragment(parameters[a:b]) for a, b in itertools.pairwise(edges)]


def single_threaded_steps(optimizer: torch.optim.Optimizer) -> None:
    """Run ``optimizer``'s steps with one intra-op thread. On CPU, torch's vectorized and
    scalar loops round differently (fused multiply-add) and the split between them follows
    the thread count, so replicas given different core counts would compute different global
    weights from the same mean; with one thread every replica (and a healing replay, which
    runs this same step) gets the same bits. The outer step is a few element-wise passes per
    sync: its cost is negligible. GPUs are unaffected."""
    threads: list[int] = []

    def one_thread(*_: object) -> None:
        threads.append(torch.get_num_threads())
        torch.set_num_threads(1)

    def restore(*_: object) -> None:
        torch.set_num_threads(threads.pop())

    optimizer.register_step_pre_hook(one_thread)
    optimizer.register_step_post_hook(restore)


@dataclass
class ReplicaParts:
    """What one replica trains with: the bucket-backed manager, the model and its fragments,
    the inner optimizer, one outer optimizer per fragment (from run.toml), the tokens each
    inner step trains on (they weigh the replica's contribution) and the held-out evaluation."""

    config: RunConfig
    manager: BucketManager
    model: nn.Module  # the script's: its buffers and local weights are the replica's own
    fragments: list[nn.Module]
    inner: torch.optim.Optimizer
    outers: list[torch.optim.Optimizer]
    tokens_per_step: int
    evaluate: Callable[[nn.Module], float] | None = None
    built: DiLoCo | None = None  # the DiLoCo ``diloco()`` built

    def diloco(self) -> DiLoCo:
        """torchft's DiLoCo over these parts (a context manager: it hooks the inner steps)."""
        diloco = self.config.diloco
        self.built = DiLoCo(
            self.manager, self.fragments, self.inner, self.outers,
            sync_every=diloco.sync_every, fragment_sync_delay=diloco.fragment_sync_delay,
            pin_memory=False,
        )  # fmt: skip
        return self.built

    def apply_outer_hyperparameters(self) -> None:
        """run.toml's outer learning rate and momentum, over what a loaded checkpoint held: a
        run resumed with a new ``outer_lr`` trains with it (every replica reads one run.toml)."""
        diloco = self.config.diloco
        for outer in self.outers:
            for group in outer.param_groups:
                group.update(
                    lr=diloco.outer_lr, momentum=diloco.outer_momentum,
                    nesterov=diloco.outer_nesterov,
                )  # fmt: skip

    def global_state(self) -> GlobalState:
        """The state DiLoCo registered with the manager (once ``diloco()`` is built), its
        global weights read where DiLoCo keeps them (``_StreamingDiLoCoFragment``'s
        ``original_parameters``, torchft 0.2: no accessor returns them uncopied); the
        manager's fingerprint of it at each sync is taken without a copy too."""
        names = stored_names(self.model, self.fragments)  # what checkpoints record for export
        originals = [fragment.original_parameters for fragment in self.built._fragments]
        state = GlobalState(self.manager.state_dict_fns, self.fragments, self.outers, names,
                            originals)  # fmt: skip
        self.manager.state_checksum = state.checksum
        return state


def error_feedback(config: RunConfig) -> ErrorFeedback | None:
    """The error feedback a sparse codec needs (SparseLoCo, arXiv 2508.15706): without it the
    values the top-k leaves out would be lost. None for the dense codecs."""
    if config.diloco.codec != "sparse":
        return None
    return ErrorFeedback(config.diloco.sparse.error_decay)


def build_parts(
    config: RunConfig,
    collective: BucketCollective | None,
    model: nn.Module,
    inner: torch.optim.Optimizer,
    tokens_per_step: int,
    evaluate: Callable[[nn.Module], float] | None = None,
    group: ReplicaGroup = SINGLE_PROCESS,
) -> ReplicaParts:
    diloco = config.diloco
    manager = make_manager(
        group,
        collective,
        collective.config if collective is not None else config.collective_config(),
        min_replicas=config.run.min_replicas,
        timeout=timedelta(seconds=2 * config.sync.timeout),  # a seal, then a reduce
        feedback=error_feedback(config),
    )
    fragments = split_fragments(model, diloco.fragments)
    outers = [
        torch.optim.SGD(
            fragment.parameters(), lr=diloco.outer_lr, momentum=diloco.outer_momentum,
            nesterov=diloco.outer_nesterov,
        )
        for fragment in fragments
    ]  # fmt: skip
    for outer in outers:
        single_threaded_steps(outer)
    parts = ReplicaParts(
        config, manager, model, fragments, inner, outers, tokens_per_step, evaluate
    )
    return parts


def inner_optimizer(config: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The built-in loop's inner optimizer: AdamW with run.toml's ``inner_lr`` and weight decay
    (DiLoCo, arXiv 2311.08105 section 3)."""
    diloco = config.diloco
    return torch.optim.AdamW(
        model.parameters(), lr=diloco.inner_lr, weight_decay=diloco.inner_weight_decay
    )


def task_context(
    config: RunConfig,
    replica_index: int,
    group: ReplicaGroup,
    collective: BucketCollective | None = None,
    pacer: Pacer | None = None,
    use: DataUse | None = None,
) -> TaskContext:
    """What the task's ``build`` function is told about this replica: with ``collective``, its
    data is claimed through the run's bucket, else it takes a fixed share; ``pacer``: the
    replica's steps per round, which its data follows (none: every round ``round_steps``);
    ``use``: the replica's, told when its data is opened."""
    return TaskContext(
        replica_index=replica_index,
        replicas=config.run.replicas,
        seed=config.run.seed,
        device=resolve_device(config.task.device, group.local_rank),
        options=config.task.options,
        rank=group.rank,
        ranks=group.world_size,
        total_steps=config.diloco.total_steps,
        data=data_source(
            config, replica_index, group, collective, pacer or Pacer(config.diloco), use
        ),
    )


def data_source(
    config: RunConfig,
    replica_index: int,
    group: ReplicaGroup,
    collective: BucketCollective | None,
    pacer: Pacer,
    use: DataUse | None = None,
) -> DataSource:
    """The run's data (``[task] data``, else the task's own) as this process opens it, raw text
    prepared into the run's store: in a replica, its units claimed in the bucket by the
    replica's leader for all its processes (``data_units.py``); a process on its own without a
    bucket (a benchmark's) takes a fixed share."""
    diloco = config.diloco
    if collective is None and group.world_size == 1:
        assign = fixed_units(replica_index, config.run.replicas, group.rank, group.world_size)
    else:
        assign = claimed_units(config, replica_index, group, collective)
    store = config.store_url().rstrip("/")
    return DataSource(
        corpus=config.resolve(config.task.data) if config.task.data else "",
        seed=config.run.seed,
        batches_per_unit=diloco.step_quantum,
        assign=assign,
        span_of=pacer.span,
        copy=f"{store}/{RunLayout(config.run.name).data_corpus()}",
        holder=collective.me.name if collective is not None else f"{gethostname()}:{getpid()}",
        use=use or DataUse(),
    )  # fmt: skip


def parallelize(model: nn.Module, group: ReplicaGroup) -> nn.Module:
    """The module the inner steps run: ``model`` sharded in place with FSDP2 (``sharding =
    "fsdp"``), wrapped in DDP across the replica's ranks, or the model alone. Build the inner
    optimizer after this (FSDP2 turns the parameters into DTensors)."""
    if group.sharded and dist.is_initialized():
        return shard_model(model, group)
    if group.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)

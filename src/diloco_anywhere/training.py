"""One replica's training: torchft's own DiLoCo over the bucket-backed manager.

The loop is a plain PyTorch loop; DiLoCo hooks the inner optimizer's ``step`` and syncs a
fragment every ``sync_every / fragments`` inner steps (arXiv 2311.08105 algorithm 1; Streaming
DiLoCo, arXiv 2501.18512, for fragments > 1). After each sync the replica records a ``sync``
line (and the held-out loss at the new global weights when the sync committed), so a run's
metrics live in its bucket whatever platform ran it.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn
from torchft.local_sgd import DiLoCo

from diloco_anywhere.checkpoint import CheckpointPolicy, CheckpointWriter
from diloco_anywhere.codec import make_codec
from diloco_anywhere.collective.allreduce import BucketCollective, CollectiveConfig
from diloco_anywhere.collective.membership import LeasePolicy
from diloco_anywhere.collective.round import DivergedError, RoundPolicy
from diloco_anywhere.config import RunConfig
from diloco_anywhere.global_state import GlobalState
from diloco_anywhere.healing import heal
from diloco_anywhere.manager import BucketManager
from diloco_anywhere.metrics import MetricsWriter, StepLine, SyncLine
from diloco_anywhere.mirrors import MirrorWriter
from diloco_anywhere.replica_group import ReplicaGroup, make_manager
from diloco_anywhere.store import scrub_secrets
from diloco_anywhere.task import Batch, Task, TaskContext, build_task

log = logging.getLogger(__name__)

MAX_FAILED_SYNCS = 5  # in a row; then the replica stops with the last error
SINGLE_PROCESS = ReplicaGroup()


class SyncFailedError(RuntimeError):
    """Syncs kept failing; the message carries the last error."""


def collective_config(config: RunConfig) -> CollectiveConfig:
    return CollectiveConfig(
        codec=make_codec(config.diloco.codec),
        round=RoundPolicy(
            min_replicas=config.run.min_replicas,
            grace=config.sync.grace,
            timeout=config.sync.timeout,
            mode=config.sync.mode,
            expected_replicas=config.run.replicas,
            window=config.sync.window,
            part_elements=config.sync.part_size // 4,
        ),
        lease=LeasePolicy(period=config.sync.lease_period),
        keep_rounds=config.sync.keep_rounds,
    )


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
class TrainingResult:
    outer_steps: int
    inner_steps: int
    tokens: int
    final_loss: float
    eval_loss: float | None


class _Run:
    """One replica's loop state between syncs, and what it does after each: metrics, global
    checkpoints and healing (the leader's part), shared with the replica's other ranks."""

    def __init__(
        self,
        parts: ReplicaParts,
        collective: BucketCollective | None,
        metrics: MetricsWriter | None,
        group: ReplicaGroup,
    ) -> None:
        self.config, self.task, self.manager = parts.config, parts.task, parts.manager
        self.parts, self.collective, self.metrics, self.group = parts, collective, metrics, group
        self.inner_steps = self.tokens = self.failed_in_a_row = 0
        self.committed_before = False  # a sync of this process
        self.loss = float("nan")
        self.eval_loss: float | None = None
        self.tokens_at_sync, self.time_at_sync = 0, time.perf_counter()
        policy = CheckpointPolicy(
            keep=self.config.checkpoint.keep, orphan_grace=self.config.sync.grace * 3
        )
        self.mirrors = (
            MirrorWriter(self.config.mirror_urls(), collective.layout, policy.keep, self._report)
            if collective is not None and self.config.checkpoint.mirrors
            else None
        )
        self.writer = (
            CheckpointWriter(
                collective.store, collective.layout, collective.me.name, policy,
                mirror=self.mirrors.copy if self.mirrors else None,
            )
            if collective is not None
            else None
        )  # fmt: skip

    def _report(self, detail: str) -> None:
        """A mirror that failed, into the run's metrics (``diloco status`` shows it)."""
        if self.metrics is not None:
            self.metrics.event("mirror_failed", detail[:2000])

    def _evaluation_due(self) -> bool:
        """Every ``eval_every`` outer steps (all fragments synced), and at the last one."""
        every, fragments = self.config.task.eval_every, self.config.diloco.fragments
        step, last = self.manager.current_step(), self.config.diloco.outer_steps * fragments
        return bool(self.task.evaluate and every) and (
            step % (every * fragments) == 0 or step == last
        )

    def record_step(self, loss: torch.Tensor) -> None:
        self.inner_steps += 1
        self.tokens += self.task.tokens_per_batch * self.group.world_size
        if self.metrics is not None and self.inner_steps % self.config.task.log_every == 0:
            self.loss = float(loss)
            self.metrics.add(StepLine(step=self.inner_steps, loss=self.loss, tokens=self.tokens,
                                      time=time.time()))  # fmt: skip

    def record_sync(self, committed: bool, model: nn.Module) -> None:
        self.failed_in_a_row = 0 if committed else self.failed_in_a_row + 1
        if self.metrics is None:
            return
        error = self.manager.last_sync_error
        evaluated = committed and self._evaluation_due()
        if evaluated:
            self.eval_loss = self.task.evaluate(model)  # type: ignore[misc]
        now, traffic = time.perf_counter(), self.collective.store.stats()  # type: ignore[union-attr]
        self.metrics.add(
            SyncLine(
                outer_step=self.manager.current_step() // self.config.diloco.fragments,
                round=self.manager.last_round(),
                committed=committed,
                contributed=committed and self.manager.contributed(),
                fingerprint=self.manager.last_fingerprint,
                participants=self.manager.num_participants(),
                eval_loss=self.eval_loss if evaluated else None,  # measured at this sync only
                tokens=self.tokens,
                tokens_per_second=(self.tokens - self.tokens_at_sync) / (now - self.time_at_sync),
                sync_exposed_seconds=self.manager.exposed_seconds,
                bytes_up=traffic.bytes_up,
                bytes_down=traffic.bytes_down,
                error=None
                if error is None
                else scrub_secrets(f"{type(error).__name__}: {error}")[:2000],
                time=time.time(),
            )
        )
        self.metrics.flush()
        self.tokens_at_sync, self.time_at_sync = self.tokens, now

    def checkpoint_if_due(self, state: GlobalState) -> None:
        """Write the run's checkpoint with the round's other contributors when one is due.
        After its own first commit, a process writes one alone as well: a run resumed with new
        outer hyperparameters then has a checkpoint under them at once, and healing never
        replays rounds across the change."""
        step, result = self.manager.current_step(), self.manager.last_result
        last = self.config.diloco.outer_steps * self.config.diloco.fragments
        first, self.committed_before = not self.committed_before, True
        if self.writer is None or result is None:
            return
        if _checkpoint_due(step, self.config.checkpoint.every, last):
            writers = result.seal.contributors
        elif first:
            writers = (self.writer.me,)
        else:
            return
        self.writer.write(
            self.manager.last_round(),
            writers,
            {"manager": self.manager.state_dict(), "fragments": state.fragments_tree()},
            last=step == last,
        )

    def heal(self, state: GlobalState, *, from_initial: bool) -> Iterator[Batch]:
        """Bring the global state to the run's newest sealed round (the leader, from the
        bucket: ``healing.py``; the other ranks, from the leader) and return the batches from
        there: every replica trains ``batches_per_round`` per round."""
        if self.group.is_leader:
            report = heal(
                self.collective,  # type: ignore[arg-type]  (the leader holds the bucket)
                state,
                self.manager,
                self.config.run.min_replicas,
                from_initial=from_initial,
                mirrors=self.mirrors.stores if self.mirrors else (),
            )
            if self.metrics and (
                report.checkpoint is not None or report.replayed or report.skipped
            ):
                log.info("%s", report.describe())
                self.metrics.event("healed", report.describe(), seconds=report.seconds)
        tree = self.group.share_state(
            {"manager": self.manager.state_dict(), "fragments": state.fragments_tree()}
        )
        if not self.group.is_leader:
            self.manager.load_state_dict(tree["manager"])
            state.load_fragments_tree(tree["fragments"])
            state.reset_local_weights()
        self.parts.apply_outer_hyperparameters()
        self.inner_steps = self.manager.state_dict()["sync"] * self.parts.batches_per_round
        self.tokens = self.inner_steps * self.task.tokens_per_batch * self.group.world_size
        self.tokens_at_sync, self.time_at_sync = self.tokens, time.perf_counter()
        return self.task.batches(self.inner_steps)

    def after_divergence(self, state: GlobalState) -> Iterator[Batch]:
        """Say so loudly (log, metrics, ``diloco status``), then heal from the bucket. The
        diverged sync still counts as failed: a replica that diverges every time (it computes
        unlike the others) stops after ``MAX_FAILED_SYNCS``, saying why."""
        error = self.manager.last_sync_error
        log.error("%s", error)
        if self.metrics is not None:
            self.metrics.event("diverged", str(error)[:2000])
        return self.heal(state, from_initial=False)

    def stop_if_failing(self) -> None:
        """Give up after ``MAX_FAILED_SYNCS`` failed syncs in a row, with the last error."""
        if self.failed_in_a_row >= MAX_FAILED_SYNCS:
            raise SyncFailedError(
                f"{self.failed_in_a_row} syncs in a row failed; last: "
                f"{self.manager.last_sync_error}. See the other replicas with `diloco status` "
                f"and `diloco logs`"
            )

    def close(self) -> None:
        """The last checkpoint is committed before the replica reports done."""
        if self.writer is not None:
            self.writer.close()
        if self.mirrors is not None:
            self.mirrors.close()


def _checkpoint_due(step: int, every: int, last: int) -> bool:
    """After the first committed sync (so a replica can heal early on), every ``every``, and
    after the last (the run's final weights, in the bucket)."""
    return step == 1 or step % every == 0 or step == last


@dataclass
class ReplicaParts:
    """What one replica trains with, built from run.toml: the task, the bucket-backed manager,
    the fragments, the inner optimizer and one outer optimizer per fragment."""

    config: RunConfig
    task: Task
    manager: BucketManager
    fragments: list[nn.Module]
    inner: torch.optim.Optimizer
    outers: list[torch.optim.Optimizer]

    @property
    def batches_per_round(self) -> int:
        """torchft's DiLoCo syncs once per ``sync_every / fragments`` inner steps."""
        return self.config.diloco.sync_every // self.config.diloco.fragments

    def diloco(self) -> DiLoCo:
        """torchft's DiLoCo over these parts (a context manager: it hooks the inner steps)."""
        diloco = self.config.diloco
        return DiLoCo(
            self.manager, self.fragments, self.inner, self.outers,
            sync_every=diloco.sync_every, fragment_sync_delay=diloco.fragment_sync_delay,
            pin_memory=False,
        )  # fmt: skip

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
        """The state DiLoCo registered with the manager (once ``diloco()`` is built)."""
        return GlobalState(self.manager.state_dict_fns, self.fragments, self.outers)


def build_parts(
    config: RunConfig,
    collective: BucketCollective | None,
    replica_index: int,
    group: ReplicaGroup = SINGLE_PROCESS,
) -> ReplicaParts:
    diloco = config.diloco
    task = build_task(
        config.task.entrypoint,
        TaskContext(
            replica_index=replica_index,
            replicas=config.run.replicas,
            seed=config.run.seed,
            device=resolve_device(config.task.device, group.local_rank),
            options=config.task.options,
            rank=group.rank,
            ranks=group.world_size,
        ),
    )
    manager = make_manager(
        group,
        collective,
        codec=make_codec(diloco.codec),
        min_replicas=config.run.min_replicas,
        timeout=timedelta(seconds=2 * config.sync.timeout),  # a seal, then a reduce
    )
    fragments = split_fragments(task.model, diloco.fragments)
    inner = torch.optim.AdamW(
        task.model.parameters(), lr=diloco.inner_lr, weight_decay=diloco.inner_weight_decay
    )
    outers = [
        torch.optim.SGD(
            fragment.parameters(), lr=diloco.outer_lr, momentum=diloco.outer_momentum,
            nesterov=diloco.outer_nesterov,
        )
        for fragment in fragments
    ]  # fmt: skip
    for outer in outers:
        single_threaded_steps(outer)
    parts = ReplicaParts(config, task, manager, fragments, inner, outers)
    tokens_per_round = task.tokens_per_batch * parts.batches_per_round * group.world_size
    manager.set_weight(tokens_per_round)
    return parts


def _data_parallel(model: nn.Module, group: ReplicaGroup, device: torch.device) -> nn.Module:
    """The module the inner steps run: DDP across the replica's ranks, or the model alone."""
    if group.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def train(
    config: RunConfig,
    collective: BucketCollective | None,
    metrics: MetricsWriter | None,
    replica_index: int,
    group: ReplicaGroup = SINGLE_PROCESS,
) -> TrainingResult:
    """Heal to the run's state (a run already going, or resumed), then train until
    ``outer_steps`` outer steps have committed (every fragment synced that many times),
    recording metrics and writing global checkpoints as it goes. ``metrics`` is the leader's
    (rank 0 of the replica); the other ranks pass None."""
    parts = build_parts(config, collective, replica_index, group)
    task, manager, model, inner = parts.task, parts.manager, parts.task.model, parts.inner
    trained = _data_parallel(model, group, next(model.parameters()).device)
    if metrics is not None:
        metrics.event(
            "started",
            f"shard {replica_index} of {config.run.replicas}, {group.world_size} process(es)",
            parameters=sum(p.numel() for p in model.parameters()),
        )
    run = _Run(parts, collective, metrics, group)
    last_step = config.diloco.outer_steps * config.diloco.fragments
    # Everything built so far lives for the whole run; keep the cyclic collector from
    # rescanning it (torchft, pydantic, SDK modules) on every full collection during training.
    gc.freeze()
    with parts.diloco():
        state = parts.global_state()
        batches = run.heal(state, from_initial=True)
        while manager.current_step() < last_step:
            loss = task.loss(trained, next(batches))
            inner.zero_grad(set_to_none=True)
            loss.backward()
            syncs, step = manager.syncs_attempted, manager.current_step()
            inner.step()  # DiLoCo's hook syncs here every sync_every / fragments steps
            run.record_step(loss.detach())
            if manager.syncs_attempted == syncs:
                continue
            committed = manager.current_step() > step
            run.record_sync(committed, model)
            if committed:
                run.checkpoint_if_due(state)
            if isinstance(manager.last_sync_error, DivergedError):  # the same on every rank
                batches = run.after_divergence(state)
            run.stop_if_failing()
        group.check_same_state(state.checksum())
    run.close()
    return TrainingResult(
        outer_steps=manager.current_step() // config.diloco.fragments,
        inner_steps=run.inner_steps,
        tokens=run.tokens,
        final_loss=run.loss,
        eval_loss=run.eval_loss,
    )

"""One replica's training: torchft's own DiLoCo over the bucket-backed manager.

The loop is a plain PyTorch loop; DiLoCo hooks the inner optimizer's ``step`` and syncs a
fragment every ``sync_every / fragments`` inner steps (arXiv 2311.08105 algorithm 1; Streaming
DiLoCo, arXiv 2501.18512, for fragments > 1). After each sync the replica records a ``sync``
line (and the held-out loss at the new global weights when the sync committed), so a run's
metrics live in its bucket whatever platform ran it.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torchft.local_sgd import DiLoCo

from diloco_anywhere.bucket.codec import make_codec
from diloco_anywhere.bucket.store import scrub_secrets
from diloco_anywhere.collective.allreduce import BucketCollective, CollectiveConfig
from diloco_anywhere.collective.membership import LeasePolicy, SupersededError
from diloco_anywhere.collective.round import DivergedError, RoundPolicy
from diloco_anywhere.config import RunConfig
from diloco_anywhere.task import Batch, Task, TaskContext, build_task
from diloco_anywhere.training.checkpoints.records import ShardOf
from diloco_anywhere.training.checkpoints.writer import CheckpointPolicy, CheckpointWriter
from diloco_anywhere.training.global_state import GlobalState, fingerprint
from diloco_anywhere.training.healing import ALONE, heal
from diloco_anywhere.training.manager import BucketManager
from diloco_anywhere.training.metrics import MetricsWriter, StepLine, SyncLine
from diloco_anywhere.training.mirrors import MirrorWriter
from diloco_anywhere.training.replica_group import ReplicaGroup, make_manager
from diloco_anywhere.training.sharded_replica import reshard, shard_model
from diloco_anywhere.training.warm_start import warm_start

if TYPE_CHECKING:
    from diloco_anywhere.training.session import Replica

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


class Training:
    """One replica training under torchft's DiLoCo (``Replica.diloco`` yields it): where its
    data resumes, and what it does after each sync, which DiLoCo runs inside the inner
    optimizer's ``step``: metrics, global checkpoints, healing after a divergence, giving up
    after failed syncs in a row (the leader's part, the other ranks sharing its results; or,
    in a sharded replica, every rank's for its own shard, decided together).

    A training loop needs three things from it: ``batches(open_at)`` (the data from where the
    run is, reopened after a heal), ``log(loss)`` after each inner step, and nothing else;
    ``done`` says when the run's outer steps are committed."""

    def __init__(
        self,
        parts: ReplicaParts,
        collective: BucketCollective | None,
        metrics: MetricsWriter | None,
        group: ReplicaGroup,
    ) -> None:
        self.config, self.manager, self.evaluate = parts.config, parts.manager, parts.evaluate
        self.parts, self.collective, self.metrics, self.group = parts, collective, metrics, group
        self.inner_steps = self.tokens = self.failed_in_a_row = 0
        self.start_step = 0  # the inner step the data resumes at: set by every heal
        self.heals = 0
        self.state: GlobalState | None = None  # once DiLoCo is built
        self._syncs_seen = self._step_seen = 0
        self._healed_in_step = False
        self.committed_before = False  # a sync of this process
        self.loss = float("nan")
        self.eval_loss: float | None = None
        self.tokens_at_sync, self.time_at_sync = 0, time.perf_counter()
        policy = CheckpointPolicy(
            keep=self.config.checkpoint.keep, orphan_grace=self.config.sync.grace * 3,
            part_wait=self.config.sync.timeout,
        )  # fmt: skip
        self.shard = ShardOf(group.rank, group.world_size) if group.sharded else ShardOf()
        self.mirrors = (
            MirrorWriter(self.config.mirror_urls(), collective.layout, policy, self._report)
            if collective is not None and self.config.checkpoint.mirrors
            else None
        )
        self.writer = (
            CheckpointWriter(
                collective.store, collective.layout,
                collective.me.replica if self.shard.sharded else collective.me.name, policy,
                mirror=self.mirrors.copy if self.mirrors else None, shard=self.shard,
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
        return bool(self.evaluate and every) and (step % (every * fragments) == 0 or step == last)

    @property
    def done(self) -> bool:
        """Every fragment has committed the run's ``outer_steps`` syncs."""
        last_step = self.config.diloco.outer_steps * self.config.diloco.fragments
        return self.manager.current_step() >= last_step

    def batches(self, open_at: Callable[[int], Iterator[Batch]]) -> Iterator[Batch]:
        """Batches from ``open_at(start_step)``, reopened where the run is after each heal,
        until ``done``: every replica trains ``sync_every / fragments`` batches per round, so a
        replica that heals resumes its data at its round, never replaying the batches before."""
        opened_at, batches = -1, iter(())
        while not self.done:
            if opened_at != self.heals:
                opened_at, batches = self.heals, open_at(self.start_step)
            try:
                batch = next(batches)
            except StopIteration:
                raise ValueError(
                    f"the data ran out at inner step {self.inner_steps} of the run's "
                    f"{self.config.diloco.outer_steps * self.config.diloco.sync_every}: "
                    f"open_at(start) must go on until the run ends (loop over epochs)"
                ) from None
            yield batch

    def log(self, loss: torch.Tensor | float, **values: torch.Tensor | float) -> None:
        """The inner step's loss and any numbers of the script's own (``lr=...``), into the
        run's metrics every ``task.log_every`` steps (``diloco status``, ``diloco report``).
        Names as run names are written; at most ``metrics.MAX_VALUES`` of them. The loss of
        a step whose sync healed the replica is not recorded: its step count is the healed
        position's, not the step's."""
        healed, self._healed_in_step = self._healed_in_step, False
        if healed:
            return
        if self.metrics is not None and self.inner_steps % self.config.task.log_every == 0:
            self.loss = float(loss)
            self.metrics.add(StepLine(
                step=self.inner_steps, loss=self.loss, tokens=self.tokens, time=time.time(),
                values={name: float(value) for name, value in values.items()},
            ))  # fmt: skip

    def after_inner_step(self, model: nn.Module) -> None:
        """Count the step; after a sync (DiLoCo's step hook ran one), record it, write the
        checkpoint when due, heal after a divergence and give up after too many failures."""
        self.inner_steps += 1
        self.tokens += self.parts.tokens_per_step * self.group.world_size
        manager = self.manager
        if manager.syncs_attempted == self._syncs_seen:
            return
        committed = manager.current_step() > self._step_seen
        self._syncs_seen, self._step_seen = manager.syncs_attempted, manager.current_step()
        self.record_sync(committed, model)
        if committed:
            self.checkpoint_if_due(self.state)  # type: ignore[arg-type]
        if isinstance(manager.last_sync_error, SupersededError):  # a zombie trains no further
            raise manager.last_sync_error
        if isinstance(manager.last_sync_error, DivergedError):  # the same on every rank
            self.after_divergence(self.state)  # type: ignore[arg-type]
            self._healed_in_step = True
        self.stop_if_failing()

    def record_sync(self, committed: bool, model: nn.Module) -> None:
        """The sync's line in the metrics (rank 0), with the held-out loss when due: every rank
        of a sharded replica evaluates (each forward gathers the shards of all), rank 0 alone
        of any other."""
        self.failed_in_a_row = 0 if committed else self.failed_in_a_row + 1
        evaluated = committed and self._evaluation_due()
        if evaluated and (self.metrics is not None or self.group.sharded):
            self.eval_loss = self.evaluate_global_weights(model)
        if self.metrics is None:
            return
        error = self.manager.last_sync_error
        now, (bytes_up, bytes_down) = time.perf_counter(), self.manager.traffic()
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
                bytes_up=bytes_up,
                bytes_down=bytes_down,
                error=None
                if error is None
                else scrub_secrets(f"{type(error).__name__}: {error}")[:2000],
                time=time.time(),
            )
        )
        self.metrics.flush()
        self.tokens_at_sync, self.time_at_sync = self.tokens, now

    def evaluate_global_weights(self, model: nn.Module) -> float:
        """The held-out loss of the weights the replicas agreed on. With fragments > 1 the
        model holds them only while ``GlobalState.global_weights_in_place`` swaps them in; a
        sharded replica's model is resharded before its local weights come back (a forward
        leaves FSDP2's root unsharded, and its unsharded parameters are what it holds then)."""
        streaming = self.config.diloco.fragments > 1 and self.state is not None
        swap = self.state.global_weights_in_place() if streaming else nullcontext()  # type: ignore[union-attr]
        with swap:
            try:
                return self.evaluate(model)  # type: ignore[misc]
            finally:
                if self.group.sharded:
                    reshard(model)

    def checkpoint_if_due(self, state: GlobalState) -> None:
        """Write the run's checkpoint with the round's other contributors when one is due (a
        sharded replica: the one first in rank 0's SEAL, all its ranks). After its own first
        commit, a process writes one alone as well: a run resumed with new outer
        hyperparameters then has a checkpoint under them at once, and healing never replays
        rounds across the change."""
        step, result = self.manager.current_step(), self.manager.last_result
        last = self.config.diloco.outer_steps * self.config.diloco.fragments
        first, self.committed_before = not self.committed_before, True
        if self.writer is None or result is None:
            return
        if _checkpoint_due(step, self.config.checkpoint.every, last):
            writers = (
                (self.manager.leading_replica,)  # type: ignore[attr-defined]
                if self.shard.sharded
                else result.seal.contributors
            )
        elif first:
            writers = (self.writer.me,)
        else:
            return
        if self.writer.me not in writers:
            return
        parts = self._agree_on_parts(state, step, last=step == last)
        if parts is None:
            return
        tree = {"manager": self.manager.state_dict(), "fragments": state.checkpoint_tree()}
        self.writer.write(self.manager.last_round(), writers, tree, last=step == last, parts=parts)

    def _agree_on_parts(
        self, state: GlobalState, step: int, *, last: bool
    ) -> tuple[str, ...] | None:
        """A sharded replica's ranks write a checkpoint together or not at all: each rank's
        part's fingerprint, for rank 0 to commit only those parts; None (skipped) while any
        rank still writes or mirrors the previous one, unless this is the run's ``last``.
        Nothing to agree for an unsharded replica: ``()``."""
        if not self.shard.sharded:
            return ()
        gathered = self.group.gather((self._idle(), state.checksum()))
        if not (last or all(idle for idle, _ in gathered)):
            log.warning("checkpoint of round %d skipped: a rank is still writing or "
                        "mirroring the previous one (raise checkpoint.every)",
                        self.manager.last_round())  # fmt: skip
            return None
        return tuple(fingerprint(step, checksum) for _, checksum in gathered)

    def _idle(self) -> bool:
        """This process writes and mirrors no checkpoint now."""
        return self.writer.idle() and (self.mirrors is None or self.mirrors.idle())  # type: ignore[union-attr]

    def heal(self, state: GlobalState, *, from_initial: bool) -> int:
        """Bring the global state to the run's newest sealed round (the leader, from the
        bucket: ``healing.py``, and the other ranks from the leader; or every rank of a sharded
        replica its own shard, together); the inner step the data resumes at
        (``start_step``): every replica trains ``batches_per_round`` per round."""
        if self.group.is_leader or self.shard.sharded:
            report = heal(
                self.collective,  # type: ignore[arg-type]  (held by the leader, or every rank of a sharded replica)
                state,
                self.manager,
                self.config.run.min_replicas,
                from_initial=from_initial,
                mirrors=self.mirrors.stores if self.mirrors else (),
                shard=self.shard,
                ranks=self.group if self.shard.sharded else ALONE,
            )
            if self.metrics and (
                report.checkpoint is not None or report.replayed or report.skipped
            ):
                log.info("%s", report.describe())
                self.metrics.event("healed", report.describe(), seconds=report.seconds)
        if not self.shard.sharded:
            self._share_leaders_state(state)
        self.parts.apply_outer_hyperparameters()
        self.inner_steps = self.manager.state_dict()["sync"] * self.parts.batches_per_round
        self.tokens = self.inner_steps * self.parts.tokens_per_step * self.group.world_size
        self.tokens_at_sync, self.time_at_sync = self.tokens, time.perf_counter()
        self._syncs_seen = self.manager.syncs_attempted
        self._step_seen = self.manager.current_step()
        self.start_step, self.heals = self.inner_steps, self.heals + 1
        return self.start_step

    def _share_leaders_state(self, state: GlobalState) -> None:
        """The other ranks of an unsharded replica take the state the leader healed to."""
        tree = self.group.share_state(
            {"manager": self.manager.state_dict(), "fragments": state.fragments_tree()}
        )
        if not self.group.is_leader:
            self.manager.load_state_dict(tree["manager"])
            state.load_fragments_tree(tree["fragments"])
            state.reset_local_weights()

    def after_divergence(self, state: GlobalState) -> int:
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

    def result(self) -> TrainingResult:
        return TrainingResult(
            outer_steps=self.manager.current_step() // self.config.diloco.fragments,
            inner_steps=self.inner_steps,
            tokens=self.tokens,
            final_loss=self.loss,
            eval_loss=self.eval_loss,
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
    """What one replica trains with: the bucket-backed manager, the model's fragments, the
    inner optimizer, one outer optimizer per fragment (from run.toml), the tokens each inner
    step trains on (they weigh the replica's contribution) and the held-out evaluation."""

    config: RunConfig
    manager: BucketManager
    fragments: list[nn.Module]
    inner: torch.optim.Optimizer
    outers: list[torch.optim.Optimizer]
    tokens_per_step: int
    evaluate: Callable[[nn.Module], float] | None = None

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
        codec=make_codec(diloco.codec),
        min_replicas=config.run.min_replicas,
        timeout=timedelta(seconds=2 * config.sync.timeout),  # a seal, then a reduce
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
    parts = ReplicaParts(config, manager, fragments, inner, outers, tokens_per_step, evaluate)
    manager.set_weight(tokens_per_step * parts.batches_per_round * group.world_size)
    return parts


def inner_optimizer(config: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The built-in loop's inner optimizer: AdamW with run.toml's ``inner_lr`` and weight decay
    (DiLoCo, arXiv 2311.08105 section 3)."""
    diloco = config.diloco
    return torch.optim.AdamW(
        model.parameters(), lr=diloco.inner_lr, weight_decay=diloco.inner_weight_decay
    )


def task_context(config: RunConfig, replica_index: int, group: ReplicaGroup) -> TaskContext:
    """What the task's ``build`` function is told about this replica."""
    return TaskContext(
        replica_index=replica_index,
        replicas=config.run.replicas,
        seed=config.run.seed,
        device=resolve_device(config.task.device, group.local_rank),
        options=config.task.options,
        rank=group.rank,
        ranks=group.world_size,
        total_steps=config.diloco.outer_steps * config.diloco.sync_every,
    )


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


def train(replica: Replica) -> TrainingResult:
    """The built-in replica loop, on the public API (docs/api.md): build run.toml's task (from
    ``[task] init_from``'s weights, if given), then train it under torchft's DiLoCo until the
    run's outer steps are committed."""
    task = build_task(
        replica.config.task.entrypoint,
        task_context(replica.config, replica.index, replica.group),
    )
    if replica.config.task.init_from:
        warm_start(task.model, replica.config.resolve(replica.config.task.init_from))
    trained = replica.parallelize(task.model)
    inner = inner_optimizer(replica.config, task.model)
    with replica.diloco(
        task.model, inner, tokens_per_step=task.tokens_per_batch, evaluate=task.evaluate
    ) as training:
        for batch in training.batches(task.batches):
            inner.zero_grad(set_to_none=True)
            loss = backward_batch(task, trained, batch)
            before_inner_step(task, inner, replica.config.diloco.inner_lr, training.inner_steps)
            inner.step()  # DiLoCo's hook syncs here every sync_every / fragments steps
            training.log(loss, lr=inner.param_groups[0]["lr"])
    return training.result()


def backward_batch(task: Task, model: nn.Module, batch: Batch) -> torch.Tensor:
    """Forward and backward the batch (each of its micro-batches, for a task that accumulates
    gradients); the mean loss, detached."""
    parts = batch if task.micro_batches else [batch]
    losses = []
    for part in parts:
        loss = task.loss(model, part) / len(parts)
        loss.backward()
        losses.append(loss.detach())  # on its device: read only when logged
    return torch.stack(losses).sum()


def before_inner_step(task: Task, inner: torch.optim.Optimizer, base_lr: float, step: int) -> None:
    """The task's gradient clipping and learning-rate schedule, at the run's inner step."""
    if task.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(task.model.parameters(), task.max_grad_norm)
    if task.lr_schedule is not None:
        for group in inner.param_groups:
            group["lr"] = base_lr * task.lr_schedule(step)

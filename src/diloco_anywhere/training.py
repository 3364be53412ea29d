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
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn
from torchft.local_sgd import DiLoCo

from diloco_anywhere.codec import make_codec
from diloco_anywhere.collective.allreduce import BucketCollective, CollectiveConfig
from diloco_anywhere.collective.membership import LeasePolicy
from diloco_anywhere.collective.round import RoundPolicy
from diloco_anywhere.config import RunConfig
from diloco_anywhere.manager import BucketManager
from diloco_anywhere.metrics import MetricsWriter, StepLine, SyncLine
from diloco_anywhere.store import Store, scrub_secrets
from diloco_anywhere.task import Task, TaskContext, build_task

MAX_FAILED_SYNCS = 5  # in a row; then the replica stops with the last error


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
        ),
        lease=LeasePolicy(period=config.sync.lease_period),
        keep_rounds=config.sync.keep_rounds,
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


@dataclass
class TrainingResult:
    outer_steps: int
    inner_steps: int
    tokens: int
    final_loss: float
    eval_loss: float | None


class _Run:
    """The state of one replica's loop between syncs."""

    def __init__(self, config: RunConfig, task: Task, manager: BucketManager, store: Store):
        self.config, self.task, self.manager, self.store = config, task, manager, store
        self.inner_steps = self.tokens = self.failed_in_a_row = 0
        self.loss = float("nan")
        self.eval_loss: float | None = None
        self.tokens_at_sync, self.time_at_sync = 0, time.perf_counter()

    def _evaluation_due(self) -> bool:
        """Every ``eval_every`` outer steps (all fragments synced), and at the last one."""
        every, fragments = self.config.task.eval_every, self.config.diloco.fragments
        step, last = self.manager.current_step(), self.config.diloco.outer_steps * fragments
        return bool(self.task.evaluate and every) and (
            step % (every * fragments) == 0 or step == last
        )

    def record_step(self, loss: torch.Tensor, metrics: MetricsWriter) -> None:
        self.inner_steps += 1
        self.tokens += self.task.tokens_per_batch
        if self.inner_steps % self.config.task.log_every == 0:
            self.loss = float(loss)
            metrics.add(StepLine(step=self.inner_steps, loss=self.loss, tokens=self.tokens,
                                 time=time.time()))  # fmt: skip

    def record_sync(self, committed: bool, model: nn.Module, metrics: MetricsWriter) -> None:
        error = self.manager.last_sync_error
        self.failed_in_a_row = 0 if committed else self.failed_in_a_row + 1
        evaluated = committed and self._evaluation_due()
        if evaluated:
            self.eval_loss = self.task.evaluate(model)  # type: ignore[misc]
        now, traffic = time.perf_counter(), self.store.stats()
        metrics.add(
            SyncLine(
                outer_step=self.manager.current_step() // self.config.diloco.fragments,
                committed=committed,
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
        metrics.flush()
        self.tokens_at_sync, self.time_at_sync = self.tokens, now

    def stop_if_failing(self) -> None:
        """Give up after ``MAX_FAILED_SYNCS`` failed syncs in a row, with the last error."""
        if self.failed_in_a_row >= MAX_FAILED_SYNCS:
            raise SyncFailedError(
                f"{self.failed_in_a_row} syncs in a row failed; last: "
                f"{self.manager.last_sync_error}. See the other replicas with `diloco status` "
                f"and `diloco logs`"
            )


def train(
    config: RunConfig,
    store: Store,
    collective: BucketCollective,
    metrics: MetricsWriter,
    replica_index: int,
) -> TrainingResult:
    """Train until ``outer_steps`` outer steps have committed (every fragment synced that many
    times), recording metrics as it goes."""
    diloco = config.diloco
    task = build_task(
        config.task.entrypoint,
        TaskContext(
            replica_index=replica_index,
            replicas=config.run.replicas,
            seed=config.run.seed,
            device=resolve_device(config.task.device),
            options=config.task.options,
        ),
    )
    model = task.model
    metrics.event(
        "started",
        f"shard {replica_index} of {config.run.replicas}",
        parameters=sum(p.numel() for p in model.parameters()),
    )
    manager = BucketManager(
        collective,
        min_replicas=config.run.min_replicas,
        timeout=timedelta(seconds=2 * config.sync.timeout),  # a seal, then a reduce
    )
    manager.set_weight(task.tokens_per_batch * diloco.sync_every / diloco.fragments)
    fragments = split_fragments(model, diloco.fragments)
    inner = torch.optim.AdamW(
        model.parameters(), lr=diloco.inner_lr, weight_decay=diloco.inner_weight_decay
    )
    outers = [
        torch.optim.SGD(
            fragment.parameters(), lr=diloco.outer_lr, momentum=diloco.outer_momentum,
            nesterov=diloco.outer_nesterov,
        )
        for fragment in fragments
    ]  # fmt: skip
    run = _Run(config, task, manager, store)
    # Everything built so far lives for the whole run; keep the cyclic collector from
    # rescanning it (torchft, pydantic, SDK modules) on every full collection during training.
    gc.freeze()
    with DiLoCo(
        manager, fragments, inner, outers, sync_every=diloco.sync_every,
        fragment_sync_delay=diloco.fragment_sync_delay, pin_memory=False,
    ):  # fmt: skip
        while manager.current_step() < diloco.outer_steps * diloco.fragments:
            loss = task.loss(model, next(task.batches))
            inner.zero_grad(set_to_none=True)
            loss.backward()
            syncs, step = manager.syncs_attempted, manager.current_step()
            inner.step()  # DiLoCo's hook syncs here every sync_every / fragments steps
            run.record_step(loss.detach(), metrics)
            if manager.syncs_attempted != syncs:
                run.record_sync(manager.current_step() > step, model, metrics)
                run.stop_if_failing()
    return TrainingResult(
        outer_steps=manager.current_step() // diloco.fragments,
        inner_steps=run.inner_steps,
        tokens=run.tokens,
        final_loss=run.loss,
        eval_loss=run.eval_loss,
    )

"""This process's replica of a run: the public way for a training script to take part.

    import diloco_anywhere

    with diloco_anywhere.join() as replica:            # who it is, from `diloco launch`
        model = ...                                    # the same initial weights everywhere
        inner = torch.optim.AdamW(model.parameters())
        with replica.diloco(model, inner, tokens_per_step=...) as training:
            for batch in training.batches(my_batches):  # my_batches(start) -> iterator
                loss = ...
                loss.backward()
                inner.step()                           # DiLoCo syncs in here, every H steps
                inner.zero_grad()
                training.log(loss)

``join`` reads what the launcher gives every replica (its id, data shard, platform, run.toml:
``replica.py``) or takes them as arguments; the replica then claims its membership in the
bucket, and its metrics (``started``, ``done``, ``failed``, ``stopped`` events) go to the run's
store. ``diloco`` wraps torchft's own ``DiLoCo`` over the bucket-backed manager, with the
fragments, outer optimizers, codec and checkpoints run.toml gives, heals the replica to the
run's state first, and says where its data resumes. The built-in loop (``training.train``) is
written on this API. Under ``torchrun`` (a replica of several processes), rank 0 alone talks
to the bucket (``replica_group.py``).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import TracebackType

import torch
from torch import nn

from diloco_anywhere.checkpoint import retained_after
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.command import DONE, ENV_JOINED, JOINED, report
from diloco_anywhere.config import RunConfig
from diloco_anywhere.layout import RunLayout
from diloco_anywhere.metrics import MetricsWriter
from diloco_anywhere.replica_group import ReplicaGroup
from diloco_anywhere.store import Store, scrub_secrets
from diloco_anywhere.training import (
    Training,
    build_parts,
    collective_config,
    resolve_device,
)

log = logging.getLogger(__name__)


class StopRequestedError(Exception):
    """SIGTERM arrived: ``diloco stop``, or the platform preempting or evicting the job."""


def raise_stopped(signum: int, _frame: object) -> None:
    """The SIGTERM handler of a replica: the stop becomes an error that unwinds training, so
    that leaving the ``Replica`` records it."""
    name = signal.Signals(signum).name
    raise StopRequestedError(f"stopped by {name} (diloco stop, or the platform)")


class Replica:
    """One replica of the run that ``config`` describes: its identity, its data shard, its
    place among the processes of a ``torchrun`` replica, and (rank 0) its membership, metrics
    and store. A context manager: leaving it records how the replica ended."""

    def __init__(
        self, config: RunConfig, replica_id: str, index: int, platform: str = "local"
    ) -> None:
        self.config, self.replica_id, self.index = config, replica_id, index
        self.platform = platform
        self.group = ReplicaGroup.from_environment(
            resolve_device(config.task.device).type,
            timeout=timedelta(seconds=max(3600.0, 4 * config.sync.timeout)),
        )
        self.device = resolve_device(config.task.device, self.group.local_rank)
        self.collective: BucketCollective | None = None
        self.metrics: MetricsWriter | None = None
        self.training: Training | None = None
        if self.group.is_leader:
            store, layout = Store(config.store_url()), RunLayout(config.run.name)
            keep = config.checkpoint.keep
            self.collective = BucketCollective(
                store, layout.run, replica_id, collective_config(config),
                retained_after=lambda: retained_after(store, layout, keep),  # healing replays
            )  # fmt: skip
            incarnation = self.collective.me.incarnation
            self.metrics = MetricsWriter(store, layout, replica_id, incarnation, platform)

    @contextmanager
    def diloco(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        tokens_per_step: int = 1,
        evaluate: Callable[[nn.Module], float] | None = None,
    ) -> Iterator[Training]:
        """Train ``model`` under torchft's DiLoCo: healed to the run's state on entry (its data
        resumes at ``training.start_step``), synced through the bucket inside
        ``inner_optimizer.step()`` every ``sync_every / fragments`` steps, with metrics and
        checkpoints after each sync. ``tokens_per_step``: the tokens (or samples) one inner
        step trains on, across this replica's processes' own share; it weighs the replica's
        contribution. ``evaluate(model)``: the held-out loss, every ``task.eval_every`` outer
        steps. On exit every process of the replica checks it holds rank 0's global state."""
        parts = build_parts(
            self.config, self.collective, model, inner_optimizer, tokens_per_step, evaluate,
            self.group,
        )  # fmt: skip
        training = Training(parts, self.collective, self.metrics, self.group)
        if self.metrics is not None:
            self.metrics.event(
                "started",
                f"shard {self.index} of {self.config.run.replicas}, "
                f"{self.group.world_size} process(es)",
                parameters=sum(p.numel() for p in model.parameters()),
            )
        # Everything built so far lives for the whole run; keep the cyclic collector from
        # rescanning it (torchft, pydantic, SDK modules) on every full collection.
        gc.freeze()
        with parts.diloco():
            training.state = parts.global_state()
            training.heal(training.state, from_initial=True)
            hook = inner_optimizer.register_step_post_hook(
                lambda *_: training.after_inner_step(model)
            )
            try:
                yield training
            finally:
                hook.remove()
            self.group.check_same_state(training.state.checksum())
        training.close()
        self.training = training

    def close(self) -> None:
        if self.collective is not None:
            self.collective.close()

    def __enter__(self) -> Replica:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        """Record how the replica ended (``done`` with what it trained, ``stopped``,
        ``failed`` with the error), then leave the run."""
        trained = error is None and self.training is not None and self.training.done
        if trained:
            report(DONE)
        if self.metrics is not None:
            self.metrics.flush()
            if isinstance(error, StopRequestedError):
                self.metrics.event("stopped", str(error))
            elif error is not None:
                self.metrics.event("failed", scrub_secrets(f"{kind.__name__}: {error}")[:2000])
            elif self.training is not None:
                result = self.training.result()
                self.metrics.event(
                    "done", f"{result.outer_steps} outer steps, {result.tokens} tokens, "
                    f"eval loss {result.eval_loss}",
                )  # fmt: skip
        self.close()


def join(
    config: str | Path | RunConfig | None = None,
    *,
    replica_id: str | None = None,
    replica_index: int | None = None,
    platform: str | None = None,
) -> Replica:
    """This process's replica: whatever is not given comes from what ``diloco launch`` set in
    the environment (``DILOCO_REPLICA_ID``, ``DILOCO_REPLICA_INDEX``, ``DILOCO_PLATFORM``, the
    published run.toml), else run.toml is the file ``config`` names and the data shard the
    id's trailing number. Errors say what is missing and where to give it."""
    from diloco_anywhere import replica as entrypoint  # the launcher's contract lives there

    environ = dict(os.environ)
    if isinstance(config, RunConfig):
        loaded = entrypoint.with_overrides(config, environ)
    else:
        loaded = entrypoint.configuration(None if config is None else str(config), environ)
    name, given = entrypoint.identity(replica_id, replica_index, environ)
    index = entrypoint.replica_index(name, given, loaded.run.replicas)
    platform = platform or environ.get(entrypoint.ENV_PLATFORM, "local")
    replica = Replica(loaded, name, index, platform)
    if environ.get(ENV_JOINED):  # a [task] command: its entrypoint passes stops on
        signal.signal(signal.SIGTERM, raise_stopped)
        report(JOINED)
    return replica

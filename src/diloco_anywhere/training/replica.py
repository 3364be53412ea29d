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
``contract.py``) or takes them as arguments; the replica then claims its membership in the
bucket, and its metrics (``started``, ``done``, ``failed``, ``stopped`` events) go to the run's
store. ``diloco`` wraps torchft's own ``DiLoCo`` over the bucket-backed manager, with the
fragments, outer optimizers, codec and checkpoints run.toml gives, heals the replica to the
run's state first, and says where its data resumes. The built-in loop (``loop.train``) is
written on this API. Under ``torchrun`` (a replica of several processes), rank 0 alone talks
to the bucket (``replica_group.py``), or, with ``sharding = "fsdp"``, every rank for its own
shard (``sharding.py``); ``replica.parallelize(model)`` wraps the model to match.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import TracebackType

import torch
from torch import nn

from diloco_anywhere import contract
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.redaction import scrub_secrets
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.members.membership import SupersededError, run_hopeless
from diloco_anywhere.config import ConfigError, RunConfig
from diloco_anywhere.data.source import DataUse
from diloco_anywhere.data.stream import Stream
from diloco_anywhere.data.tokenizers import ByteTokenizer, HfTokenizer, load_tokenizer
from diloco_anywhere.task import TaskContext
from diloco_anywhere.training.builders import (
    build_parts,
    parallelize,
    resolve_device,
    task_context,
)
from diloco_anywhere.training.checkpoints.commits import committed_rounds, retained_after
from diloco_anywhere.training.command import DONE, JOINED, report
from diloco_anywhere.training.mistakes import (
    RunCannotGoOnError,
    ScriptMistakeError,
    stop_if_hopeless,
)
from diloco_anywhere.training.mistakes.outside_diloco import OutsideDilocoWatch
from diloco_anywhere.training.mistakes.replica_index import take_index
from diloco_anywhere.training.mistakes.script_end import end_at_exit, end_with
from diloco_anywhere.training.pacing.pace import Pacer
from diloco_anywhere.training.ranks.replica_group import ReplicaGroup
from diloco_anywhere.training.ranks.sharding import Sharding, check_sharded, check_sharding
from diloco_anywhere.training.records.metrics import MetricsWriter
from diloco_anywhere.training.state.export_files import add_export_file
from diloco_anywhere.training.state.initial_state import check_initial_state
from diloco_anywhere.training.state.parameter_names import uncompiled
from diloco_anywhere.training.training import Training

log = logging.getLogger(__name__)


class StopRequestedError(BaseException):
    """SIGTERM arrived: ``diloco stop``, or the platform preempting or evicting the job. A
    ``BaseException``, as ``KeyboardInterrupt`` is: a training loop's ``except Exception``
    must not swallow a stop."""


def raise_stopped(signum: int, _frame: object) -> None:
    """The SIGTERM handler of a replica: the stop becomes an error that unwinds training, so
    that leaving the ``Replica`` records it. Once: a stop may arrive twice (the platform
    signals the process group, the entrypoint passes it on), and a second one must not cut
    the recording of the first short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    name = signal.Signals(signum).name
    raise StopRequestedError(f"stopped by {name} (diloco stop, or the platform)")


def _stops_are_errors() -> None:
    """Have SIGTERM raise ``StopRequestedError`` in this process, unless the script set a
    handler of its own (or this is not the main thread, where handlers cannot be set)."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, raise_stopped)


def _stop_if_hopeless(store: Store, layout: RunLayout, config: RunConfig) -> Callable[[], None]:
    """What a replica waiting for the others' votes (``bucket/agreement.py``) checks: it stops
    (``RunCannotGoOnError``) once those that stopped for good leave too few for any round."""
    return stop_if_hopeless(
        lambda: run_hopeless(store, layout, config.run.replicas, config.run.min_replicas),
        "waiting for the others to agree on what every replica starts with",
    )


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
            sharded=config.run.sharding == "fsdp",
        )
        self.device = resolve_device(config.task.device, self.group.local_rank)
        self.pacer = Pacer(config.diloco)  # its steps per round, which its data follows
        self.data_use = DataUse()  # whether it opened the run's data (status notes if not)
        self.collective: BucketCollective | None = None
        self.metrics: MetricsWriter | None = None
        self.training: Training | None = None
        self._started = self._ended = False  # ``start``; ``_end`` (once)
        # What was entered for the script where no `with` of its own holds it (``start``, the
        # Trainer's callback, hf_trainer.py): unwound with the script's error before the
        # replica records how it ended, as a `with` in the script would have been.
        self.contexts = ExitStack()
        self.electorate = config.electorate(index, replica_id)  # what it starts with is voted
        if self.group.is_leader or self.group.sharded:
            store, layout = Store(config.store_url()), RunLayout(config.run.name)
            self.electorate = replace(
                self.electorate, check=_stop_if_hopeless(store, layout, config)
            )
            keep = config.checkpoint.keep
            self.collective = BucketCollective(
                store, layout.run, replica_id, config.collective_config(),
                retained_after=lambda: retained_after(store, layout, keep),  # healing replays
                rank=self.group.rank if self.group.sharded else 0,
                on_superseded=self._superseded, joined=self.electorate.since,
            )  # fmt: skip
        # joined: until ``diloco``, an optimizer stepping outside DiLoCo is stopped (a Trainer
        # given no DilocoCallback), not left to train alone for days
        self.outside = OutsideDilocoWatch(config.diloco.round_steps)
        if self.group.is_leader:
            incarnation = self.collective.me.incarnation  # type: ignore[union-attr]
            self.metrics = MetricsWriter(store, layout, replica_id, incarnation, platform)
            self._admit(store, layout)

    def _admit(self, store: Store, layout: RunLayout) -> None:
        """Refuse, at once, to run beside another running replica given the same data shard
        index (``replica_index.py``), then with a sharding unlike the run's (decided by the
        replicas' votes, which may wait for the others: a duplicate must not wait with them).
        Whatever ends the replica here ends it as it would in training (``_end``): recorded,
        and a mistake's departure final, so rounds that cannot reach ``min_replicas`` without
        it fail at once (``collective/members/departures.py``), with the mistake's exit code."""
        assert self.collective is not None
        try:
            take_index(self.collective, self.index, self.config.run.replicas)
            check_sharding(store, layout, self._sharding(), self.electorate)
        except BaseException as refused:
            self._end(refused)
            raise

    @property
    def total_steps(self) -> int:
        """The inner steps each replica trains over the whole run (``outer_steps x
        sync_every``, ``DilocoSection.total_steps``): what a learning-rate schedule spans."""
        return self.config.diloco.total_steps

    def _superseded(self, error: SupersededError) -> None:
        """A newer incarnation of this replica is running (a platform restarted it while this
        process lived on): end this process now, from the heartbeat's thread, whatever the
        training thread is doing, so that it writes nothing more to the run (no round, no
        checkpoint). Under ``torchrun`` the other ranks are torn down with it."""
        print(f"replica {self.replica_id}: {error}", file=sys.stderr, flush=True)
        if self.metrics is not None:
            self.metrics.last_word("superseded", str(error))
        os._exit(contract.EXIT_SUPERSEDED)

    def _sharding(self) -> Sharding:
        """What this replica exchanges, which every replica of the run must match."""
        if self.group.sharded:
            return Sharding(sharding="fsdp", ranks=self.group.world_size)
        return Sharding(sharding="ddp", ranks=1)

    def parallelize(self, model: nn.Module) -> nn.Module:
        """The module to run the inner steps through, as run.toml's ``[run] sharding`` and the
        replica's processes say: ``model`` sharded in place with FSDP2 (``fsdp``), wrapped in
        DDP (``ddp``, several processes), or ``model`` itself. Call it before building the
        inner optimizer, and pass ``model`` (not the wrapper) to ``diloco``."""
        return parallelize(model, self.group)

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
        step of this process trains on (times the replica's processes, it weighs the replica's
        contribution). ``evaluate(model)``: the held-out loss of ``model``, every
        ``task.eval_every`` outer steps, inside the ``step()`` that synced: on rank 0, or on
        every rank of a sharded replica (each forward gathers every rank's shards). On exit
        every process of an unsharded replica checks it holds rank 0's global state."""
        self.outside.stop()
        check_sharded(model, self.group)
        if self.collective is not None:
            self._check_initial_model(model)
        parts = build_parts(
            self.config, self.collective, uncompiled(model), inner_optimizer, tokens_per_step,
            evaluate, self.group,
        )  # fmt: skip
        training = Training(
            parts, self.collective, self.metrics, self.group, self.pacer, self.data_use
        )
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
        with parts.diloco() as diloco:
            training.begin(diloco, parts.global_state())
            hook = inner_optimizer.register_step_post_hook(
                lambda *_: training.after_inner_step(model)
            )
            try:
                yield training
            finally:
                hook.remove()
            if not self.group.sharded:  # each rank holds its own shard, fingerprinted together
                self.group.check_same_state(training.state.checksum())
        training.close()
        self.training = training

    def start(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        tokens_per_step: int = 1,
        evaluate: Callable[[nn.Module], float] | None = None,
    ) -> Training:
        """``diloco``'s training, entered without a ``with`` (in ``contexts``), for a loop that
        stays as it is (no re-indenting): ``finish()`` ends it. A replica that never calls
        ``finish`` is finished anyway: an error the script does not catch (a stop's included)
        is recorded before Python prints it (``sys.excepthook``), and a normal end when the
        main thread ends, so its end is in the run's metrics either way (``script_end.py``)."""
        if self._started or self._ended:
            raise RuntimeError("replica.start(...) was called already: once per replica")
        training = self.contexts.enter_context(
            self.diloco(model, inner_optimizer, tokens_per_step=tokens_per_step, evaluate=evaluate)
        )
        self._started = True
        end_with(self)
        end_at_exit(self)
        return training

    def finish(self) -> None:
        """End what ``start`` began and leave the run, recording how (``done`` once the run's
        outer steps are committed): as leaving ``with join() as replica`` does."""
        self.__exit__(None, None, None)

    def stream(
        self, seq_len: int, batch_sequences: int,
        tokenizer: str | ByteTokenizer | HfTokenizer | None = None,
    ) -> Stream:  # fmt: skip
        """run.toml's ``[task] data`` as this process's share of the run's one order of it
        (docs/data.md): pass ``stream.batches`` to ``training.batches``; each batch is a
        ``[batch_sequences, seq_len + 1]`` tensor of token ids. Its units are claimed in the
        bucket at each round, so no sequence is trained twice or skipped whatever the
        replicas do; ``stream.evaluation(n)`` gives held-out batches, the same on every
        replica. ``tokenizer`` (``bytes``, a Hugging Face tokenizer's name, or one loaded:
        ``data/tokenizers.py``): raw text is prepared with it, and a prepared corpus must have
        been."""
        loaded = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        return self.task_context().stream(seq_len, batch_sequences, loaded)

    def task_context(self) -> TaskContext:
        """What a task's ``build`` is told of this replica (``builders.task_context``): its
        data claimed through the run's bucket, following its pace."""
        return task_context(
            self.config, self.index, self.group, self.collective, self.pacer, self.data_use
        )

    def add_to_export(self, name: str, text: str) -> None:
        """A file ``diloco export`` writes beside the weights (``export_files.py``): what
        loading them needs with no code of yours, e.g. a model's ``config.json`` for
        ``from_pretrained`` (``DilocoCallback`` adds a Hugging Face model's). Recorded by the
        replica's first process; every replica may add the same text."""
        if self.collective is not None and self.group.is_leader:
            add_export_file(self.collective.store, RunLayout(self.config.run.name), name, text)

    def _check_initial_model(self, model: nn.Module) -> None:
        """Before the run's first checkpoint, this replica's model must be the run's: the one
        its first replica recorded (``initial_state.py``). After it, healing replaces it."""
        store = self.collective.store  # type: ignore[union-attr]
        if not committed_rounds(store, RunLayout(self.config.run.name)):
            check_initial_state(store, self.collective.layout, model, self.electorate)  # type: ignore[union-attr]

    def close(self, wait: bool = True, reason: str = "", final: bool = False) -> None:
        """Leave the run; with ``wait``, first let rounds in flight finish (after an error or
        a stop they are abandoned: the bucket's lifecycle rule expires their objects).
        ``reason``, ``final``: how it left, for the others
        (``collective/members/departures.py``)."""
        if self.collective is not None:
            self.collective.close(wait=wait, reason=reason, final=final)

    def __enter__(self) -> Replica:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Unwind ``contexts`` with the script's error, then record how the replica ended; an
        error raised while unwinding them is the replica's end, recorded and raised."""
        try:
            self.contexts.__exit__(kind, error, traceback)
        except BaseException as unwinding:
            self._end(unwinding)
            raise
        self._end(error)

    def _end(self, error: BaseException | None) -> None:
        """Record how the replica ended (``done`` with what it trained, ``stopped``, ``failed``
        with the error, or with how far it got if it left training early), then leave the
        run. ``sys.exit(0)`` is a normal end. A script's mistake (``mistakes.py``) then ends
        the process with its own exit code, which no platform retries. Once: ``finish``, the
        ``with`` and the exit hooks of ``start`` may each come here."""
        if self._ended:
            return
        self._ended = True
        self.outside.stop()
        if isinstance(error, SystemExit) and error.code in (None, 0):
            error = None
        trained = error is None and self.training is not None and self.training.done
        if trained:
            report(DONE)
        event, detail = self._ending(error, trained)
        if self.metrics is not None:
            self.metrics.flush()
            reached = self.training.result().outer_steps if self.training is not None else None
            self.metrics.event(event, detail, outer_step=reached)
        refused = isinstance(error, ScriptMistakeError | ConfigError)  # a restart meets it too
        final = refused and not isinstance(error, RunCannotGoOnError)  # the others' doing
        self.close(wait=error is None, reason=f"{event}: {detail}", final=final)
        if refused:  # said, and an exit code no platform retries
            print(f"error: replica {self.replica_id}: {error}", file=sys.stderr, flush=True)
            code = error.exit_code if isinstance(error, ScriptMistakeError) else None
            raise SystemExit(code or contract.EXIT_BAD_CONFIG) from error

    def _ending(self, error: BaseException | None, trained: bool) -> tuple[str, str]:
        """The event that says how the replica ended, and its detail."""
        if isinstance(error, StopRequestedError):
            return "stopped", str(error)
        if isinstance(error, SupersededError):  # seen in a round before the heartbeat saw it
            return "superseded", str(error)
        if error is not None:
            return "failed", scrub_secrets(f"{type(error).__name__}: {error}")[:2000]
        if self.training is None:
            return "failed", "left the run without training (no `with replica.diloco(...)`)"
        result = self.training.result()
        if not trained:
            outer_steps = self.config.diloco.outer_steps
            return "failed", f"left training at outer step {result.outer_steps} of {outer_steps}"
        detail = f"{result.outer_steps} outer steps, {result.tokens} tokens"
        return "done", f"{detail}, eval loss {result.eval_loss}"


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
    environ = dict(os.environ)
    if isinstance(config, RunConfig):
        loaded = contract.with_overrides(config, environ)
    else:
        loaded = contract.configuration(None if config is None else str(config), environ)
    name, given = contract.identity(replica_id, replica_index, environ)
    index = contract.replica_index(name, given, loaded.run.replicas)
    platform = platform or environ.get(contract.ENV_PLATFORM, "local")
    replica = Replica(loaded, name, index, platform)
    end_with(replica)  # an error the script does not catch, wherever: the replica's end
    _stops_are_errors()
    report(JOINED)  # to the entrypoint that started this script, if one did
    return replica

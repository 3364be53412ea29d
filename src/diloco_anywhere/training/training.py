"""``Training``: one replica training under torchft's DiLoCo, as ``Replica.diloco`` yields it.

The training loop is a plain PyTorch loop; DiLoCo hooks the inner optimizer's ``step`` and
syncs a fragment every ``sync_every / fragments`` inner steps (arXiv 2311.08105 algorithm 1;
Streaming DiLoCo, arXiv 2501.18512, for fragments > 1). After each sync the replica records a
``sync`` line (and the held-out loss at the new global weights when the sync committed), so a
run's metrics live in its bucket whatever platform ran it; checkpoints and healing are the
other after-sync steps (``after_sync.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torchft.local_sgd import DiLoCo

from diloco_anywhere.bucket.redaction import scrub_secrets
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.errors import DivergedError, RoundHopelessError
from diloco_anywhere.collective.members.membership import SupersededError
from diloco_anywhere.collective.records import MAX_PACE_SECONDS, Pace
from diloco_anywhere.data.source import DataUse
from diloco_anywhere.task import Batch
from diloco_anywhere.training.builders import ReplicaParts
from diloco_anywhere.training.fixed_rng import fixed_random_state
from diloco_anywhere.training.mistakes import NotSyncingError, RunCannotGoOnError
from diloco_anywhere.training.pacing.pace import Pacer
from diloco_anywhere.training.ranks.replica_group import ReplicaGroup
from diloco_anywhere.training.ranks.sharding import reshard
from diloco_anywhere.training.records.log_window import LogWindow
from diloco_anywhere.training.records.metrics import MetricsWriter, StepLine, SyncLine
from diloco_anywhere.training.recovery.after_sync import GlobalCheckpoints, heal_replica
from diloco_anywhere.training.recovery.own_state import OwnState
from diloco_anywhere.training.state.global_state import GlobalState

log = logging.getLogger(__name__)
OWN_DATA = (
    "the script trains on data of its own, not run.toml's [task] data: the run claims none of "
    "it (no epoch coverage in diloco report), and a restart or a heal reads it where the "
    "script does"
)

MAX_FAILED_SYNCS = 5  # in a row; then the replica stops with the last error


class SyncFailedError(RuntimeError):
    """Syncs kept failing; the message carries the last error."""


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
        pacer: Pacer | None = None,
        data_use: DataUse | None = None,
    ) -> None:
        """``pacer``: the replica's steps per round, which its data follows too (the same
        one: ``Replica.pacer``); ``data_use``: whether the replica opened the run's data,
        said at its first sync (None: not known, nothing said)."""
        self.config, self.manager, self.evaluate = parts.config, parts.manager, parts.evaluate
        self.parts, self.collective, self.metrics, self.group = parts, collective, metrics, group
        self.pacer = pacer or Pacer(self.config.diloco)
        self.data_use = data_use
        self.diloco: DiLoCo | None = None  # torchft's, once entered (``begin``)
        self.round_started = time.perf_counter()  # training time of the round counts from here
        self.sent_pace: Pace | None = None  # how the round's contribution was trained
        self._behind: str | None = None
        self.inner_steps = self.tokens = self.failed_in_a_row = 0
        self.start_step = 0  # the inner step the data resumes at: set by every heal
        self.heals = 0
        self.state: GlobalState | None = None  # once DiLoCo is built
        self._syncs_seen = self._step_seen = 0
        self._healed_in_step = False
        self.loss = float("nan")
        self._window = LogWindow(self.config.task.log_every)
        self._batches_since_step = 0  # batches given out since the last inner step
        self.eval_loss: float | None = None
        self.tokens_at_sync, self.time_at_sync = 0, time.perf_counter()
        self.checkpoints = GlobalCheckpoints(self.config, collective, group, self._report)
        # a single-process replica's own state (inner optimizer, generators, local weights),
        # unless run.toml turns it off; not a replica of several processes, whose ranks each
        # hold theirs (docs/checkpoints.md)
        self.own_state = (
            OwnState(
                self.config, collective.store, collective.layout, collective.me.replica,
                parts.model, parts.inner, parts.fragments,
            )
            if collective is not None and group.world_size == 1 and self.config.checkpoint.own_state
            else None
        )  # fmt: skip

    def _report(self, detail: str) -> None:
        """A mirror that failed, into the run's metrics (``diloco status`` shows it)."""
        if self.metrics is not None:
            self.metrics.event("mirror_failed", detail[:2000])

    def _evaluation_due(self) -> bool:
        """Every ``eval_every`` outer steps (all fragments synced), and at the last one."""
        every, fragments = self.config.task.eval_every, self.config.diloco.fragments
        step, last = self.manager.current_step(), self.config.diloco.last_step
        return bool(self.evaluate and every) and (step % (every * fragments) == 0 or step == last)

    @property
    def done(self) -> bool:
        """Every fragment has committed the run's ``outer_steps`` syncs."""
        return self.manager.current_step() >= self.config.diloco.last_step

    @property
    def run_step(self) -> int:
        """The run's inner step this replica is at, which a learning-rate schedule follows: its
        own step with ``pace = "steps"``; paced by time, where its round is at the reference
        pace (its k-th step of n is k/n of ``round_steps`` into the round), so that every
        replica's schedule is at the run's point whatever its speed."""
        span, reference = self.pacer.span(self.inner_steps), self.config.diloco.round_steps
        into = (self.inner_steps - span.first_step) * reference // span.steps
        return span.round * reference + into

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
                    f"{self.config.diloco.total_steps}: "
                    f"open_at(start) must go on until the run ends (loop over epochs)"
                ) from None
            self._check_stepping()
            yield batch

    def steps(self) -> Iterator[int]:
        """The inner step the run is at, once per inner step, from ``start_step`` until
        ``done``: for a loop that draws its own data (``for step in training.steps():`` in
        place of ``for step in range(total)``), which it must draw by this number, so that a
        replica that heals (the number jumps to the healed round's) trains what the others
        expect."""
        while not self.done:
            self._check_stepping()
            yield self.inner_steps

    def _check_stepping(self) -> None:
        """A batch more with no inner step since the last one: more than ``max(4 x sync_every,
        64)`` of them (room for gradient accumulation and skipped fp16 steps) means the script
        steps another optimizer, or none. ``steps`` counts its turns the same way."""
        self._batches_since_step += 1
        limit = max(4 * self.config.diloco.sync_every, 64)
        if self._batches_since_step > limit:
            raise NotSyncingError(
                f"{self._batches_since_step - 1} turns of training.batches (or training.steps) "
                f"since inner step {self.inner_steps}, and the optimizer given to replica.diloco"
                f" (or replica.start) took no step: call step() on that same optimizer (DiLoCo "
                f"syncs inside it), not on another one or a copy"
            )

    def log(self, loss: torch.Tensor | float, **values: torch.Tensor | float) -> None:
        """The inner step's loss and any numbers of the script's own (``lr=...``), at any
        cadence: the run's metrics get their mean over each ``task.log_every`` window of inner
        steps (``log_window.py``; ``diloco status``, ``diloco report``). Names as run names are
        written; at most ``metrics.MAX_VALUES`` of them. The loss of a step whose sync healed
        the replica is not recorded: its step count is the healed position's, not the step's."""
        healed, self._healed_in_step = self._healed_in_step, False
        if healed or self.metrics is None:
            return
        self._window.add(loss, values)
        if self._window.due(self.inner_steps):
            self.loss, means = self._window.close(self.inner_steps)
            self.metrics.add(StepLine(
                step=self.inner_steps, loss=self.loss, tokens=self.tokens, time=time.time(),
                values=means,
            ))  # fmt: skip

    def after_inner_step(self, model: nn.Module) -> None:
        """Count the step; after a sync (DiLoCo's step hook ran one), record it, write the
        checkpoint when due, heal after a divergence and give up after too many failures."""
        self.inner_steps += 1
        self._batches_since_step = 0
        self.tokens += self.parts.tokens_per_step * self.group.world_size
        manager = self.manager
        if manager.syncs_attempted == self._syncs_seen:
            return
        committed = manager.current_step() > self._step_seen
        self._syncs_seen, self._step_seen = manager.syncs_attempted, manager.current_step()
        synced = self.pacer.span(self.inner_steps - 1).round  # a follower sends no round
        self.record_sync(committed, model, synced)
        if committed:
            self.checkpoints.write_if_due(self.manager, self.state)  # type: ignore[arg-type]
            if self.own_state is not None:
                self.own_state.save_if_due(self.manager)
        if isinstance(manager.last_sync_error, SupersededError):  # a zombie trains no further
            raise manager.last_sync_error
        if isinstance(manager.last_sync_error, RoundHopelessError):  # no round can seal again
            raise RunCannotGoOnError(str(manager.last_sync_error))
        self._plan_rounds(synced, committed)
        if isinstance(manager.last_sync_error, DivergedError):  # the same on every rank
            self.after_divergence(self.state)  # type: ignore[arg-type]
            self._healed_in_step = True
        self.stop_if_failing()

    def _say_if_the_data_is_the_script_s(self) -> None:
        """At the first sync of this process, an ``own_data`` event if the script has not
        opened the run's data by then: it trains on data of its own, which the run claims none
        of (``diloco status`` says so)."""
        if self.data_use is not None and not self.data_use.opened:
            self.metrics.event("own_data", OWN_DATA)  # type: ignore[union-attr]
        self.data_use = None  # said once

    def record_sync(self, committed: bool, model: nn.Module, synced: int) -> None:
        """The sync's line in the metrics (rank 0), with the held-out loss when due: every rank
        of a sharded replica evaluates (each forward gathers the shards of all), rank 0 alone
        of any other. ``synced`` is the round this sync ended (the pacer's count)."""
        self.failed_in_a_row = 0 if committed else self.failed_in_a_row + 1
        evaluated = committed and self._evaluation_due()
        if evaluated and (self.metrics is not None or self.group.sharded):
            self.eval_loss = self.evaluate_global_weights(model)
        if self.metrics is None:
            return
        self._say_if_the_data_is_the_script_s()
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
                inner_steps=self.inner_steps,
                tokens_per_second=(self.tokens - self.tokens_at_sync) / (now - self.time_at_sync),
                sync_exposed_seconds=self.manager.exposed_seconds,
                round_steps=self.pacer.steps(synced),
                step_seconds=self.sent_pace.step_seconds if self.sent_pace else None,
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
        leaves FSDP2's root unsharded, and its unsharded parameters are what it holds then).
        It runs under the run's seed (``fixed_rng.py``): the same weights, the same number."""
        streaming = self.config.diloco.fragments > 1 and self.state is not None
        swap = self.state.global_weights_in_place() if streaming else nullcontext()  # type: ignore[union-attr]
        device = next(model.parameters()).device
        with swap, fixed_random_state(self.config.run.seed, device):
            try:
                return self.evaluate(model)  # type: ignore[misc]
            finally:
                if self.group.sharded:
                    reshard(model)

    def heal(self, state: GlobalState, *, from_initial: bool) -> int:
        """Bring the global state to the run's newest sealed round (``after_sync.heal_replica``)
        and, joining (``from_initial``), the replica's own state back to where it was saved
        (``own_state.py``; after a divergence its own state is current, but its error
        feedback, built on the weights it left, starts from zero); the inner step the data
        resumes at (``start_step``), numbered as the reference pace would (``round_steps`` a
        round), where the replica's pace starts again."""
        heal_replica(
            self.collective, state, self.manager, self.group, self.checkpoints, self.metrics,
            min_replicas=self.config.run.min_replicas, from_initial=from_initial,
        )  # fmt: skip
        if from_initial and self.own_state is not None:
            self._resume_own_state(self.own_state)
        if not from_initial and self.manager.feedback is not None:
            log.info("error feedback from zero: the replica healed onto other global weights")
            self.manager.feedback.clear()
        self.parts.apply_outer_hyperparameters()
        sync = self.manager.state_dict()["sync"]
        self.inner_steps = sync * self.config.diloco.round_steps
        self.tokens = self.inner_steps * self.parts.tokens_per_step * self.group.world_size
        self.tokens_at_sync, self.time_at_sync = self.tokens, time.perf_counter()
        self._syncs_seen = self.manager.syncs_attempted
        self._step_seen = self.manager.current_step()
        self.start_step, self.heals = self.inner_steps, self.heals + 1
        self.pacer.start(sync, self.inner_steps)
        self._start_round(sync)
        return self.start_step

    def begin(self, diloco: DiLoCo, state: GlobalState) -> None:
        """Train under torchft's ``diloco`` (entered), whose global state is ``state``: healed
        to the run's, each contribution carrying how it was trained (``Pace``)."""
        self.diloco, self.state = diloco, state
        self.manager.pace = self._pace_of_round
        self.manager.before_state_changes = self.checkpoints.release
        self.heal(state, from_initial=True)

    def _start_round(self, round_: int) -> None:
        """Round ``round_`` begins: DiLoCo syncs after the steps the pace planned for it
        (torchft's DiLoCo takes ``sync_every`` per instance: its maintainers' answer to
        replicas of unlike speed, torchft PR 233), the contribution weighs the tokens they
        train on, and the round's training time counts from now."""
        steps = self.pacer.steps(round_)
        if self.diloco is not None:
            self.diloco._sync_every = steps
        self.manager.set_weight(self.parts.tokens_per_step * steps * self.group.world_size)
        self.round_started = time.perf_counter()

    def _pace_of_round(self) -> Pace:
        """What the manager sends with the round's contribution: the inner steps DiLoCo counted
        in the round so far, and the seconds since it began (the previous sync's waiting, its
        evaluation and checkpoint are before that)."""
        steps = self.diloco._local_step if self.diloco is not None else 0
        seconds = min(time.perf_counter() - self.round_started, MAX_PACE_SECONDS)
        self.sent_pace = Pace(steps, seconds)
        return self.sent_pace

    def _plan_rounds(self, synced: int, committed: bool) -> None:
        """After round ``synced``: a later round's steps (decided by the leader from the paces
        the round was sealed with; its other ranks take the same), then the next round."""
        if self.pacer.timed:
            result = self.manager.last_result if committed else None
            sealed = result.paces if result is not None else {}
            me = self.collective.me.name if self.collective is not None else ""
            leader = self.group.is_leader
            plan = self.pacer.decide(synced, self.sent_pace, sealed, me) if leader else None
            self.pacer.apply(self.group.broadcast(plan))
            self._say_if_behind()
        self._start_round(synced + 1)  # a heal after a divergence starts its own

    def _say_if_behind(self) -> None:
        """When a replica falls behind the round's length, a ``behind`` event in the metrics,
        which ``diloco status`` shows until a ``caught_up`` event says it keeps up again."""
        behind, was = self.pacer.behind(), self._behind
        self._behind = behind
        if (behind is None) == (was is None):
            return
        if behind is not None:
            log.warning("this replica holds the rounds up: %s", behind)
        else:
            log.info("this replica keeps up with the rounds again")
        if self.metrics is not None:
            self.metrics.event(*(("behind", behind[:2000]) if behind else ("caught_up", "")))

    def _resume_own_state(self, own_state: OwnState) -> None:
        """Load the replica's own state saved before it stopped, recorded as a ``resumed``
        event saying whether it is exact; a replica with none starts it fresh, as a new one."""
        resumed = own_state.resume(self.manager)
        if resumed is not None:
            log.info("%s", resumed)
            if self.metrics is not None:
                self.metrics.event("resumed", resumed)

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
        """The last checkpoint is committed, and the own state saved, before the replica
        reports done (written here if nobody did: ``write_last_if_missing``)."""
        if self.done and self.state is not None:
            self.checkpoints.write_last_if_missing(self.manager, self.state)
        self.checkpoints.close()
        if self.own_state is not None:
            self.own_state.close()

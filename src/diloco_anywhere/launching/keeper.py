"""Keep a run going with nobody watching: ``diloco keep``, one reconciliation pass.

Every platform's own retries and limits are finite (Modal's 24 h timeout and a few retries, HF
Jobs' timeout, SageMaker's max runtime), so a run of days loses replicas unless something
starts them again. The keeper is that something, with no server: a pass reads the newest
launch and its replicas' leases from the bucket and each platform's job states, decides for
every replica, acts, and is done. Run it from anywhere (a scheduled workflow, a cron job, a
laptop), as often as you like, several at once: every action starts with a create-only record
in the bucket, so of two keepers that decide alike exactly one acts.

Per replica, from its newest attempt (``launches.py``):

- stopped on purpose, done, pending, or running with its lease advancing: left alone;
- ended (failed, timed out, stopped or deleted by its platform, exited before the run was
  done), or running with a lease silent for ``[keep] hung_after`` (hung): started again on
  its platform with the same id and data shard, as a new incarnation, which heals from the
  bucket and supersedes any old process still alive (docs/collective.md, "Membership");
- after a quick end, the restart waits, doubling with each quick end in a row up to
  ``max_backoff`` (Kubernetes' crash-loop backoff); ``max_restarts`` per replica bounds
  restarts that are not planned (an attempt that hit its platform's time limit is planned);
- refused its run.toml (exit 2): not restarted, since it would fail again; said so.

Per run: once a checkpoint commits the last outer step, or the spend reaches ``[budget]``, the
keeper ends the launch (a create-only ``END``) and stops every replica still going. Times are
the store's: a pass reads the store's clock from an object it writes, and compares it with the
times the store gave the records, never with another machine's clock.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from diloco_anywhere import published_config
from diloco_anywhere.backends import get_backend
from diloco_anywhere.backends.base import (
    ACTIVE_STATES,
    Backend,
    JobState,
    ReplicaHandle,
    ReplicaSpec,
    one_line,
)
from diloco_anywhere.bucket.layout import Participant, RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.membership import MembershipView
from diloco_anywhere.collective.policy import LeasePolicy
from diloco_anywhere.config import ConfigError, KeepSection, RunConfig
from diloco_anywhere.contract import EXIT_BAD_CONFIG, EXIT_SUPERSEDED
from diloco_anywhere.launching.alerts import Alert, Alerts
from diloco_anywhere.launching.cost_so_far import Spend, over_budget
from diloco_anywhere.launching.health import health_alerts
from diloco_anywhere.launching.launch import job_state, plan_launch, run_dir
from diloco_anywhere.launching.launches import (
    EndRecord,
    JobRecord,
    Launch,
    Launches,
    RestartRecord,
)
from diloco_anywhere.launching.spending import launch_spend, spend_shown
from diloco_anywhere.launching.status import replica_statuses
from diloco_anywhere.launching.status_page import (
    PageFacts,
    publish,
    render_page,
    status_document,
)
from diloco_anywhere.training.checkpoints.commits import committed_rounds, read_commit
from diloco_anywhere.training.checkpoints.records import CheckpointError
from diloco_anywhere.training.metrics import MetricsReader, ReplicaMetrics

log = logging.getLogger(__name__)
# A keeper claimed an attempt but its job is not recorded: it is still being started (SageMaker
# takes a minute), or the keeper died meanwhile. Past this, the attempt counts as lost.
LAUNCH_GRACE = 600.0
PAGE_ALERTS = 20  # the newest alerts the status page lists


@dataclass(frozen=True)
class Observed:
    """One replica as a pass sees it; times are the store's."""

    replica_id: str
    platform: str
    attempt: int  # its newest attempt, started or being started
    job: JobRecord | None  # the newest started attempt's job
    state: JobState | None  # its platform's word on that job (None: no job)
    exit_code: int | None  # where the platform keeps it (local processes)
    stopped: bool  # its current job was stopped on purpose
    claim: RestartRecord | None  # the keeper's claim that started (or starts) the newest attempt
    claimed_at: float | None  # when that claim was written
    started_at: float  # when its current attempt began: its job record, else the launch
    active_at: float | None  # its newest incarnation's last sign of life: lease, else claim
    done: bool  # its newest incarnation said the run is done

    @property
    def last_alive(self) -> float:
        """Its current attempt's last sign of life: its newest lease, else when it started."""
        return max(self.started_at, self.active_at or self.started_at)


@dataclass(frozen=True)
class Decision:
    """What a pass does for one replica. ``action``: leave, wait, restart, or give_up."""

    action: str
    reason: str  # why its last attempt ended (restart, wait, give_up) or what it is doing
    detail: str = ""
    counted: int = 0  # restarts the budget counts, this one included
    streak: int = 0  # quick ends in a row, this one included
    stop_first: bool = False  # a hung job: stopped before the next starts


def backoff(keep: KeepSection, streak: int) -> float:
    """Seconds to wait before restarting after ``streak`` quick ends in a row."""
    return 0.0 if streak == 0 else min(keep.backoff * 2 ** (streak - 1), keep.max_backoff)


def _ended(replica: Observed, now: float) -> tuple[str, str] | None:
    """Why the replica's newest attempt has ended (reason, detail); None while it may run."""
    if replica.claim and (replica.job is None or replica.claim.attempt > replica.job.attempt):
        age = now - (replica.claimed_at or now)
        if age < LAUNCH_GRACE:
            return None
        return "lost", f"attempt {replica.claim.attempt} was claimed {age:.0f} s ago by " \
                       f"{replica.claim.host} and never started"  # fmt: skip
    if replica.job is None:
        if now - replica.started_at < LAUNCH_GRACE:
            return None
        return "lost", "the launch recorded no job for it"
    if replica.state in ACTIVE_STATES:
        return None
    code = f" (exit {replica.exit_code})" if replica.exit_code is not None else ""
    return str(replica.state), f"its {replica.platform} job {replica.state}{code}"


def decide(replica: Observed, now: float, keep: KeepSection) -> Decision:
    """The one action a pass takes for ``replica`` (``now``: the store's time)."""
    if replica.stopped:
        return Decision("leave", "stopped on purpose")
    if replica.done:
        return Decision("leave", "done")
    silent = now - replica.last_alive
    ended = _ended(replica, now)
    if ended is None:
        if replica.state != "running" or silent < keep.hung_after:
            return Decision("leave", replica.state or "being started")
        ended = "hung", f"running, but no sign of life for {silent:.0f} s"
    reason, detail = ended
    if replica.exit_code == EXIT_BAD_CONFIG:
        return Decision("give_up", reason, f"{detail}: it refused run.toml and would only fail "
                        f"again; fix it, then `diloco replace {replica.replica_id}`")  # fmt: skip
    if replica.exit_code == EXIT_SUPERSEDED:
        return Decision("leave", "superseded by a newer incarnation started elsewhere")
    ran = replica.last_alive - replica.started_at
    previous = replica.claim
    streak = (previous.streak if previous else 0) + 1 if ran < keep.stable_after else 0
    counted = (previous.counted if previous else 0) + (reason != "timed_out")
    if counted > keep.max_restarts:
        return Decision("give_up", reason, f"{detail}; out of restarts ([keep] max_restarts = "
                        f"{keep.max_restarts})")  # fmt: skip
    wait = backoff(keep, streak) - silent
    if wait > 0:
        said = f"{detail}; restarting in {wait:.0f} s (backoff)"
        return Decision("wait", reason, said, counted, streak)
    return Decision("restart", reason, detail, counted, streak, stop_first=reason == "hung")


def store_time(store: Store, layout: RunLayout) -> float:
    """The store's clock now: the time it gives an object this call writes (then deletes)."""
    key = layout.clock(uuid.uuid4().hex)
    store.put(key, b"")
    try:
        return store.modified(key)
    finally:
        store.delete(key)


def run_done(store: Store, layout: RunLayout, config: RunConfig) -> bool:
    """A checkpoint has committed the run's last outer step (every fragment's syncs)."""
    last = config.diloco.outer_steps * config.diloco.fragments
    for round_ in committed_rounds(store, layout):
        try:
            if read_commit(store, layout, round_)[0].step >= last:
                return True
        except CheckpointError as exc:
            log.warning("%s", exc)
    return False


@dataclass(frozen=True)
class Restarted:
    ok: bool  # its new job started
    note: str


@dataclass(frozen=True)
class PassReport:
    """What one pass saw and did: a line per replica, and what was said."""

    launch: int | None
    decisions: dict[str, Decision]
    notes: list[str]
    ended: str | None  # the launch's end, if it has one
    spend: Spend | None = None  # so far (an estimate: launching/cost_so_far.py)


class Keeper:
    """One run's keeper: ``pass_()`` reconciles once. ``run_folder``: where local replicas'
    logs go (``.diloco/<run>`` here); ``backends``: launchers already made (a follower's,
    which remember the processes they started)."""

    def __init__(
        self,
        config: RunConfig,
        store: Store,
        *,
        run_folder: Path | None = None,
        backends: dict[str, Backend] | None = None,
        say: Callable[[str], None] = log.info,
    ) -> None:
        self.config, self.store, self.say = config, store, say
        self.layout = RunLayout(config.run.name)
        self.launches = Launches(store, self.layout)
        self.metrics = MetricsReader(store, self.layout)
        self.run_folder = run_folder or run_dir(config)
        self.backends: dict[str, Backend] = dict(backends or {})

    def pass_(self, *, dry_run: bool = False) -> PassReport:
        """Reconcile once, then write the status page; ``dry_run``: decide, and act on
        nothing (no restart, no stop, no record, no alert, no page)."""
        numbers = self.launches.numbers()
        if not numbers:
            return PassReport(None, {}, [f"run {self.config.run.name} was never launched"], None)
        launch = self.launches.read(numbers[-1])
        alerts = Alerts(self.store, self.layout, launch.number, self.config.alerts)
        now = store_time(self.store, self.layout)
        launched_at = self.store.modified(self.layout.launch(launch.number))
        metrics = self.metrics.read()
        observed = self._observe(launch, metrics, launched_at)
        spent = self._spend(launch, observed, metrics)
        end = launch.end
        if end is None and not dry_run:
            hours = (now - launched_at) / 3600
            end = self._end_if_due(launch, alerts, over_budget(self.config.budget, spent, hours))
        if end is not None:
            notes = [] if dry_run else self._stop_all(launch, observed, end, now)
            report = PassReport(launch.number, {}, notes, f"{end.reason}: {end.detail}", spent)
        else:
            decisions = {r.replica_id: decide(r, now, self.config.keep) for r in observed}
            if dry_run:
                return PassReport(launch.number, decisions, [], None, spent)
            notes = self._reconcile(launch, observed, decisions, metrics, now, alerts)
            report = PassReport(launch.number, decisions, notes, None, spent)
        if not dry_run:
            self._publish(launch, observed, report, metrics, alerts)
        return report

    def _reconcile(
        self,
        launch: Launch,
        observed: list[Observed],
        decisions: dict[str, Decision],
        metrics: dict[str, ReplicaMetrics],
        now: float,
        alerts: Alerts,
    ) -> list[str]:
        """Act on every replica's decision, then on the run's health; what was said."""
        notes = []
        for replica in observed:
            notes += self._act(launch, replica, decisions[replica.replica_id], alerts)
        for alert in self._health(observed, metrics, now):
            if alerts.send(alert):
                notes.append(alert.text)
        return notes

    def _spend(
        self, launch: Launch, observed: list[Observed], metrics: dict[str, ReplicaMetrics]
    ) -> Spend:
        running = {r.replica_id for r in observed if r.state in ACTIVE_STATES}
        return launch_spend(self.launches, self.config, launch, metrics, running.__contains__,
                            lambda platform: self._backend(platform).hardware())  # fmt: skip

    def _publish(
        self,
        launch: Launch,
        observed: list[Observed],
        report: PassReport,
        metrics: dict[str, ReplicaMetrics],
        alerts: Alerts,
    ) -> None:
        """The status page and status.json in the run's prefix, for anyone with the bucket.
        Job states are this pass's; only a job it started is asked about again."""
        restarted = any(d.action == "restart" for d in report.decisions.values())
        launch = self.launches.read(launch.number) if restarted else launch
        seen = {(r.replica_id, r.job.attempt): r.state for r in observed if r.job}

        def state(handle: ReplicaHandle) -> JobState:
            known = seen.get((handle.replica_id, launch.jobs[handle.replica_id].attempt))
            return known or job_state(self._backend(handle.platform), handle)

        rows = replica_statuses(metrics, launch.handles, state, launch.stopped)
        recent = [f"{a.event}: {a.text}" for a in alerts.recorded()[-PAGE_ALERTS:]]
        facts = PageFacts(
            title=self.config.run.name, written_at=datetime.now(timezone.utc),
            host=socket.gethostname(),
            outer_steps=self.config.diloco.outer_steps,
            notes=([f"launch ended: {report.ended}"] if report.ended else []) + recent,
            spend=spend_shown(report.spend, self.config) if report.spend else {},
        )  # fmt: skip
        try:
            page = render_page(rows, metrics, facts)
            publish(self.store, self.layout, page, status_document(rows, facts))
        except Exception as exc:  # the page is for people: it never stops a keeper
            log.warning("status page not written: %s", one_line(exc))

    def replace(self, replica_ids: list[str], *, force: bool) -> list[Restarted]:
        """Start ``replica_ids`` again (same id and shard, a new incarnation), whatever the
        others do. A replica still live (its job pending or running, or its lease advancing)
        is refused unless ``force``: then its job is stopped first, and the new incarnation's
        claim fences it in any case (docs/collective.md, "Membership")."""
        launch = self.launches.latest()
        if launch is None:
            raise ValueError(f"run {self.config.run.name} was never launched: nothing to replace")
        if launch.end is not None:
            raise ValueError(f"launch {launch.number} has ended ({launch.end.reason}: "
                             f"{launch.end.detail}): launch the run again")  # fmt: skip
        known = [replica.replica_id for replica in launch.record.replicas]
        unknown = sorted(set(replica_ids) - set(known))
        if unknown:
            raise ValueError(f"no replica {', '.join(unknown)} in launch {launch.number}; "
                             f"its replicas: {', '.join(known)}")  # fmt: skip
        now = store_time(self.store, self.layout)
        launched_at = self.store.modified(self.layout.launch(launch.number))
        observed = self._observe(launch, self.metrics.read(), launched_at)
        chosen = [replica for replica in observed if replica.replica_id in replica_ids]
        live = [r.replica_id for r in chosen if self._live(r, now)]
        if live and not force:
            raise ValueError(
                f"{', '.join(live)} still running: `diloco replace --force` stops its job "
                f"first (a process that goes on anyway is fenced off)"
            )
        alerts = Alerts(self.store, self.layout, launch.number, self.config.alerts)
        restarted = []
        for replica in chosen:
            counted = replica.claim.counted if replica.claim else 0
            decision = Decision("restart", "replaced", "replaced by hand (diloco replace)",
                                counted, stop_first=replica.replica_id in live)  # fmt: skip
            restarted.append(self._restart(launch, replica, decision, alerts))
        return restarted

    def _live(self, replica: Observed, now: float) -> bool:
        """Its job is pending or running, or its lease advanced within the lease expiry."""
        return replica.state in ("pending", "running") or self._leasing(replica, now)

    def _leasing(self, replica: Observed, now: float) -> bool:
        """Its newest incarnation's lease advanced within the lease expiry (store time)."""
        expiry = LeasePolicy(period=self.config.sync.lease_period).expiry
        return replica.active_at is not None and now - replica.active_at <= expiry

    def _health(
        self, observed: list[Observed], metrics: dict[str, ReplicaMetrics], now: float
    ) -> list[Alert]:
        active_at = {replica.replica_id: replica.active_at for replica in observed}
        oldest_attempt = min(replica.started_at for replica in observed)
        return health_alerts(self.store, self.layout, self.config, active_at, metrics, now,
                             oldest_attempt)  # fmt: skip

    # -- seeing --------------------------------------------------------------------------------

    def _observe(
        self, launch: Launch, metrics: dict[str, ReplicaMetrics], launched_at: float
    ) -> list[Observed]:
        """Every planned replica as its records, its platform and its lease say (times: the
        store's; ``launched_at``: when the store took the launch record)."""
        view = MembershipView.read(self.store, self.layout)
        observed = []
        for planned in launch.record.replicas:
            replica = planned.replica_id
            job, claim = launch.jobs.get(replica), launch.restarts.get(replica)
            handle = job.handle if job else None
            backend = self._backend(planned.platform)
            state = job_state(backend, handle) if handle else None
            exit_code = (backend.exit_code(handle)
                         if handle and backend.capabilities.exit_codes else None)  # fmt: skip
            job_key = self.layout.launch_job(launch.number, replica, job.attempt) if job else None
            claim_key = (self.layout.launch_restart(launch.number, replica, claim.attempt)
                         if claim else None)  # fmt: skip
            seen = metrics.get(replica)
            observed.append(Observed(
                replica_id=replica, platform=planned.platform, attempt=launch.attempt(replica),
                job=job, state=state, exit_code=exit_code, stopped=replica in launch.stopped,
                claim=claim, claimed_at=self._modified(claim_key),
                started_at=self._modified(job_key) or launched_at,
                active_at=self._active_at(view, replica),
                done=seen is not None and seen.state() == "done",
            ))  # fmt: skip
        return observed

    def _modified(self, key: str | None) -> float | None:
        if key is None:
            return None
        try:
            return self.store.modified(key)
        except FileNotFoundError:
            return None

    def _active_at(self, view: MembershipView, replica: str) -> float | None:
        """When the replica's newest incarnation last beat (else claimed), in the store's time."""
        incarnation = view.newest().get(replica)
        if incarnation is None:
            return None
        member = Participant(replica, incarnation)
        beat = view.beats.get(member)
        key = (self.layout.claim(replica, incarnation) if beat is None
               else self.layout.lease(replica, incarnation, beat))  # fmt: skip
        return self._modified(key)

    # -- acting --------------------------------------------------------------------------------

    def _act(
        self, launch: Launch, replica: Observed, decision: Decision, alerts: Alerts
    ) -> list[str]:
        """Carry out ``decision``; an ended replica that is not restarted now is alerted on."""
        name = replica.replica_id
        if decision.action == "leave":
            return []
        if decision.action == "restart":
            return [self._restart(launch, replica, decision, alerts).note]
        said = f"{name} ended: {decision.detail}"
        if decision.action == "give_up":
            said = f"{name} ended and is not restarted: {decision.detail}"
        alerts.send(Alert(f"ended.{name}.{replica.attempt}", said))
        return [said]

    def _restart(
        self, launch: Launch, replica: Observed, decision: Decision, alerts: Alerts
    ) -> Restarted:
        name, attempt = replica.replica_id, replica.attempt + 1
        claim = RestartRecord(
            replica_id=name, attempt=attempt, reason=decision.reason, detail=decision.detail,
            counted=decision.counted, streak=decision.streak, host=socket.gethostname(),
            at=time.time(), nonce=uuid.uuid4().hex,
        )  # fmt: skip
        if not self.launches.claim_restart(launch.number, claim):
            return Restarted(False, f"{name}: another keeper is restarting it")
        backend = self._backend(replica.platform)
        stops_one = backend.capabilities.stops_one_replica
        if decision.stop_first and replica.job is not None and stops_one:
            try:
                backend.stop(replica.job.handle)
            except Exception as exc:  # it is superseded once the new incarnation claims
                log.warning("stopping hung %s: %s", name, one_line(exc))
        try:
            spec = self.spec(launch, name)
            handle = backend.launch([spec], self.run_folder)[0]
        except Exception as exc:
            self.launches.release_restart(launch.number, claim)
            said = f"{name} could not be restarted on {replica.platform}: {one_line(exc)}"
            alerts.send(Alert(f"restart-failed.{name}.{attempt}", said))
            return Restarted(False, said)
        self.launches.started(launch.number, handle, attempt, time.time())
        said = f"{name} restarted (attempt {attempt}): {decision.detail}"
        alerts.send(Alert(f"restarted.{name}.{attempt}", said))
        return Restarted(True, said)

    def _backend(self, platform: str) -> Backend:
        """The platform's launcher, made once per keeper (its SDK clients are reused)."""
        if platform not in self.backends:
            self.backends[platform] = get_backend(platform, self.config)
        return self.backends[platform]

    def spec(self, launch: Launch, replica_id: str) -> ReplicaSpec:
        """``replica_id``'s spec as launch ``launch`` planned it: same id, data shard and run
        size; remote replicas read the run.toml the launch published, whatever the local file
        says now."""
        counts: dict[str, int] = {}
        for planned in launch.record.replicas:
            counts[planned.platform] = counts.get(planned.platform, 0) + 1
        plan = plan_launch(self.config, counts)
        planned = {(r.replica_id, r.index, r.platform) for r in launch.record.replicas}
        if {(s.replica_id, s.index, s.platform) for s in plan.specs} != planned:
            raise ConfigError(
                f"run.toml no longer plans launch {launch.number}'s replicas: launch again"
            )
        spec = next(spec for spec in plan.specs if spec.replica_id == replica_id)
        published = launch.record.config_key
        if published and spec.env.get(published_config.ENV_CONFIG_KEY) != published:
            self.say(f"run.toml differs from the one launch {launch.number} published: "
                     f"{replica_id} reads the published one, as the others do")  # fmt: skip
            spec = replace(spec, env={**spec.env, published_config.ENV_CONFIG_KEY: published})
        return spec

    # -- ending --------------------------------------------------------------------------------

    def _end_if_due(
        self, launch: Launch, alerts: Alerts, over_budget: str | None
    ) -> EndRecord | None:
        """End the launch when the run is done or over budget (one keeper writes ``END``)."""
        if run_done(self.store, self.layout, self.config):
            reason, detail = "done", "the last outer step is committed"
        elif over_budget is not None:
            reason, detail = "budget", over_budget
        else:
            return None
        end = EndRecord(reason=reason, detail=detail, host=socket.gethostname(),
                        at=time.time(), nonce=uuid.uuid4().hex)  # fmt: skip
        self.launches.end(launch.number, end)
        alerts.send(Alert(f"end.{reason}", f"run {self.config.run.name} ended: {detail}"))
        return self.launches.read(launch.number).end or end

    def _stop_all(
        self, launch: Launch, observed: list[Observed], end: EndRecord, now: float
    ) -> list[str]:
        """Stop every replica whose job may still run (marked first: never restarted). When
        the run is done, a running replica that said so, or showed a sign of life within
        ``[keep] hung_after``, is finishing by itself (its last metrics, its checkpoint's
        mirrors, torchrun's teardown) and is left to; a later pass stops one that does not."""

        def finishing(r: Observed) -> bool:
            alive = r.done or now - r.last_alive < self.config.keep.hung_after
            return end.reason == "done" and r.state == "running" and alive

        going = [r for r in observed if r.job and r.state in ACTIVE_STATES and not finishing(r)]
        notes = []
        for replica in going:
            assert replica.job is not None
            self.launches.mark_stopped(launch.number, replica.replica_id, replica.job.attempt)
            try:
                self._backend(replica.platform).stop(replica.job.handle)
                notes.append(f"{replica.replica_id} stopped: the launch has ended")
            except Exception as exc:
                notes.append(f"{replica.replica_id} could not be stopped: {one_line(exc)}")
        return notes

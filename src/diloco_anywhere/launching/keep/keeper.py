"""Keep a run going with nobody watching: ``diloco keep``, one reconciliation pass.

Every platform's own retries and limits are finite (Modal's 24 h timeout and a few retries, HF
Jobs' timeout, SageMaker's max runtime), so a run of days loses replicas unless something
starts them again. The keeper is that something, with no server: a pass reads the newest
launch and its replicas' leases from the bucket and each platform's job states, decides for
every replica, acts, and is done. Run it from anywhere (a scheduled workflow, a cron job, a
laptop), as often as you like, several at once: every action starts with a create-only record
in the bucket, so of two keepers that decide alike exactly one acts.

Per replica, the pass gathers the facts (an ``Observed``) and ``decisions.py`` decides: leave
it alone, wait out a backoff, start it again on its platform as a new incarnation, or give up
on it (the rules are there). This module carries the decision out: it claims a restart, stops
a hung job, starts the next attempt, alerts.

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
from diloco_anywhere.bucket.format.layout import Participant, RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.members.membership import MembershipView, depart_for
from diloco_anywhere.collective.policy import LeasePolicy
from diloco_anywhere.config import ConfigError, RunConfig
from diloco_anywhere.launching.cost.cost_so_far import Spend, over_budget
from diloco_anywhere.launching.cost.spending import launch_spend, spend_shown
from diloco_anywhere.launching.keep.alerts import Alert, Alerts
from diloco_anywhere.launching.keep.decisions import Decision, Observed, decide
from diloco_anywhere.launching.keep.health import health_alerts
from diloco_anywhere.launching.start.launch import job_state, plan_launch, run_dir
from diloco_anywhere.launching.start.launches import EndRecord, Launch, Launches, RestartRecord
from diloco_anywhere.launching.watch.status import replica_statuses
from diloco_anywhere.launching.watch.status_page import (
    PageFacts,
    publish,
    render_page,
    status_document,
)
from diloco_anywhere.training.checkpoints.commits import committed_rounds, read_commit
from diloco_anywhere.training.checkpoints.records import CheckpointError
from diloco_anywhere.training.records.metrics import MetricsReader, ReplicaMetrics

log = logging.getLogger(__name__)
PAGE_ALERTS = 20  # the newest alerts the status page lists


def store_time(store: Store, layout: RunLayout) -> float:
    """The store's clock now: the time it gives an object this call writes (then deletes)."""
    key = layout.clock(uuid.uuid4().hex)
    store.put(key, b"")
    try:
        return store.modified(key)
    finally:
        store.delete(key)


def _heal_seconds(seen: ReplicaMetrics | None) -> float | None:
    """How long the replica's newest heal took (its ``healed`` event), where it healed."""
    heals = [e.seconds for e in seen.events if e.event == "healed"] if seen else []
    return heals[-1] if heals else None


def run_done(store: Store, layout: RunLayout, config: RunConfig) -> bool:
    """A checkpoint has committed the run's last outer step (every fragment's syncs)."""
    last = config.diloco.last_step
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
    spend: Spend | None = None  # so far (an estimate: launching/cost/cost_so_far.py)


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
        page_every: float = 0.0,
    ) -> None:
        """``page_every``: seconds from one status page to the next, the first one included;
        0, a page every pass (a scheduled ``diloco keep``). Rendering the page's plots takes a
        second or more, which a launch following its run (a pass every 2 s) must not spend
        each time: its live table, its restarts and a chaos driver would wait on it."""
        self.config, self.store, self.say = config, store, say
        self.page_every, self.page_due_at = page_every, time.monotonic() + page_every
        self.layout = RunLayout(config.run.name)
        self.launches = Launches(store, self.layout)
        self.metrics = MetricsReader(store, self.layout)
        self.run_folder = run_folder or run_dir(config)
        self.backends: dict[str, Backend] = dict(backends or {})

    def pass_(self, *, dry_run: bool = False) -> PassReport:
        """Reconcile once, then write the status page (when ``page_every`` has passed, and
        when the launch ends); ``dry_run``: decide, and act on nothing (no restart, no stop,
        no record, no alert, no page)."""
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
        if not dry_run and (report.ended or time.monotonic() >= self.page_due_at):
            self._publish(launch, observed, report, metrics, alerts)
            self.page_due_at = time.monotonic() + self.page_every
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

        rows = replica_statuses(metrics, launch.handles, state, launch.stopped,
                                pace=self.config.diloco.pace)  # fmt: skip
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
                contributions=sum(s.contributed for s in seen.syncs) if seen else 0,
                heal_seconds=_heal_seconds(seen),
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
            # the others learn it through the bucket (it may have left no word: it never
            # joined, or was killed): their rounds fail at once when it leaves too few
            depart_for(self.store, self.layout, name, f"the keeper gave up on it: "
                       f"{decision.detail}", final=decision.final)  # fmt: skip
        alerts.send(Alert(f"ended.{name}.{replica.attempt}", said))
        return [said]

    def _restart(
        self, launch: Launch, replica: Observed, decision: Decision, alerts: Alerts
    ) -> Restarted:
        name, attempt = replica.replica_id, replica.attempt + 1
        claim = RestartRecord(
            replica_id=name, attempt=attempt, reason=decision.reason, detail=decision.detail,
            counted=decision.counted, streak=decision.streak, host=socket.gethostname(),
            at=time.time(), nonce=uuid.uuid4().hex, contributions=replica.contributions,
            fruitless=decision.fruitless,
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

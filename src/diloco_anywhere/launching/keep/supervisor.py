"""Follow a launch from the machine that started it (``diloco launch`` without ``--detach``).

The supervisor keeps the launch's current jobs for the live status table. With
``--restart-on-failure`` it runs the keeper (``keeper.py``) every few seconds, on every
platform of the launch: the one restart logic there is, whether a scheduled ``diloco keep``
or this follower observes an ended replica first (their create-only claims in the bucket let
exactly one of them act). What is restarted and what is not (stopped on purpose, a refused
run.toml, superseded, out of restarts) is the keeper's to say.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from diloco_anywhere.backends.base import ACTIVE_STATES, Backend, JobState, ReplicaHandle
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.members.membership import depart_for
from diloco_anywhere.config import with_changes
from diloco_anywhere.contract import NOT_RETRIED
from diloco_anywhere.launching.keep.keeper import Keeper, PassReport
from diloco_anywhere.launching.start.launch import LaunchPlan, job_state, run_launches
from diloco_anywhere.launching.start.launches import Launch
from diloco_anywhere.launching.watch.status import ReplicaStatus
from diloco_anywhere.training.records.metrics import ReplicaMetrics

LOCAL_KEEP_SECONDS = 2.0  # a local process's end is seen at once
PAGE_EVERY = 60.0  # seconds between status pages while following: the live table is here
REMOTE_KEEP_SECONDS = 60.0  # platform APIs throttle (SageMaker's DescribeTrainingJob)


ENDED_STATES = ("done", "failed", "stopped")  # what a replica says of its end


@dataclass(frozen=True)
class Ended:
    """A replica of the launch that ended without finishing, and why, for a line of its own."""

    replica: str
    state: str
    why: str  # its own last word (its failed event's detail), else its platform's
    own_word: bool = True  # ``why`` is the replica's own, not its platform's

    def line(self) -> str:
        return f"{self.replica}: {self.state}: {self.why}"


@dataclass(frozen=True)
class Outcome:
    """Where a followed launch stands: ``over`` once every replica has ended or the run
    cannot go on (``hopeless`` says why: the replicas left cannot seal a round)."""

    over: bool
    unfinished: tuple[Ended, ...]
    hopeless: str | None = None


def still_running(row: ReplicaStatus, job: JobState) -> bool:
    """Its job may still run: queued, running, or its platform cannot say, unless the replica
    itself said how it ended (a platform that cannot say would otherwise be followed for
    ever)."""
    return job in ACTIVE_STATES and not (job == "unknown" and row.state in ENDED_STATES)


def outcome(
    rows: list[ReplicaStatus],
    jobs: Mapping[str, JobState],
    metrics: Mapping[str, ReplicaMetrics],
    exit_codes: Mapping[str, int | None],
    min_replicas: int,
    may_restart: Callable[[str], bool] = lambda _: False,
    launch_ended: bool = False,
) -> Outcome:
    """Whether following is over: every replica ended for good, or too few are left to seal
    a round (fewer than ``min_replicas`` running or coming back, none done). A replica that
    ended comes back where ``may_restart(replica)`` (the launch's keeper would start it
    again), unless it ended with a mistake's exit code (never retried) or the launch has
    ended (``launch_ended``: a keeper wrote its ``END``, after which nothing is restarted)."""
    running = [row for row in rows if still_running(row, jobs.get(row.replica, "unknown"))]
    ended = [row for row in rows if row not in running and row.state != "done"]
    unfinished = tuple(
        _ended(row, metrics.get(row.replica), exit_codes.get(row.replica)) for row in ended
    )
    back = [row for row in ended if not launch_ended
            and exit_codes.get(row.replica) not in NOT_RETRIED
            and may_restart(row.replica)]  # fmt: skip
    if not running and not back:
        return Outcome(True, unfinished)
    done = any(row.state == "done" for row in rows)  # the run is trained: the rest finish
    if done or len(ended) == len(back) or len(running) + len(back) >= min_replicas:
        return Outcome(False, unfinished)
    left = ", ".join(row.replica for row in running)
    return Outcome(True, unfinished, (
        f"the run cannot go on: {len(ended) - len(back)} of its replicas ended for good, and "
        f"the {len(running)} left ({left}) are fewer than min_replicas = {min_replicas}"
    ))  # fmt: skip


def _ended(row: ReplicaStatus, metrics: ReplicaMetrics | None, code: int | None) -> Ended:
    ending = metrics.ending() if metrics else None
    exited = "" if code is None else f" (exit {code})"
    if ending is not None and ending.event != "done" and ending.detail:
        return Ended(row.replica, f"{row.state}{exited}", ending.detail)
    why = f"its {row.platform} job {row.state}"
    return Ended(row.replica, f"{row.state}{exited}", why, own_word=False)


def logged_error(backend: Backend, handle: ReplicaHandle) -> str | None:
    """The last error ``handle``'s replica printed, where its platform can show its log."""
    try:
        return last_error(backend.logs(handle))
    except Exception:  # a platform's logs may be gone or out of reach: its word stands
        return None


def last_error(log: str) -> str | None:
    """The last ``error: ...`` line a replica's process printed (the entrypoint's and a
    script's mistakes say theirs so), without the prefix."""
    said = [line for line in log.splitlines() if line.startswith("error: ")]
    return said[-1].removeprefix("error: ") if said else None


class Supervisor:
    """The jobs of one launch, kept current as the keeper restarts replicas."""

    def __init__(
        self,
        plan: LaunchPlan,
        started: dict[str, tuple[Backend, list[ReplicaHandle]]],
        max_restarts: int = 0,
    ) -> None:
        self.plan = plan
        self.backends = {platform: backend for platform, (backend, _) in started.items()}
        self.handles = [handle for _, handles in started.values() for handle in handles]
        self.launches = run_launches(plan.config)
        self.number = self.launches.numbers()[-1]  # the launch that started these jobs
        self.keeper = None
        if max_restarts:
            config = with_changes(plan.config, keep__max_restarts=max_restarts)
            self.keeper = Keeper(config, Store(config.store_url()), run_folder=plan.run_dir,
                                 backends=self.backends, page_every=PAGE_EVERY)  # fmt: skip
        self.every = REMOTE_KEEP_SECONDS if self.remote else LOCAL_KEEP_SECONDS
        self.kept_at = -self.every
        self.last: PassReport | None = None

    def state(self, handle: ReplicaHandle) -> JobState:
        return job_state(self.backends[handle.platform], handle)

    def exit_code(self, handle: ReplicaHandle) -> int | None:
        """Where its platform keeps one (local processes), once it ended."""
        backend = self.backends[handle.platform]
        return backend.exit_code(handle) if backend.capabilities.exit_codes else None

    def may_restart(self, replica: str) -> bool:
        """This launch's keeper would start ``replica`` again (it has not given up on it)."""
        decisions = self.last.decisions if self.last else {}
        decision = decisions.get(replica)
        return self.keeper is not None and (decision is None or decision.action != "give_up")

    def local(self) -> list[ReplicaHandle]:
        """The replicas of this launch on this machine: what an interrupt stops."""
        return [h for h in self.handles if not self.backends[h.platform].capabilities.remote]

    @property
    def remote(self) -> bool:
        return any(backend.capabilities.remote for backend in self.backends.values())

    @property
    def restarting(self) -> bool:
        """The keeper's last pass is waiting to restart a replica, or has just restarted one."""
        decisions = self.last.decisions.values() if self.last else ()
        return any(decision.action in ("wait", "restart") for decision in decisions)

    def records(self) -> Launch:
        """This launch's records as they stand: which replicas were stopped on purpose (from
        whichever machine), and whether a keeper ended it (``END``)."""
        return self.launches.read(self.number)

    def in_their_words(self, unfinished: Iterable[Ended]) -> list[Ended]:
        """``unfinished`` with the last error each replica printed, where it left no word in
        the bucket (it failed before it joined the run: a script's error before ``join``)."""
        handles = {handle.replica_id: handle for handle in self.handles}
        worded = []
        for ended in unfinished:
            handle = handles.get(ended.replica)
            said = None
            if not ended.own_word and handle is not None:
                said = logged_error(self.backends[handle.platform], handle)
            worded.append(ended if said is None else replace(ended, why=said, own_word=True))
        return worded

    def tell_the_others(self, gone: Iterable[Ended]) -> None:
        """The run cannot go on: say in the bucket that ``gone`` left for good (some may have
        left no word: they never joined, or were killed), so that the replicas still running
        on other platforms, which this launch does not stop, fail their rounds at once
        (``collective/members/departures.py``) instead of waiting out their timeouts."""
        store, layout = Store(self.plan.config.store_url()), RunLayout(self.plan.config.run.name)
        for ended in gone:
            depart_for(store, layout, ended.replica, f"ended for good ({ended.state}: "
                       f"{ended.why}), and nothing restarts it")  # fmt: skip

    def restart_failed(self) -> list[str]:
        """A keeper pass when one is due; what it did, one line each, for the user."""
        if self.keeper is None or time.monotonic() - self.kept_at < self.every:
            return []
        self.kept_at = time.monotonic()
        self.last = self.keeper.pass_()
        self.handles = self.launches.read(self.number).handles
        return self.last.notes

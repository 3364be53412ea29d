"""A run's status, one row per replica: from its metrics in the bucket and its job's state.

The bucket is the one place every platform reports to, so training progress (outer step, loss,
throughput, last seen) comes from there; the backend adds whether the job is still running.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field

from diloco_anywhere.backends.base import JobState, ReplicaHandle
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.members.membership import SKEW_SHOWN, MembershipView, newest_leases
from diloco_anywhere.training.records.metrics import ReplicaMetrics, SyncLine


@dataclass(frozen=True)
class ReplicaStatus:
    replica: str
    platform: str
    state: str  # starting, running, done, failed, stopped, exited (saying nothing), unknown
    outer_step: int
    loss: float | None
    eval_loss: float | None
    tokens: int
    tokens_per_second: float | None
    bytes_up: int
    bytes_down: int
    last_seen_seconds: float | None  # since its newest metrics line, its clock's skew taken out
    restarts: int = 0  # incarnations after the first
    heals: int = 0  # times it healed from the bucket (joining late, restarted, diverged)
    divergences: int = 0  # times its global state differed from the sealed contributors'
    mirror_failures: int = 0  # checkpoints it committed that did not reach a mirror
    superseded: int = 0  # incarnations that ended themselves when a newer one was claimed
    clock_skew: float | None = None  # seconds its clock is ahead of the store's, last measured
    values: dict[str, float] = field(default_factory=dict)  # the script's own, latest
    round_steps: int = 0  # inner steps of its latest round (its pace, with pace = "time")
    waiting: float | None = None  # share of its recent rounds' time spent waiting on syncs
    behind: bool = False  # it said it holds the rounds up (too slow for min_round_steps)
    advice: str | None = None  # what to change about its note, where there is a fix
    last_word: str | None = None  # why it failed, as it said (its failed event's detail)
    own_data: str | None = None  # where its script trains on data of its own, what it said

    def as_dict(self) -> dict:
        return asdict(self)


ENDED_JOBS = ("exited", "failed", "timed_out", "stopped")


def finite_or_null(value: object) -> object:
    """``value`` with every NaN or infinity (anywhere inside) as ``None``: standard JSON for
    scripts and the status page (``json.dumps`` would write ``NaN``, which parsers reject)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


def _state(metrics: ReplicaMetrics | None, job: str, stopped_on_purpose: bool) -> str:
    """What the replica said last if it said how it ended; else what its platform says of its
    job. A job that has ended is never ``starting`` or ``running``, whatever the bucket holds
    (a replica killed before its first metrics line wrote nothing), and one ``diloco stop``
    ended is ``stopped`` however its process exited. A replica done training whose job then
    failed (its script raised after the run was trained) is ``failed``."""
    if metrics is not None and metrics.state() == "done" and job == "failed":
        return "failed"  # its training was done, then its script exited with an error
    if metrics is not None and metrics.state() in ("done", "failed", "stopped"):
        return metrics.state()
    if job == "running":
        return "running" if metrics and (metrics.steps or metrics.syncs) else "starting"
    return "stopped" if job in ENDED_JOBS and stopped_on_purpose else job


def replica_statuses(
    metrics: dict[str, ReplicaMetrics],
    handles: list[ReplicaHandle],
    job_state: Callable[[ReplicaHandle], JobState],
    stopped: Collection[str] = (),
    now: float | None = None,
    skews: Mapping[str, float | None] | None = None,
    pace: str = "steps",
) -> list[ReplicaStatus]:
    """Rows for every launched replica and every replica that wrote metrics, by replica id.
    ``job_state`` asks the backend that knows the job (the one that started it, if alive);
    ``stopped`` are the replicas ``diloco stop`` stopped; ``skews``: each replica's clock
    against the store's, from its lease (``replica_skews``): "last seen" is counted in the
    store's time, so a replica whose clock is off is not shown as silent or from the future.
    ``pace``: the run's ``[diloco] pace``, for the fix of a replica that waits (``advice``)."""
    skews = skews or {}
    now = now or time.time()
    jobs = {handle.replica_id: handle for handle in handles}
    rows = []
    for replica in sorted(jobs.keys() | metrics.keys()):
        seen, handle = metrics.get(replica), jobs.get(replica)
        job = job_state(handle) if handle else "unknown"
        waiting = waiting_share(seen.syncs) if seen else None
        last_sync = seen.syncs[-1] if seen and seen.syncs else None
        last_step = seen.steps[-1] if seen and seen.steps else None
        rows.append(
            ReplicaStatus(
                replica=replica,
                platform=handle.platform if handle else (seen.platform if seen else ""),
                state=_state(seen, job, replica in stopped),
                outer_step=seen.outer_step() if seen else 0,
                loss=last_step.loss if last_step else None,
                eval_loss=seen.latest_eval_loss() if seen else None,
                tokens=seen.trained()[1] if seen else 0,
                tokens_per_second=last_sync.tokens_per_second if last_sync else None,
                bytes_up=last_sync.bytes_up if last_sync else 0,
                bytes_down=last_sync.bytes_down if last_sync else 0,
                last_seen_seconds=_seconds_since(seen.last_seen(), skews.get(replica), now)
                if seen
                else None,
                restarts=max(0, len(seen.incarnations) - 1) if seen else 0,
                heals=seen.count("healed") if seen else 0,
                divergences=seen.count("diverged") if seen else 0,
                mirror_failures=seen.count("mirror_failed") if seen else 0,
                superseded=seen.count("superseded") if seen else 0,
                clock_skew=skews.get(replica),
                values=dict(last_step.values) if last_step else {},
                round_steps=last_sync.round_steps if last_sync else 0,
                waiting=waiting,
                behind=bool(seen and seen.behind()),
                advice=waiting_fix(pace) if shown_waiting(waiting) else None,
                last_word=_why_failed(seen),
                own_data=seen.own_data() if seen else None,
            )
        )
    return rows


def _seconds_since(written: float, skew: float | None, now: float) -> float:
    """Seconds since a replica wrote a line at ``written`` by its clock, ``skew`` seconds ahead
    of the store's as it measured it. The measure is off by up to half a round trip to the
    store, so a line just written can come out a few milliseconds in the future: it was
    seen now."""
    return max(0.0, now - written + (skew or 0.0))


def _why_failed(seen: ReplicaMetrics | None) -> str | None:
    ending = seen.ending() if seen else None
    if ending is None or ending.event != "failed":
        return None
    return ending.detail or None


def failure_lines(rows: Collection[ReplicaStatus]) -> list[str]:
    """A line per replica whose newest incarnation failed, with its own last word (the error,
    a script's mistake and its fix): what ``diloco status`` prints under the table."""
    return [f"{row.replica} failed: {row.last_word}" for row in rows if row.last_word]


WAITING_SHOWN = 0.1  # a replica waiting on syncs a tenth of its time or more is shown so
# What the launch's estimate says of replicas that wait for slower ones (``round_plan.py``)
PACE_FIX = 'pace = "time" lets them train instead'


def shown_waiting(waiting: float | None) -> bool:
    return waiting is not None and waiting >= WAITING_SHOWN


def waiting_fix(pace: str) -> str | None:
    """The fix for replicas that wait on syncs: in a run paced by steps they wait for the
    slower replicas, which ``pace = "time"`` lets them spend training (docs/tuning.md, "Mixed
    hardware"); paced by time, nothing to say here (the slowest replica is ``behind``)."""
    if pace != "steps":
        return None
    return f'set [diloco] pace = "time" in run.toml: {PACE_FIX} (docs/tuning.md)'


# What to say of replicas whose script reads data of its own (``Training``'s ``own_data``)
OWN_DATA_FIX = (
    "the data plan is the script's (the run claims none of it); for the run's one order, "
    "claimed in the bucket, give run.toml's [task] data and read it through replica.stream "
    "(docs/data.md)"
)


def advice_lines(rows: Collection[ReplicaStatus]) -> list[str]:
    """One line per fix the rows' notes call for, naming the replicas it is for: what
    ``diloco status`` and the status page print under the table."""
    waiting: dict[str, list[str]] = {}
    for row in rows:
        if row.advice is not None:
            waiting.setdefault(row.advice, []).append(f"{row.replica} ({row.waiting:.0%})")
    lines = [f"{', '.join(replicas)} wait on syncs for slower replicas: {advice}"
             for advice, replicas in waiting.items()]  # fmt: skip
    if own := [row.replica for row in rows if row.own_data]:
        lines.append(f"{', '.join(own)} train on their script's own data: {OWN_DATA_FIX}")
    return lines


def notes(row: ReplicaStatus) -> list[tuple[str, str]]:
    """What ``diloco status`` and the status page add to a replica's state, each with how
    loud it is (``bad``, ``warn``, ``quiet``)."""
    said = []
    if row.divergences:  # its weights differed from the others'
        said.append(("bad", f"diverged {row.divergences}x"))
    if row.mirror_failures:  # a checkpoint that did not reach a mirror
        said.append(("warn", f"mirror failed {row.mirror_failures}x"))
    if row.superseded:  # an old incarnation that ended itself when a newer one started
        said.append(("quiet", f"superseded {row.superseded}x"))
    if row.clock_skew is not None and abs(row.clock_skew) >= SKEW_SHOWN:
        said.append(("warn", f"clock {row.clock_skew:+.0f}s"))
    if row.behind:  # too slow even for min_round_steps: the others wait for it
        said.append(("warn", "behind"))
    if shown_waiting(row.waiting):  # idle, and billed
        said.append(("warn", f"waits {row.waiting:.0%}"))
    if row.own_data:  # its script reads its own data, not the run's
        said.append(("quiet", "own data"))
    return said


RECENT_ROUNDS = 5


def waiting_share(syncs: list[SyncLine], recent: int | None = RECENT_ROUNDS) -> float | None:
    """The share of the time between its last ``recent`` syncs (None: all) that a replica
    spent waiting on syncs (its exposed sync time), one incarnation's lines at a time (a
    restart counts from zero); None before two syncs."""
    waited = spent = 0.0
    recent = syncs if recent is None else syncs[-recent - 1 :]
    for before, after in itertools.pairwise(recent):
        exposed = after.sync_exposed_seconds - before.sync_exposed_seconds
        if exposed >= 0 and after.time > before.time:
            waited, spent = waited + exposed, spent + after.time - before.time
    return min(1.0, waited / spent) if spent > 0 else None


def replica_skews(store: Store, layout: RunLayout) -> dict[str, float | None]:
    """Each replica's clock minus the store's, as its newest incarnation last measured it and
    wrote it in its newest lease (None where it has no lease or measured nothing)."""
    view = MembershipView.read(store, layout)
    leases = newest_leases(store, layout, view, view.members())
    return {
        member.replica: lease.skew if (lease := leases[member.name]) else None
        for member in view.members()
    }

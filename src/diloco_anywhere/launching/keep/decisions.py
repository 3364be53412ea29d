"""What ``diloco keep`` does for one replica, decided from facts alone: leave, wait, restart
or give up.

Kept apart from the pass that gathers the facts and acts on them (``keeper.py``) because the
decision is pure: it reads an ``Observed`` replica, the store's time and ``[keep]``, touches no
store and no platform, and so is tested line by line without either.

Per replica, from its newest attempt (``launches.py``):

- stopped on purpose, done, pending, or running with its lease advancing: left alone;
- ended (failed, timed out, stopped or deleted by its platform, exited before the run was
  done), or running with a lease silent for ``[keep] hung_after`` (hung): started again on
  its platform with the same id and data shard, as a new incarnation, which heals from the
  bucket and supersedes any old process still alive (docs/collective.md, "Membership");
- after a quick end, the restart waits, doubling with each quick end in a row up to
  ``max_backoff`` (Kubernetes' crash-loop backoff); ``max_restarts`` per replica bounds
  restarts that are not planned (an attempt that hit its platform's time limit is planned);
- ``max_fruitless`` attempts in a row that ended before contributing to a round, whatever
  ended them: not restarted, since each would end the same (a time limit shorter than the
  replica's start and heal), and said with what each took;
- refused its run.toml (exit 2): not restarted, since it would fail again; said so.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_anywhere.backends.base import ACTIVE_STATES, JobState
from diloco_anywhere.config import KeepSection
from diloco_anywhere.contract import (
    EXIT_BAD_CONFIG,
    EXIT_MODEL_UNLIKE_RUN,
    EXIT_NOT_SYNCING,
    EXIT_RUN_CANNOT_GO_ON,
    EXIT_SUPERSEDED,
)
from diloco_anywhere.launching.start.launches import JobRecord, RestartRecord

# A keeper claimed an attempt but its job is not recorded: it is still being started (SageMaker
# takes a minute), or the keeper died meanwhile. Past this, the attempt counts as lost.
LAUNCH_GRACE = 600.0

# Ends no restart can help, and what the replica's log says about each.
GIVEN_UP_ON = {
    EXIT_BAD_CONFIG: "it refused run.toml",
    EXIT_NOT_SYNCING: "its script trains without syncing (outside `replica.diloco`, a "
    "Trainer without DilocoCallback, or another optimizer than the one DiLoCo wraps)",
    EXIT_MODEL_UNLIKE_RUN: "its model is unlike the run's",
    EXIT_RUN_CANNOT_GO_ON: "too few replicas are left for a round (the others stopped for good)",
}


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
    contributions: int = 0  # its contributions to rounds so far, every attempt's
    heal_seconds: float | None = None  # how long its newest heal took, where it healed

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
    fruitless: int = 0  # attempts in a row that ended without contributing, this one included
    # give_up: the replica is out for good (``Departure.final``); not where it ended for the
    # others' doing (they left too few for a round): replacing them brings it back too
    final: bool = True


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
    if replica.exit_code in GIVEN_UP_ON:
        why = GIVEN_UP_ON[replica.exit_code]
        return Decision("give_up", reason, f"{detail}: {why} and would only fail again; fix "
                        f"it, then `diloco replace {replica.replica_id}`",
                        final=replica.exit_code != EXIT_RUN_CANNOT_GO_ON)  # fmt: skip
    if replica.exit_code == EXIT_SUPERSEDED:
        return Decision("leave", "superseded by a newer incarnation started elsewhere")
    ran = replica.last_alive - replica.started_at
    previous = replica.claim
    streak = (previous.streak if previous else 0) + 1 if ran < keep.stable_after else 0
    counted = (previous.counted if previous else 0) + (reason != "timed_out")
    contributed = replica.contributions > (previous.contributions if previous else 0)
    fruitless = 0 if contributed else (previous.fruitless if previous else 0) + 1
    if fruitless > keep.max_fruitless:
        return Decision("give_up", reason, _fruitless(replica, fruitless, reason, detail, ran))
    if counted > keep.max_restarts:
        return Decision("give_up", reason, f"{detail}; out of restarts ([keep] max_restarts = "
                        f"{keep.max_restarts})")  # fmt: skip
    wait = backoff(keep, streak) - silent
    if wait > 0:
        said = f"{detail}; restarting in {wait:.0f} s (backoff)"
        return Decision("wait", reason, said, counted, streak, fruitless=fruitless)
    return Decision("restart", reason, detail, counted, streak, stop_first=reason == "hung",
                    fruitless=fruitless)  # fmt: skip


def _fruitless(replica: Observed, attempts: int, reason: str, detail: str, ran: float) -> str:
    """Why a replica whose attempts end before contributing is not restarted, and the fix."""
    name, platform = replica.replica_id, replica.platform
    heal = "" if replica.heal_seconds is None else (
        f"; its last heal took {replica.heal_seconds:.0f} s")  # fmt: skip
    if reason == "timed_out":
        fix = (f"give its attempts a longer time limit ([backends.{platform}]) than its start "
               f"and heal take, then `diloco replace {name}`")  # fmt: skip
    else:
        fix = f"see `diloco logs {name}`, fix it, then `diloco replace {name}`"
    return (f"{attempts} attempts of {name} in a row, none contributed to a round: the last "
            f"ended ({detail}) after {ran:.0f} s{heal}; {fix}")  # fmt: skip

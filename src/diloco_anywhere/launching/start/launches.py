"""A run's launches, recorded in its bucket, so that any machine that can reach the bucket and
the platforms can see, relaunch, follow and stop the run (docs/backends.md, "Launch records").

A launch takes the next launch number with a create-only ``LAUNCH`` record: two launchers
racing for one run (a laptop and a CI runner) cannot both take it, and the second is refused.
The record says what was planned: each replica's id, data shard and platform, the published
run.toml's key, and the image. As each platform starts its replicas, one ``job`` record per
replica start (``attempt`` 0, then one per restart) names the platform's job; the newest
attempt of each replica is its current job. ``diloco stop`` leaves a ``stopped`` marker per
replica, so that nothing restarts a replica stopped on purpose. Records are never rewritten
(keys are create-only): a launch's story is the list of its keys.

``.diloco/<run>/launch.json`` on the launching machine is a cache of the newest launch, and the
record of runs launched before the bucket held launches.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import Field, JsonValue

from diloco_anywhere.backends.base import ReplicaHandle, ReplicaSpec
from diloco_anywhere.bucket.format.framing import Count, Name
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import (
    RECORD_READ_LIMIT,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store

log = logging.getLogger(__name__)
RecordT = TypeVar("RecordT", bound=Record)


class LaunchedReplica(Record):
    replica_id: Name
    index: Count  # its data shard
    platform: Name
    processes: Count


class LaunchRecord(Record):
    run: Name
    number: Count
    started_at: float  # the launcher's wall clock: for people
    host: str  # the machine that launched, for people
    config_key: str | None  # the run.toml remote replicas read (published_config.py)
    # platform -> the image reference it starts (``ref@sha256:...`` where the digest is known)
    images: dict[Name, str]
    replicas: tuple[LaunchedReplica, ...]


class JobRecord(Record):
    replica_id: Name
    platform: Name
    attempt: Count
    job: dict[str, JsonValue]  # the platform's reference to the job; never a secret
    started_at: float

    @property
    def handle(self) -> ReplicaHandle:
        return ReplicaHandle(self.replica_id, self.platform, dict(self.job))


class RestartRecord(Record):
    """A keeper's claim to start ``attempt`` of a replica (``keeper.py``), written before the
    job starts: the key is create-only, so of two keepers acting at once one starts it."""

    replica_id: Name
    attempt: Count
    reason: Name  # what ended the attempt before: failed, timed_out, stopped, hung, replaced...
    detail: str = Field(max_length=400)  # for people: the platform's state, the exit code
    # Restarts so far that the budget counts (``[keep] max_restarts``): a timed-out attempt
    # ended as planned and is not counted
    counted: Count
    streak: Count  # attempts in a row that ended within ``[keep] stable_after``: the backoff
    # The replica's contributions to rounds when this attempt was claimed (all its attempts),
    # and the attempts in a row before it that ended without one (``[keep] max_fruitless``)
    contributions: Count = 0
    fruitless: Count = 0
    host: str  # the keeper's machine, for people
    at: float  # the keeper's wall clock, for people
    nonce: str  # makes racing keepers' bytes differ, so exactly one claim succeeds


class EndRecord(Record):
    """A keeper ended the launch: its replicas are stopped and none is restarted again."""

    reason: Name  # done, budget
    detail: str = Field(max_length=400)
    host: str
    at: float
    nonce: str


class LaunchTakenError(RuntimeError):
    """Another launcher took this launch number first: the run is being launched elsewhere."""


@dataclass(frozen=True)
class Launch:
    """One launch as its keys say: the record, each replica's newest attempt (its job and the
    keeper's claim that started it), the replicas whose current job was stopped on purpose,
    and whether a keeper ended the launch."""

    record: LaunchRecord
    jobs: dict[str, JobRecord]  # replica id -> the job of its newest started attempt
    stopped: frozenset[str]
    restarts: dict[str, RestartRecord] = field(default_factory=dict)  # replica -> newest claim
    end: EndRecord | None = None
    # replica -> the keys of all its job records, oldest attempt first (read on demand)
    job_keys: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def number(self) -> int:
        return self.record.number

    @property
    def handles(self) -> list[ReplicaHandle]:
        """The current jobs, in the launch's order of replicas (platform by platform)."""
        planned = [replica.replica_id for replica in self.record.replicas]
        return [self.jobs[replica].handle for replica in planned if replica in self.jobs]

    def attempt(self, replica_id: str) -> int:
        """The replica's newest attempt: started (a job) or being started (a claim)."""
        job, restart = self.jobs.get(replica_id), self.restarts.get(replica_id)
        return max(job.attempt if job else 0, restart.attempt if restart else 0)


class Launches:
    """The launch records of one run in its store."""

    def __init__(self, store: Store, layout: RunLayout) -> None:
        self.store, self.layout = store, layout

    def numbers(self) -> list[int]:
        keys = self.store.list_prefix(self.layout.launches())
        return sorted(n for key in keys if (n := self.layout.parse_launch(key)) is not None)

    def latest(self) -> Launch | None:
        """The newest launch, read whole (None when the run has never been launched with
        records in its bucket)."""
        numbers = self.numbers()
        return self.read(numbers[-1]) if numbers else None

    def read(self, number: int) -> Launch:
        key = self.layout.launch(number)
        record = decode_record(self.store.get(key, 0, RECORD_READ_LIMIT), LaunchRecord, key=key)
        newest: dict[tuple[str, str], tuple[int, str]] = {}  # (kind, replica) -> attempt, key
        job_keys: dict[str, list[tuple[int, str]]] = {}
        keys = self.store.list_prefix(self.layout.launch_folder(number))
        for key in keys:
            parsed = self.layout.parse_launch_key(key, number)
            if parsed is None:
                continue
            kind, replica, attempt = parsed
            if kind == "job":
                job_keys.setdefault(replica, []).append((attempt, key))
            if attempt >= newest.get((kind, replica), (-1, ""))[0]:
                newest[kind, replica] = (attempt, key)
        end_key = self.layout.launch_end(number)
        wanted = [key for (kind, _), (_, key) in newest.items() if kind != "stopped"]
        objects = self.store.get_many(wanted + [end_key] * (end_key in keys),
                                      limit=RECORD_READ_LIMIT)  # fmt: skip

        def records(kind: str, model: type[RecordT]) -> dict[str, RecordT]:
            return {replica: decode_record(objects[key], model, key=key)
                    for (k, replica), (_, key) in newest.items()
                    if k == kind and objects.get(key) is not None}  # fmt: skip

        jobs = records("job", JobRecord)
        stopped = {
            replica
            for (kind, replica), (attempt, _) in newest.items()
            if kind == "stopped" and replica in jobs and attempt >= jobs[replica].attempt
        }
        end = objects.get(end_key)
        oldest_first = {replica: tuple(key for _, key in sorted(found))
                        for replica, found in job_keys.items()}  # fmt: skip
        return Launch(
            record, jobs, frozenset(stopped), records("restart", RestartRecord),
            decode_record(end, EndRecord, key=end_key) if end else None, oldest_first,
        )  # fmt: skip

    def job_records(self, launch: Launch) -> dict[str, list[JobRecord]]:
        """Every job record of ``launch`` (every attempt), by replica, oldest first."""
        keys = [key for replica_keys in launch.job_keys.values() for key in replica_keys]
        objects = self.store.get_many(keys, limit=RECORD_READ_LIMIT)
        return {replica: [decode_record(objects[key], JobRecord, key=key)
                          for key in replica_keys if objects[key] is not None]
                for replica, replica_keys in launch.job_keys.items()}  # fmt: skip

    def begin(
        self,
        specs: tuple[ReplicaSpec, ...],
        config_key: str | None,
        images: dict[str, str],
        started_at: float,
        number: int | None = None,
    ) -> LaunchRecord:
        """Take launch ``number``, by default the next one; ``LaunchTakenError`` if another
        launcher took it first. A launcher that checked the run was not going passes the
        number that followed the newest launch it checked: a launch made elsewhere since then
        takes that number, and this one is refused."""
        number = max(self.numbers(), default=-1) + 1 if number is None else number
        record = LaunchRecord(
            run=self.layout.run, number=number, started_at=started_at,
            host=socket.gethostname(), config_key=config_key, images=images,
            replicas=tuple(
                LaunchedReplica(replica_id=s.replica_id, index=s.index, platform=s.platform,
                                processes=s.processes)
                for s in specs
            ),
        )  # fmt: skip
        try:
            self.store.put(self.layout.launch(number), encode_record(record))
        except FileExistsError:
            raise LaunchTakenError(
                f"launch {number} of run {self.layout.run} was taken by another launcher just "
                f"now: see `diloco status`, and stop one of the two if both are starting"
            ) from None
        return record

    def started(self, number: int, handle: ReplicaHandle, attempt: int, started_at: float) -> None:
        """Record the job that ``handle`` names as ``attempt`` of its replica in launch
        ``number``."""
        record = JobRecord(
            replica_id=handle.replica_id, platform=handle.platform, attempt=attempt,
            job=handle.job, started_at=started_at,
        )  # fmt: skip
        key = self.layout.launch_job(number, handle.replica_id, attempt)
        self.store.put(key, encode_record(record))

    def mark_stopped(self, number: int, replica_id: str, attempt: int) -> None:
        """Record that ``attempt`` of ``replica_id`` is being stopped on purpose: not to be
        restarted."""
        self.store.put(self.layout.launch_stopped(number, replica_id, attempt), b"")

    def claim_restart(self, number: int, restart: RestartRecord) -> bool:
        """Take the right to start ``restart.attempt`` of its replica; False when another
        keeper took it first."""
        key = self.layout.launch_restart(number, restart.replica_id, restart.attempt)
        try:
            self.store.put(key, encode_record(restart))
        except FileExistsError:
            return False
        return True

    def release_restart(self, number: int, restart: RestartRecord) -> None:
        """Give a claim back when its job could not be started: the next pass tries again."""
        self.store.delete(self.layout.launch_restart(number, restart.replica_id, restart.attempt))

    def end(self, number: int, end: EndRecord) -> bool:
        """End launch ``number``; False when another keeper ended it first."""
        try:
            self.store.put(self.layout.launch_end(number), encode_record(end))
        except FileExistsError:
            return False
        return True

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
from dataclasses import dataclass

from pydantic import JsonValue

from diloco_anywhere.backends.base import ReplicaHandle, ReplicaSpec
from diloco_anywhere.bucket.layout import RunLayout
from diloco_anywhere.bucket.record import RECORD_READ_LIMIT, Record, decode_record, encode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.bucket.wire import Count, Name

log = logging.getLogger(__name__)


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


class LaunchTakenError(RuntimeError):
    """Another launcher took this launch number first: the run is being launched elsewhere."""


@dataclass(frozen=True)
class Launch:
    """One launch as its keys say: the record, each replica's current job, and the replicas
    stopped on purpose."""

    record: LaunchRecord
    jobs: dict[str, JobRecord]  # replica id -> its newest attempt
    stopped: frozenset[str]

    @property
    def handles(self) -> list[ReplicaHandle]:
        """The current jobs, in the launch's order of replicas (platform by platform)."""
        planned = [replica.replica_id for replica in self.record.replicas]
        return [self.jobs[replica].handle for replica in planned if replica in self.jobs]


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
        jobs: dict[str, tuple[int, str]] = {}
        stopped = set()
        for key in self.store.list_prefix(self.layout.launch_folder(number)):
            parsed = self.layout.parse_launch_key(key, number)
            if parsed is None:
                continue
            kind, replica, attempt = parsed
            if kind == "stopped":
                stopped.add(replica)
            elif kind == "job" and attempt >= jobs.get(replica, (-1, ""))[0]:
                jobs[replica] = (attempt, key)
        objects = self.store.get_many([key for _, key in jobs.values()], limit=RECORD_READ_LIMIT)
        return Launch(
            record,
            {r: decode_record(objects[k], JobRecord, key=k) for r, (_, k) in jobs.items()
             if objects[k] is not None},
            frozenset(stopped),
        )  # fmt: skip

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

    def stopped(self, number: int) -> frozenset[str]:
        """The replicas of launch ``number`` stopped on purpose: one listing."""
        keys = self.store.list_prefix(f"{self.layout.launch_folder(number)}/stopped")
        parsed = (self.layout.parse_launch_key(key, number) for key in keys)
        return frozenset(p[1] for p in parsed if p is not None and p[0] == "stopped")

    def mark_stopped(self, number: int, replica_id: str) -> None:
        """Record that ``replica_id`` is being stopped on purpose: not to be restarted."""
        self.store.put(self.layout.launch_stopped(number, replica_id), b"")

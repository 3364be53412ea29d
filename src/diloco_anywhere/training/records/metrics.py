"""Per-replica training metrics, kept in the run's bucket so every platform reports the same way.

A replica writes its metrics as chunks: create-only records (checksummed JSON, ``record.py``)
under ``{run}/metrics/{replica}/{incarnation}-{seq}``, one chunk per sync plus one at start and
one at the end. Each holds JSON lines of three kinds: ``step`` (loss every few inner steps,
with the training script's own numbers),
``sync`` (an outer step: committed or not, its round and fingerprint, eval loss, throughput,
exposed sync time, traffic) and ``event`` (started, done, failed, stopped; diverged, healed and
resumed, its own state restored, in between). ``diloco status`` and ``diloco report`` read them all,
each chunk once. A chunk that fails its checks is skipped and named
in the log, never guessed at.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import Field

from diloco_anywhere.bucket.format.framing import Count, Name, WireFormatError
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import (
    RECORD_READ_LIMIT,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store

log = logging.getLogger(__name__)
MAX_LINES = 400  # keeps a chunk well under the 64 KiB record cap
MAX_VALUES = 16  # a script's own numbers per step line


class StepLine(Record):
    kind: Literal["step"] = "step"
    step: Count  # inner steps of this incarnation
    loss: float
    tokens: Count  # tokens this replica trained on so far
    time: float
    # the training script's own numbers at that step (``Training.log``): learning rate, ...
    values: dict[Name, float] = Field(default_factory=dict, max_length=MAX_VALUES)


class SyncLine(Record):
    kind: Literal["sync"] = "sync"
    outer_step: Count  # whole outer steps committed (every fragment synced) after this sync
    round: Count = 0  # the bucket round of this sync
    committed: bool
    contributed: bool = True  # this replica's pseudo-gradient is in the round's mean
    fingerprint: str = Field(default="", max_length=128)  # global state this sync started from
    participants: Count
    eval_loss: float | None
    tokens: Count
    # inner steps this replica trained so far, counted by the training whether or not the
    # script logs (0 in lines written before it was recorded)
    inner_steps: Count = 0
    tokens_per_second: float  # since the previous sync, sync time included
    sync_exposed_seconds: float  # total time training waited on syncs
    round_steps: Count = 0  # inner steps of the round this sync ended (0: not recorded)
    step_seconds: float | None = None  # their pace: seconds a step, the sync's waiting left out
    bytes_up: Count
    bytes_down: Count
    error: str | None = Field(default=None, max_length=2000)
    time: float


class EventLine(Record):
    kind: Literal["event"] = "event"
    event: Literal[
        "started", "done", "failed", "stopped", "diverged", "healed", "resumed", "mirror_failed",
        "superseded", "behind", "caught_up", "own_data",
    ]  # fmt: skip
    detail: str = Field(default="", max_length=2000)
    parameters: Count = 0  # "started": the model's size, for comparisons with data parallel
    seconds: float | None = None  # "healed": how long healing took
    # "healed", "done", "failed": the outer step it reached (a heal to the run's end syncs no
    # more, so no sync line says it)
    outer_step: Count | None = None
    time: float


Line = Annotated[StepLine | SyncLine | EventLine, Field(discriminator="kind")]


class MetricsChunk(Record):
    run: Name
    replica: Name
    incarnation: Count
    platform: Name
    seq: Count
    lines: tuple[Line, ...] = Field(max_length=MAX_LINES)


class MetricsWriter:
    """Buffers one replica incarnation's lines and puts them as a chunk on ``flush``. Safe to
    call from several threads (a checkpoint mirror reports from its own)."""

    def __init__(
        self, store: Store, layout: RunLayout, replica: str, incarnation: int, platform: str
    ) -> None:
        self.store, self.layout = store, layout
        self.replica, self.incarnation, self.platform = replica, incarnation, platform
        self._seq = 0
        self._lines: list[StepLine | SyncLine | EventLine] = []
        self._lock = threading.RLock()

    def add(self, line: StepLine | SyncLine | EventLine) -> None:
        with self._lock:
            self._lines.append(line)
            if len(self._lines) >= MAX_LINES:
                self.flush()

    def event(
        self,
        event: str,
        detail: str = "",
        parameters: int = 0,
        seconds: float | None = None,
        outer_step: int | None = None,
    ) -> None:
        line = EventLine(
            event=event,  # type: ignore[arg-type]
            detail=detail,
            parameters=parameters,
            seconds=seconds,
            outer_step=outer_step,
            time=time.time(),
        )
        with self._lock:
            self.add(line)
            self.flush()

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def last_word(self, event: str, detail: str) -> None:
        """``event`` as this incarnation's last line, after what it buffered, for a process
        about to end at once: best effort, a failure is logged, not raised (a superseded
        replica leaves regardless, and a run started over may hold its keys already)."""
        try:
            self.event(event, detail[:2000])
        except Exception as exc:
            log.warning("could not record %s: %s", event, exc)

    def _flush(self) -> None:
        if not self._lines:
            return
        chunk = MetricsChunk(
            run=self.layout.run,
            replica=self.replica,
            incarnation=self.incarnation,
            platform=self.platform,
            seq=self._seq,
            lines=tuple(self._lines),
        )
        key = self.layout.metrics_chunk(self.replica, self.incarnation, self._seq)
        self.store.put(key, encode_record(chunk))
        self._seq += 1
        self._lines = []


LIFECYCLE = ("started", "done", "failed", "stopped")


@dataclass
class ReplicaMetrics:
    """Everything one replica wrote, all incarnations, in order."""

    replica: str
    platform: str = ""
    incarnation: int = 0  # the newest
    steps: list[StepLine] = field(default_factory=list)
    syncs: list[SyncLine] = field(default_factory=list)
    events: list[EventLine] = field(default_factory=list)  # every incarnation's
    events_by_incarnation: dict[int, list[EventLine]] = field(default_factory=dict)
    # the last sync line of each incarnation: its counters (bytes, exposed time) are per process
    last_sync_by_incarnation: dict[int, SyncLine] = field(default_factory=dict)

    @property
    def incarnations(self) -> list[int]:
        """Incarnations that wrote metrics, oldest first."""
        return list(self.events_by_incarnation)

    def count(self, event: str) -> int:
        return sum(line.event == event for line in self.events)

    def last_seen(self) -> float:
        times = [lines[-1].time for lines in (self.steps, self.syncs, self.events) if lines]
        return max(times, default=0.0)

    def trained(self) -> tuple[int, int]:
        """Inner steps and tokens trained so far, as the training counts them: the newest of
        the last step line and the last sync line, so a script that logs rarely (or never)
        still has them."""
        counts = [(line.step, line.tokens) for line in self.steps[-1:]]
        counts += [(line.inner_steps, line.tokens) for line in self.syncs[-1:]]
        return max(counts, default=(0, 0))

    def outer_step(self) -> int:
        """The furthest outer step it reached: by a sync, or by a heal (``EventLine``)."""
        synced = [line.outer_step for line in self.syncs[-1:]]
        healed = [line.outer_step for line in self.events if line.outer_step is not None]
        return max(synced + healed, default=0)

    def behind(self) -> bool:
        """Its newest incarnation said it holds the rounds up (too slow for
        ``min_round_steps``) and has not caught up since."""
        newest = self.events_by_incarnation.get(self.incarnation, [])
        said = [line.event for line in newest if line.event in ("behind", "caught_up")]
        return bool(said) and said[-1] == "behind"

    def own_data(self) -> str | None:
        """What its newest incarnation said of the data its script trains on, where that is
        not the run's (``own_data``); None where it is the run's, or not said yet."""
        newest = self.events_by_incarnation.get(self.incarnation, [])
        return next((line.detail for line in newest if line.event == "own_data"), None)

    def latest_eval_loss(self) -> float | None:
        return next((s.eval_loss for s in reversed(self.syncs) if s.eval_loss is not None), None)

    def parameters(self) -> int:
        return max((event.parameters for event in self.events), default=0)

    def state(self) -> str:
        """started / done / failed / stopped, from the newest incarnation's events."""
        ending = self.ending()
        return ending.event if ending else "running"

    def ending(self) -> EventLine | None:
        """The newest incarnation's last lifecycle event, with its detail (why it failed)."""
        newest = self.events_by_incarnation.get(self.incarnation, [])
        lifecycle = [line for line in newest if line.event in LIFECYCLE]
        return lifecycle[-1] if lifecycle else None


class MetricsReader:
    """Reads a run's metrics; chunks are create-only, so each is fetched and checked once."""

    def __init__(self, store: Store, layout: RunLayout) -> None:
        self.store, self.layout = store, layout
        self._chunks: dict[str, MetricsChunk | None] = {}  # None: failed its checks

    def _fetch(self, keys: list[str]) -> None:
        for key, data in self.store.get_many(keys, limit=RECORD_READ_LIMIT).items():
            if data is None:
                continue  # deleted between the listing and the read
            try:
                self._chunks[key] = self._checked(decode_record(data, MetricsChunk, key=key), key)
            except WireFormatError as exc:
                log.warning("skipping metrics chunk: %s", exc)
                self._chunks[key] = None

    def _checked(self, chunk: MetricsChunk, key: str) -> MetricsChunk:
        """A chunk must sit at the key its own fields name (no credit to another replica)."""
        expected = self.layout.metrics_chunk(chunk.replica, chunk.incarnation, chunk.seq)
        if chunk.run != self.layout.run or key != expected:
            raise WireFormatError(
                key, f"chunk of {chunk.run}/{chunk.replica} belongs at {expected}"
            )
        return chunk

    def read(self) -> dict[str, ReplicaMetrics]:
        """Every replica's metrics, by replica id."""
        self._fetch(
            [k for k in self.store.list_prefix(self.layout.metrics()) if k not in self._chunks]
        )
        chunks = sorted(
            (chunk for chunk in self._chunks.values() if chunk is not None),
            key=lambda chunk: (chunk.replica, chunk.incarnation, chunk.seq),
        )
        replicas: dict[str, ReplicaMetrics] = {}
        for chunk in chunks:
            metrics = replicas.setdefault(chunk.replica, ReplicaMetrics(chunk.replica))
            events = metrics.events_by_incarnation.setdefault(chunk.incarnation, [])
            metrics.platform, metrics.incarnation = chunk.platform, chunk.incarnation
            by_kind = {"step": metrics.steps, "sync": metrics.syncs, "event": metrics.events}
            for line in chunk.lines:
                by_kind[line.kind].append(line)  # type: ignore[arg-type]
                if line.kind == "event":
                    events.append(line)  # type: ignore[arg-type]
                elif line.kind == "sync":
                    metrics.last_sync_by_incarnation[chunk.incarnation] = line  # type: ignore[assignment]
        return replicas

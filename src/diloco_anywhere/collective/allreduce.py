"""The all-reduce a replica calls: one bucket round per call, run in the background.

``allreduce`` returns at once with a ``Work``; the round (contribute, seal, reduce) runs on a
background thread, so inner steps go on meanwhile (the overlap of Streaming DiLoCo, arXiv
2501.18512). Several rounds can be in flight, one per fragment.

Rounds of one fragment run in order, each after the previous one has finished, while rounds of
different fragments overlap; each replica reports its newest finished round per fragment in its
lease, and a round's data is deleted once every live member has finished it (``collect.py``).
Deleting runs on its own thread after the round has returned its result: removing a round of
a multi-GiB pseudo-gradient takes a while, and no replica waits for it.

Membership is taken at the start of each round: this process claims a fresh incarnation when
the collective opens and keeps its lease alive with a heartbeat until it closes
(``membership.py``). Once a newer incarnation of its replica id is claimed, it is superseded:
every round it has in flight or starts fails with ``SupersededError``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from diloco_anywhere.bucket.codecs.codec import Codec
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.collect import RoundCollector
from diloco_anywhere.collective.errors import ModelMismatchError
from diloco_anywhere.collective.exchanges.gather import gather_mean
from diloco_anywhere.collective.exchanges.sharded import sharded_mean
from diloco_anywhere.collective.flat import FlatTensors
from diloco_anywhere.collective.members.departures import Departure, hopeless, newest_departures
from diloco_anywhere.collective.members.membership import (
    Clock,
    Membership,
    SupersededError,
)
from diloco_anywhere.collective.parts import Transfers, one_intra_op_thread
from diloco_anywhere.collective.policy import CollectiveConfig
from diloco_anywhere.collective.records import NO_PACE, Pace, Seal
from diloco_anywhere.collective.round import Round
from diloco_anywhere.collective.stream_order import StreamOrder

EXCHANGES = {"gather": gather_mean, "sharded": sharded_mean}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundResult:
    """How a round ended; its mean is in the tensors it was written into."""

    seal: Seal
    fingerprint: str  # of the sealed contributors' global state
    excluded: dict[str, str] = field(default_factory=dict)  # contributor -> why
    paces: dict[str, Pace] = field(default_factory=dict)  # sealed contributor -> its pace
    # this replica's thread-seconds per phase of the round (``phases.py``)
    seconds: dict[str, float] = field(default_factory=dict)


def _exchange(round_: Round, seal: Seal, destination: FlatTensors) -> RoundResult:
    EXCHANGES[seal.mode](round_, seal, destination)
    manifests = round_.sealed_manifests(seal)
    paces = {name: m.pace for name, m in zip(seal.contributors, manifests, strict=True)}
    return RoundResult(
        seal, manifests[0].fingerprint, dict(round_.excluded), paces, round_.times.seconds()
    )


def finish_round(round_: Round, destination: FlatTensors | None = None) -> RoundResult:
    """Wait for the round's SEAL, then exchange in the mode the SEAL names, writing the mean
    into ``destination`` (by default the tensors this replica contributed)."""
    try:
        seal = round_.wait_for_seal()
        round_.check_own_contribution(seal)
        target = destination or round_.source
        if target is None:
            raise ValueError("finish_round needs a destination when this replica contributed none")
        return _exchange(round_, seal, target)
    finally:
        round_.release()


class Work:
    """A round in flight. ``wait`` raises the round's error; ``get_future`` gives a
    ``torch.futures.Future`` completed with the tensor (or list) given to ``allreduce``, which
    then holds the mean."""

    def __init__(
        self, future: Future[RoundResult], tensor: torch.Tensor | list[torch.Tensor]
    ) -> None:
        self._future = future
        self.tensor = tensor

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the round is done (``TimeoutError`` after ``timeout`` seconds)."""
        self._future.result(timeout)
        return True

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> RoundResult:
        return self._future.result()

    def add_done_callback(self, callback: Callable[[Work], None]) -> None:
        """``callback(self)`` once the round is done (at once if it is), on the round's thread."""
        self._future.add_done_callback(lambda _: callback(self))

    def get_future(self) -> torch.futures.Future:
        torch_future: torch.futures.Future = torch.futures.Future()

        def complete(future: Future[RoundResult]) -> None:
            if (error := future.exception()) is not None:
                torch_future.set_exception(error)
            else:
                torch_future.set_result(self.tensor)

        self._future.add_done_callback(complete)
        return torch_future


class BucketCollective:
    """Weighted-mean all-reduce through ``store`` among the live replicas of ``run``."""

    def __init__(
        self,
        store: Store,
        run: str,
        replica: str,
        config: CollectiveConfig | None = None,
        retained_after: Callable[[], int] | None = None,
        rank: int = 0,
        *,
        wall_clock: Clock = time.time,
        on_superseded: Callable[[SupersededError], None] = lambda _: None,
        joined: float | None = None,
    ) -> None:
        """``retained_after()``: rounds after it are never collected (healing replays them).
        ``rank``: the process of a sharded replica this collective exchanges the shard of, in
        that rank's own membership and rounds (``RunLayout``). ``wall_clock``: this machine's
        clock, only written for people and compared with the store's (tests skew it).
        ``joined``: when the replica began to join (``time.monotonic``; by default now), which
        its waits to agree on the run's records count from (``bucket/agreement.py``).
        ``on_superseded(error)``: called once, on the heartbeat's thread, when a newer
        incarnation of ``replica`` is claimed (the replica process ends itself there)."""
        self.store = store
        self.config = config or CollectiveConfig()
        self.layout = RunLayout(run, rank)
        # when the replica began to join (``time.monotonic``): its waits to agree count from it
        self.joined = time.monotonic() if joined is None else joined
        self._finished: dict[int, int] = {}  # fragment -> newest round this replica finished
        self._collector = RoundCollector(
            store, self.layout, self.config.keep_rounds, retained_after
        )
        self.membership = Membership(
            store, self.layout, replica, self.config.lease, wall_clock=wall_clock,
            progress=lambda: dict(self._finished), on_superseded=on_superseded,
        )  # fmt: skip
        self.me = self.membership.me
        self._executor = ThreadPoolExecutor(
            self.config.max_rounds_in_flight,
            thread_name_prefix="allreduce",
            initializer=one_intra_op_thread,
        )
        policy = self.config.round
        self._transfers = Transfers.create(
            policy.window, self.config.max_rounds_in_flight, policy.window_max
        )
        self._latest: dict[int, Future[RoundResult]] = {}  # per fragment
        self._collecting = ThreadPoolExecutor(1, thread_name_prefix="collect")

    @property
    def window(self) -> int:
        """Parts in flight for the rounds starting now (``transfers.AdaptiveWindow``)."""
        return self._transfers.window

    def allreduce(
        self,
        tensor: torch.Tensor | list[torch.Tensor],
        *,
        round_: int,
        fragment: int = 0,
        weight: float = 1.0,
        codec: Codec | None = None,
        fingerprint: str | Callable[[], str] = "",
        source: torch.Tensor | None = None,
        pace: Pace = NO_PACE,
    ) -> Work:
        """Start round ``round_`` of ``fragment`` with this replica's ``tensor``; returns at
        once. When the round is done, ``tensor`` holds the mean, written in place.
        ``source``: what to contribute instead of ``tensor``'s values, as many (error
        feedback's compensated buffer, ``bucket/feedback.py``); the mean still goes into
        ``tensor``, and ``source`` too must stay untouched until the work is done.

        Nothing is copied: the round's threads read ``tensor`` part by part as they upload it,
        and write the mean into it part by part as reduced parts arrive, so a sync adds a
        window of parts to host memory, not copies of the payload (docs/collective.md,
        "Memory"). The caller must therefore neither write nor rely on ``tensor`` until the
        work is done; after a failed round its values are undefined (part mean, part its
        own). torchft's DiLoCo keeps to this: ``prepare_sync`` makes fresh pseudo-gradient
        tensors and sends them, and touches them again only in ``perform_sync``, after every
        work's ``wait`` (torchft/local_sgd.py, ``_save_grads`` and ``_set_grads``); the
        manager relies on that. A list of tensors (contiguous, floating point, one device) is
        one contribution, their values in order.
        ``fingerprint`` names this replica's global state: only contributions with the same
        fingerprint are averaged together (docs/collective.md, "Integrity"). A callable is
        called on the round's thread, off the training thread; what it reads must not change
        until the round is done (DiLoCo changes its global state only after the round).
        ``pace``: how the contribution was trained, recorded in its manifest for the others.
        """
        self.membership.check()
        destination = FlatTensors(tensor if isinstance(tensor, list) else [tensor])
        contribution = destination if source is None else FlatTensors([source])
        if contribution.numel != destination.numel:
            raise ValueError(
                f"source has {contribution.numel} values, the tensors {destination.numel}"
            )
        future = self._executor.submit(
            self._run_round, contribution, destination, round_, fragment, weight,
            codec or self.config.codec, fingerprint, self._latest.get(fragment),
            StreamOrder(destination.device), pace,
        )  # fmt: skip
        self._latest[fragment] = future
        return Work(future, tensor)

    def _run_round(
        self,
        source: FlatTensors,
        destination: FlatTensors,
        round_: int,
        fragment: int,
        weight: float,
        codec: Codec,
        fingerprint: str | Callable[[], str],
        previous: Future[RoundResult] | None,
        order: StreamOrder,
        pace: Pace,
    ) -> RoundResult:
        if previous is not None:  # submitted earlier, so running or done: no deadlock
            wait([previous])
        order.before_reading()  # the caller's queued GPU work first (``stream_order.py``)
        if callable(fingerprint):
            fingerprint = fingerprint()
        members = self.membership.members  # raises SupersededError: a zombie contributes nothing
        round_state = Round(
            self.store, self.layout, round_, fragment, self.me, members(),
            self.config.round, members, self.config.lease.period, self._transfers,
            departures=self.departures,
        )  # fmt: skip
        round_state.contribute(source, weight, codec, fingerprint, pace)
        result = finish_round(round_state, destination)
        order.after_writing()
        self._finished[fragment] = round_
        if result.seal.contributors[0] == self.me.name:
            self._collecting.submit(self._collect_garbage, round_, fragment)
        return result

    def observe(
        self,
        round_: int,
        numel: int,
        fragment: int = 0,
        into: Sequence[torch.Tensor] | None = None,
    ) -> tuple[RoundResult, torch.Tensor | None] | None:
        """The result and the flat mean of a round sealed without us (None while it has no
        SEAL), read as any replica reads it: a replica catching up replays it
        (``healing.py``). ``numel`` is the size of this replica's fragment: a round of another
        size is refused before anything of its size is allocated. ``into``: tensors to write
        the mean into, in order, instead (a healing replica's parameters, which it does not
        need meanwhile: no copy of the model is allocated); then no mean is returned."""
        observer = self._observer(round_, fragment)
        try:
            seal = observer.read_seal()
            if seal is None:
                return None
            sealed = observer.sealed_manifests(seal)[0].numel
            if sealed != numel:
                raise ModelMismatchError(
                    f"round {round_} does not apply to this model: its result has {sealed} "
                    f"values, the fragment {numel}"
                )
            mean = torch.empty(numel) if into is None else None
            result = _exchange(observer, seal, FlatTensors([mean] if into is None else into))
            return result, mean
        finally:
            observer.release()

    def sealed_fingerprint(self, round_: int, fragment: int = 0) -> str | None:
        """The fingerprint of the global state a round was sealed from (None while it has no
        SEAL), read from its records only: whether a state is the one the run went on from."""
        observer = self._observer(round_, fragment)
        try:
            seal = observer.read_seal()
            return None if seal is None else observer.sealed_manifests(seal)[0].fingerprint
        finally:
            observer.release()

    def sealed_contributors(self, round_: int, fragment: int = 0) -> tuple[str, ...]:
        """Who a round was sealed with (none while it has no SEAL): the writers of its
        checkpoint's shards, whoever commits it."""
        observer = self._observer(round_, fragment)
        try:
            seal = observer.read_seal()
            return () if seal is None else tuple(seal.contributors)
        finally:
            observer.release()

    def _observer(self, round_: int, fragment: int) -> Round:
        return Round(
            self.store, self.layout, round_, fragment, self.me, [], self.config.round,
            transfers=self._transfers,
        )  # fmt: skip

    def _collect_garbage(self, round_: int, fragment: int) -> None:
        """The first sealed contributor collects what no live member needs (``collect.py``);
        our own progress is current, the others' comes from their leases. Best effort: a
        failure is logged, and the next round's collection retries."""
        try:
            progress = self.membership.progress(self.membership.members())
            progress[self.me.name] = dict(self._finished)
            self._collector.collect(fragment, round_, progress.values())
        except Exception as exc:  # off the round's path: nobody else would see it
            log.warning("garbage collection after round %d fragment %d: %s", round_, fragment, exc)

    def close(self, wait: bool = True, reason: str = "", final: bool = False) -> None:
        """Stop the heartbeat; with ``wait``, first let rounds in flight finish. ``reason``:
        why this replica leaves, for the others (``final``: no restart can help)."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        self._collecting.shutdown(wait=wait, cancel_futures=not wait)
        self._transfers.executor.shutdown(wait=wait, cancel_futures=not wait)
        self.membership.leave(reason, final)

    def departures(self) -> dict[str, Departure]:
        """How the replicas that left the run left (``departures.py``), as of the membership
        this process listed last."""
        view = self.membership.last_view or self.membership.view()
        return newest_departures(self.store, self.layout, view.newest())

    def hopeless(self) -> str | None:
        """Why no round of the run can seal again (its replicas that stopped for good leave
        too few, ``departures.hopeless``); None while one can."""
        policy = self.config.round
        return hopeless(self.departures(), policy.expected_replicas, policy.min_replicas)

    def __enter__(self) -> BucketCollective:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """On an error (or a stop), do not wait for rounds in flight: they may take up to the
        round timeout, and a platform kills a stopped job a few seconds after SIGTERM."""
        self.close(wait=exc_type is None)

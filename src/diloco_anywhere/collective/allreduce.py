"""The all-reduce a replica calls: one bucket round per call, run in the background.

``allreduce`` returns at once with a ``Work``; the round (contribute, seal, reduce) runs on a
background thread, so inner steps go on meanwhile (the overlap of Streaming DiLoCo, arXiv
2501.18512). Several rounds can be in flight, one per fragment.

Rounds of one fragment run in order, each after the previous one has finished, while rounds of
different fragments overlap; each replica reports its newest finished round per fragment in its
lease, and a round's data is deleted once every live member has finished it (``collect.py``).

Membership is taken at the start of each round: this process claims a fresh incarnation when
the collective opens and keeps its lease alive with a heartbeat until it closes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from diloco_anywhere.codec import Codec, make_codec
from diloco_anywhere.collective.collect import RoundCollector
from diloco_anywhere.collective.gather import gather_mean
from diloco_anywhere.collective.membership import (
    Heartbeat,
    LeasePolicy,
    claim_incarnation,
    live_members,
    member_progress,
)
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.collective.round import Round, RoundPolicy
from diloco_anywhere.collective.sharded import sharded_mean
from diloco_anywhere.layout import Participant, RunLayout
from diloco_anywhere.store import Store

EXCHANGES = {"gather": gather_mean, "sharded": sharded_mean}


@dataclass(frozen=True)
class RoundResult:
    mean: torch.Tensor  # flat float32
    seal: Seal
    fingerprint: str  # of the sealed contributors' global state
    excluded: dict[str, str] = field(default_factory=dict)  # contributor -> why


def _exchange(round_: Round, seal: Seal) -> RoundResult:
    mean = EXCHANGES[seal.mode](round_, seal)
    fingerprint = round_.sealed_manifests(seal)[0].fingerprint
    return RoundResult(mean, seal, fingerprint, dict(round_.excluded))


def finish_round(round_: Round) -> RoundResult:
    """Wait for the round's SEAL, then exchange in the mode the SEAL names."""
    seal = round_.wait_for_seal()
    round_.check_own_contribution(seal)
    return _exchange(round_, seal)


@dataclass(frozen=True)
class CollectiveConfig:
    codec: Codec = field(default_factory=lambda: make_codec("fp32"))
    round: RoundPolicy = field(default_factory=RoundPolicy)
    lease: LeasePolicy = field(default_factory=LeasePolicy)
    max_rounds_in_flight: int = 4  # e.g. one per Streaming DiLoCo fragment
    keep_rounds: int = 2  # per fragment: the newest rounds never collected (collect.py)


class Work:
    """A round in flight. ``wait`` raises the round's error; ``get_future`` gives a
    ``torch.futures.Future`` completed with the mean (the shape of the input tensor)."""

    def __init__(self, future: Future[RoundResult], shape: torch.Size) -> None:
        self._future = future
        self._shape = shape

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

    def mean(self) -> torch.Tensor:
        return self.result().mean.view(self._shape)

    def get_future(self) -> torch.futures.Future:
        torch_future: torch.futures.Future = torch.futures.Future()

        def complete(future: Future[RoundResult]) -> None:
            if (error := future.exception()) is not None:
                torch_future.set_exception(error)
            else:
                torch_future.set_result(future.result().mean.view(self._shape))

        self._future.add_done_callback(complete)
        return torch_future


def _one_intra_op_thread() -> None:
    """Round threads do memory-bound work (copies, CRC32C, sums). Left at the default, each
    thread that runs torch ops gets its own OpenMP team, whose spinning threads take the cores
    from training: one more team per round thread, a slower inner step each time (measured in
    docs/benchmarks.md, "Inner-loop throughput"). The setting is per thread; training's own
    threads keep theirs."""
    torch.set_num_threads(1)


class BucketCollective:
    """Weighted-mean all-reduce through ``store`` among the live replicas of ``run``."""

    def __init__(
        self,
        store: Store,
        run: str,
        replica: str,
        config: CollectiveConfig | None = None,
        retained_after: Callable[[], int] | None = None,
    ) -> None:
        """``retained_after()``: rounds after it are never collected (healing replays them)."""
        self.store = store
        self.config = config or CollectiveConfig()
        self.layout = RunLayout(run)
        self.me = Participant(replica, claim_incarnation(store, self.layout, replica))
        self._finished: dict[int, int] = {}  # fragment -> newest round this replica finished
        self._collector = RoundCollector(
            store, self.layout, self.config.keep_rounds, retained_after
        )
        self._heartbeat = Heartbeat(
            store, self.layout, self.me, self.config.lease, progress=lambda: dict(self._finished)
        ).start()
        self._executor = ThreadPoolExecutor(
            self.config.max_rounds_in_flight,
            thread_name_prefix="allreduce",
            initializer=_one_intra_op_thread,
        )
        self._latest: dict[int, Future[RoundResult]] = {}  # per fragment

    def allreduce(
        self,
        tensor: torch.Tensor | list[torch.Tensor],
        *,
        round_: int,
        fragment: int = 0,
        weight: float = 1.0,
        codec: Codec | None = None,
        fingerprint: str | Callable[[], str] = "",
    ) -> Work:
        """Start round ``round_`` of ``fragment`` with this replica's ``tensor``; returns at once.

        The tensor is copied (to CPU float32) before this returns, so the caller may change it.
        A list of tensors is one contribution, their values in order (flat result), gathered
        in that same single copy (a sync's many parameters).
        ``fingerprint`` names this replica's global state: only contributions with the same
        fingerprint are averaged together (docs/collective.md, "Integrity"). A callable is
        called on the round's thread, off the training thread; what it reads must not change
        until the round is done (DiLoCo changes its global state only after the round).
        """
        tensors = tensor if isinstance(tensor, list) else [tensor]
        # torch.cat always allocates: exactly one copy, whatever the device and dtype.
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
        future = self._executor.submit(
            self._run_round, flat, round_, fragment, weight, codec or self.config.codec,
            fingerprint, self._latest.get(fragment),
        )  # fmt: skip
        self._latest[fragment] = future
        return Work(future, flat.shape if isinstance(tensor, list) else tensor.shape)

    def _run_round(
        self,
        flat: torch.Tensor,
        round_: int,
        fragment: int,
        weight: float,
        codec: Codec,
        fingerprint: str | Callable[[], str],
        previous: Future[RoundResult] | None,
    ) -> RoundResult:
        if previous is not None:  # submitted earlier, so running or done: no deadlock
            wait([previous])
        if callable(fingerprint):
            fingerprint = fingerprint()
        round_state = Round(
            self.store, self.layout, round_, fragment, self.me, self._members(),
            self.config.round, self._members, self.config.lease.period,
        )  # fmt: skip
        round_state.contribute(flat, weight, codec, fingerprint)
        result = finish_round(round_state)
        self._finished[fragment] = round_
        self._collect_garbage(round_, fragment, result)
        return result

    def observe(self, round_: int, fragment: int = 0) -> RoundResult | None:
        """The result of a round sealed without us (None while it has no SEAL), read as any
        replica reads it: a replica catching up replays it (``healing.py``)."""
        observer = Round(self.store, self.layout, round_, fragment, self.me, [], self.config.round)
        seal = observer.read_seal()
        return None if seal is None else _exchange(observer, seal)

    def _members(self) -> list[Participant]:
        members = live_members(self.store, self.layout, self.config.lease, time.time())
        if self.me not in members:  # our lease was late (e.g. a stalled store); we are a member
            members = sorted([*members, self.me], key=lambda member: member.name)
        return members

    def _collect_garbage(self, round_: int, fragment: int, result: RoundResult) -> None:
        """The first sealed contributor collects what no live member needs (``collect.py``);
        our own progress is current, the others' comes from their leases."""
        if result.seal.contributors[0] != self.me.name:
            return
        members = self._members()
        progress = member_progress(self.store, self.layout, members, self.config.lease, time.time())
        progress[self.me.name] = dict(self._finished)
        self._collector.collect(fragment, round_, progress.values())

    def close(self, wait: bool = True) -> None:
        """Stop the heartbeat; with ``wait``, first let rounds in flight finish."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        self._heartbeat.stop()

    def __enter__(self) -> BucketCollective:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """On an error (or a stop), do not wait for rounds in flight: they may take up to the
        round timeout, and a platform kills a stopped job a few seconds after SIGTERM."""
        self.close(wait=exc_type is None)

"""A drop-in for ``torchft.Manager`` as torchft's ``DiLoCo`` and ``LocalSGD`` use it, synced
through the bucket instead of a Lighthouse and a process group.

torchft's DiLoCo (``torchft/local_sgd.py``, 0.2.0) drives a sync like this: ``start_quorum()``;
``allreduce(tensor)`` once per parameter (or per bucket with ``use_bucketization``, adding a
``then`` callback that copies the result back), keeping each returned work; later
``work.wait()`` on each; then ``should_commit()``, which advances the step when it returns
True and otherwise makes DiLoCo restore the global weights. With ``fragment_sync_delay`` > 0
the inner steps in between run while the sync is in flight.

One sync is one bucket round, however many tensors it holds: the tensors are one contribution,
read part by part straight from them. The batch is sent when it is complete, which the call
sequence tells deterministically: the first ``wait()`` on a work, ``should_commit()``, or the
next inner step's ``disallow_state_dict_read()`` (DiLoCo's optimizer pre-hook). The mean is
written into the given tensors in place, as torchft's average is, part by part as the round
delivers it; no copy of the batch is made, which relies on DiLoCo leaving its pseudo-gradient
tensors alone from ``allreduce`` until the works are waited for (``BucketCollective.allreduce``).

As in torchft, a failed sync does not raise from ``allreduce`` or ``wait``: the error is kept,
``errored()`` returns it and ``should_commit()`` returns False.

With error feedback (``codec = "sparse"``, SparseLoCo, arXiv 2508.15706) a sync sends not the
pseudo-gradient but this fragment's accumulator, the pseudo-gradient added to what earlier
syncs left out (``bucket/feedback.py``); the mean still goes into DiLoCo's tensors. Once the
sync is committed with this replica's contribution in its mean, the accumulator keeps only what
the codec dropped; otherwise it keeps everything, for the next sync of the fragment. Fragment
``f`` is the one torchft syncs at step ``s``: ``s % fragments`` (``DiLoCo._current_fragment``).

Every contribution carries a fingerprint of this replica's global state: the committed step and
a CRC32C over the state DiLoCo registered (each fragment's global weights and outer optimizer,
``global_state.py``). Replicas holding the same state have the same fingerprint; one that
missed a commit, made one the others did not, or computed the outer step differently no longer
matches, is left out of rounds, and gets a ``DivergedError`` instead of a result to apply.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp

from diloco_anywhere.bucket.codecs.codec import Codec
from diloco_anywhere.bucket.feedback import ErrorFeedback
from diloco_anywhere.collective.allreduce import BucketCollective, RoundResult, Work
from diloco_anywhere.collective.plain import Collective
from diloco_anywhere.collective.records import NO_PACE, Pace, check_weight
from diloco_anywhere.training.state.fingerprints import fingerprint
from diloco_anywhere.training.state.global_state import state_tree, tree_checksum

log = logging.getLogger(__name__)
FRAGMENT_KEY = "StreamingDiLoCoFragment_"  # how torchft's DiLoCo registers each fragment's state
StateDictFns = tuple[Callable[[Any], None], Callable[[], Any]]
Batch = list[tuple[torch.Tensor, torch.futures.Future]]


@dataclass
class _Sync:
    """One sync's state. Round callbacks write only to their own ``_Sync``, so a late
    callback of an abandoned round cannot touch the next one."""

    batch: Batch = field(default_factory=list)
    quantize: bool = False
    codec: Codec | None = None  # as sent
    stream: int | None = None  # the error-feedback stream it sent, if any
    work: Work | None = None
    result: RoundResult | None = None
    fingerprint: str = ""  # this replica's, as sent
    error: Exception | None = None
    written_back: threading.Event = field(default_factory=threading.Event)


class SyncWork:
    """What ``allreduce`` returns: torchft's ``Work`` surface (``wait``, ``get_future``)."""

    def __init__(self, manager: BucketManager, future: torch.futures.Future) -> None:
        self._manager, self._future = manager, future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Send the batch if not sent yet; return once the results, and the ``then``
        callbacks of every future of the batch, are done (or the wait timed out)."""
        self._manager.send()
        self._manager.wait_for_round(timeout)
        return True

    def get_future(self) -> torch.futures.Future:
        """Completed with the averaged tensor once the round is done (``then`` callbacks run
        then); waiting on it directly does not send the batch: ``wait()`` does."""
        return self._future


class BucketManager:
    """The ``torchft.Manager`` surface DiLoCo uses, backed by a ``BucketCollective``.

    The collective's config says what goes on the wire: its ``codec`` for every sync, its
    ``quantized_codec`` for those torchft asks to quantize (``should_quantize=True``).
    ``min_replicas``: a round sealed with fewer
    contributors is not committed. Each contribution is weighted by ``set_weight`` (the tokens
    a replica trained on per sync, which differ when platforms run different batch sizes).
    """

    _use_async_quorum = False  # DiLoCo refuses an async quorum

    def __init__(
        self,
        collective: BucketCollective,
        *,
        min_replicas: int = 1,
        timeout: timedelta = timedelta(minutes=10),
        feedback: ErrorFeedback | None = None,
    ) -> None:
        """``feedback``: the error feedback every sync goes through (None: none)."""
        self._collective = collective
        self.feedback = feedback
        self._codec = collective.config.codec
        self._quantized_codec = collective.config.quantized_codec
        self._min_replicas, self._timeout = min_replicas, timeout
        self._step = self._batches_committed = 0
        self._sync = 0  # bucket round of the next sync: advances on every sync, committed or not
        self._weight = 1.0
        # how this replica trained the contribution being sent, read when it is sent
        self.pace: Callable[[], Pace] = lambda: NO_PACE
        # the global state's checksum, each sync's fingerprint (``GlobalState.checksum``)
        self.state_checksum: Callable[[], int] = self._saved_state_checksum
        # called before the outer step changes the global state (a checkpoint being written
        # from it waits until its parts are on local disk: ``CheckpointWriter.release``)
        self.before_state_changes: Callable[[], None] = lambda: None
        self._current = _Sync()
        self._last: RoundResult | None = None
        self._state_dict_fns: dict[str, StateDictFns] = {}
        self.syncs_attempted = 0  # should_commit calls: one per fragment sync
        self.last_sync_error: Exception | None = None  # of the last should_commit
        self.last_result: RoundResult | None = None  # of the last should_commit, if it has one
        self.last_fingerprint = ""  # sent in the last should_commit's round
        self.exposed_seconds = 0.0  # time the training thread spent blocked on syncs

    @classmethod
    def over(cls, collective: Collective) -> BucketManager:
        """The manager for a script that builds torchft's ``DiLoCo`` itself, syncing through
        ``collective``'s store with its rounds' settings (docs/api.md, "torchft's DiLoCo, built
        by hand"). Leaving ``collective`` ends it; there is no healing, checkpoint or metric:
        ``join`` and ``Replica.diloco`` give those."""
        policy = collective.rounds.config.round
        return cls(
            collective.rounds, min_replicas=policy.min_replicas,
            timeout=timedelta(seconds=2 * policy.timeout),  # a seal, then a reduce
        )  # fmt: skip

    # -- a sync --------------------------------------------------------------------------------

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False, **_: Any) -> None:
        """Begin a sync. There is no quorum to wait for: a round's SEAL decides who is in."""
        self._current = _Sync()

    def wait_quorum(self) -> None:
        """Nothing to wait for (see ``start_quorum``)."""

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ReduceOp.AVG
    ) -> SyncWork:
        """Add ``tensor`` to this sync's batch; it is averaged in place once the round is done."""
        if reduce_op != ReduceOp.AVG:
            raise ValueError(f"reduce_op {reduce_op}: the bucket collective averages (AVG) only")
        if self._current.work is not None:
            raise RuntimeError("allreduce after this sync was sent: call start_quorum() first")
        future: torch.futures.Future = torch.futures.Future()
        self._current.batch.append((tensor, future))
        self._current.quantize |= should_quantize
        return SyncWork(self, future)

    def _saved_state_checksum(self) -> int:
        """The registered state's checksum through its save functions (which copy it: a
        replica's ``GlobalState`` sets ``state_checksum`` to one that reads it in place)."""
        return tree_checksum(state_tree(self._state_dict_fns))

    def send(self) -> None:
        """Send the batch as one round (once; later calls do nothing)."""
        sync = self._current
        if sync.work is not None or not sync.batch:
            return
        started, step = time.perf_counter(), self._step
        tensors = [tensor for tensor, _ in sync.batch]
        sync.codec = self._quantized_codec if sync.quantize else self._codec
        source = None
        if self.feedback is not None:
            sync.stream = self._fragment()
            source = self.feedback.compensate(sync.stream, tensors)
        sync.work = self._collective.allreduce(
            tensors,
            round_=self._sync,
            weight=self._weight,
            codec=sync.codec,
            fingerprint=lambda: self._fingerprint_for(sync, step),
            source=source,
            pace=self.pace(),
        )
        self._sync += 1
        sync.work.add_done_callback(lambda work: self._complete(sync, work))
        self.exposed_seconds += time.perf_counter() - started

    def _fragment(self) -> int:
        """The fragment torchft's DiLoCo syncs now: its step modulo its fragments."""
        fragments = sum(key.startswith(FRAGMENT_KEY) for key in self._state_dict_fns)
        return self._step % max(1, fragments)

    def _fingerprint_for(self, sync: _Sync, step: int) -> str:
        """Checksummed on the round's thread: DiLoCo changes its state only after the round."""
        sync.fingerprint = fingerprint(step, self.state_checksum())
        return sync.fingerprint

    @staticmethod
    def complete_futures(sync: _Sync) -> None:
        """Complete the batch's futures (running DiLoCo's ``then`` callbacks), error or not,
        as torchft does, and only then signal ``written_back``."""
        for tensor, future in sync.batch:
            future.set_result(tensor)
        sync.written_back.set()

    @classmethod
    def _complete(cls, sync: _Sync, work: Work) -> None:
        """On the round's thread: the mean is in the batch's tensors; keep the result, or the
        error as the sync's."""
        try:
            sync.result = work.result()
        except Exception as exc:
            log.warning("sync failed: %s", exc)
            sync.error = exc
        cls.complete_futures(sync)

    def wait_for_round(self, timeout: timedelta | None = None) -> None:
        """Wait until this sync's results are in place, or keep a timeout as its error."""
        sync = self._current
        if sync.work is None:
            return
        started = time.perf_counter()
        seconds = (timeout or self._timeout).total_seconds()
        if not sync.written_back.wait(seconds):
            sync.error = sync.error or TimeoutError(
                f"sync {self._sync - 1} not done after {seconds:g}s; raise sync.timeout in "
                f"run.toml if rounds are this slow"
            )
        self.exposed_seconds += time.perf_counter() - started

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """True when this sync's round finished without error among at least ``min_replicas``;
        then the step advances. DiLoCo restores the global weights on False."""
        self.send()
        self.wait_for_round(timeout)
        sync = self._current
        commit = sync.error is None and (
            sync.result is None or len(sync.result.seal.contributors) >= self._min_replicas
        )
        return self.conclude(sync, commit)

    def conclude(self, sync: _Sync, commit: bool) -> bool:
        """Account for the sync decided ``commit`` and start a fresh one; the error feedback
        keeps what the codec dropped of a contribution the committed mean holds, and all of
        one it does not (on the training thread: an encode and a decode of the fragment,
        counted as exposed sync time)."""
        self.before_state_changes()
        if commit and sync.stream is not None and self._holds_us(sync.result):
            started = time.perf_counter()
            self.feedback.applied(sync.stream, sync.codec)  # type: ignore[union-attr, arg-type]
            self.exposed_seconds += time.perf_counter() - started
        self.syncs_attempted += 1
        self.last_result, self.last_fingerprint = sync.result, sync.fingerprint
        if commit:
            if sync.result is not None:
                self._last = sync.result
            self._step += 1
            self._batches_committed += self.num_participants()
        self.last_sync_error = sync.error
        self._current = _Sync()
        return commit

    def set_weight(self, weight: float) -> None:
        """This replica's weight in the next syncs (e.g. tokens per sync): > 0, at most 2^64."""
        self._weight = check_weight(weight)

    # -- state ---------------------------------------------------------------------------------

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def num_participants(self) -> int:
        """Contributors of the last committed round (1 before any)."""
        return len(self._last.seal.contributors) if self._last else 1

    def participating_rank(self) -> int | None:
        if self._last is None:
            return 0
        names = self._last.seal.contributors
        me = self._collective.me.name
        return names.index(me) if me in names else None

    def _holds_us(self, result: RoundResult | None) -> bool:
        """Whether a round's SEAL holds this replica's contribution."""
        return result is not None and self._collective.me.name in result.seal.contributors

    def contributed(self) -> bool:
        """Whether this replica's contribution is in the last sync's SEAL."""
        return self._holds_us(self.last_result)

    def traffic(self) -> tuple[int, int]:
        """Bytes this replica sent and received through the bucket so far."""
        stats = self._collective.store.stats()
        return stats.bytes_up, stats.bytes_down

    def is_participating(self) -> bool:
        return True  # a late replica is left out of a SEAL but still receives the result

    def report_error(self, e: Exception) -> None:
        self._current.error = e

    def errored(self) -> Exception | None:
        return self._current.error

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """DiLoCo registers each fragment's global state: fingerprinted, checkpointed, healed."""
        self._state_dict_fns[key] = (load_state_dict, state_dict)

    @property
    def state_dict_fns(self) -> dict[str, StateDictFns]:
        return self._state_dict_fns

    def last_round(self) -> int:
        """The bucket round of the last sync sent."""
        return self._sync - 1

    def allow_state_dict_read(self) -> None:
        """Called by DiLoCo after each inner step: nothing to do."""

    def disallow_state_dict_read(self) -> None:
        """Called by DiLoCo before each inner step: a batch still unsent is complete now."""
        self.send()

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self._step,
            "batches_committed": self._batches_committed,
            "sync": self._sync,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = state_dict["step"]
        self._batches_committed = state_dict["batches_committed"]
        self._sync = state_dict.get("sync", self._sync)

    def shutdown(self, wait: bool = True) -> None:
        self._collective.close()

"""A drop-in for ``torchft.Manager`` as torchft's ``DiLoCo`` and ``LocalSGD`` use it, synced
through the bucket instead of a Lighthouse and a process group.

torchft's DiLoCo (``torchft/local_sgd.py``, 0.2.0) drives a sync like this: ``start_quorum()``;
``allreduce(tensor)`` once per parameter (or per bucket with ``use_bucketization``), keeping
each returned work; later ``work.wait()`` on each; then ``should_commit()``, which advances
the step when it returns True and otherwise makes DiLoCo restore the global weights. With
``fragment_sync_delay`` > 0 the inner steps in between run while the sync is in flight.

One sync is one bucket round, however many tensors it holds: the tensors are coalesced into one
flat contribution. The batch is sent when it is complete, which the call sequence tells
deterministically: the first ``wait()`` on a work, ``should_commit()``, or the next inner
step's ``disallow_state_dict_read()`` (DiLoCo's optimizer pre-hook). Results are written back
into the given tensors in place, as torchft's average is.

As in torchft, a failed sync does not raise from ``allreduce`` or ``wait``: the error is kept,
``errored()`` returns it and ``should_commit()`` returns False.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp

from diloco_anywhere.codec import Codec, make_codec
from diloco_anywhere.collective.allreduce import BucketCollective, RoundResult, Work

log = logging.getLogger(__name__)
StateDictFns = tuple[Callable[[Any], None], Callable[[], Any]]


class SyncWork:
    """What ``allreduce`` returns: torchft's ``Work`` surface (``wait``, ``get_future``)."""

    def __init__(self, manager: BucketManager, future: torch.futures.Future) -> None:
        self._manager, self._future = manager, future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Send the batch if not sent yet, then wait for this tensor's result."""
        self._manager.send()
        self._manager.wait_for_round(timeout)
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        """Completed with the averaged tensor once the round is done (``then`` callbacks run
        then); waiting on it directly does not send the batch: ``wait()`` does."""
        return self._future


class BucketManager:
    """The ``torchft.Manager`` surface DiLoCo uses, backed by a ``BucketCollective``.

    ``codec`` encodes every sync; ``quantized_codec`` (int8 by default) those that torchft
    asks to quantize (``should_quantize=True``). ``min_replicas``: a round sealed with fewer
    contributors is not committed. Each contribution is weighted by ``set_weight`` (e.g. the
    tokens processed since the last sync), 1.0 by default.
    """

    _use_async_quorum = False  # DiLoCo refuses an async quorum

    def __init__(
        self,
        collective: BucketCollective,
        *,
        codec: Codec | None = None,
        quantized_codec: Codec | None = None,
        min_replicas: int = 1,
        timeout: timedelta = timedelta(minutes=10),
    ) -> None:
        self._collective = collective
        self._codec = codec or collective.config.codec
        self._quantized_codec = quantized_codec or make_codec("int8")
        self._min_replicas, self._timeout = min_replicas, timeout
        self._step = self._batches_committed = 0
        self._sync = 0  # bucket round of the next sync: advances on every sync, committed or not
        self._weight = 1.0
        self._pending: list[tuple[torch.Tensor, torch.futures.Future]] = []
        self._quantize = False
        self._round: Work | None = None
        self._written_back = threading.Event()  # the round's results are in the tensors
        self._last: RoundResult | None = None
        self._errored: Exception | None = None
        self._state_dict_fns: dict[str, StateDictFns] = {}
        self.syncs_attempted = 0  # should_commit calls: one per fragment sync
        self.exposed_seconds = 0.0  # time the training thread spent blocked on syncs

    # -- a sync --------------------------------------------------------------------------------

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False, **_: Any) -> None:
        """Begin a sync. There is no quorum to wait for: a round's SEAL decides who is in."""
        self._errored, self._pending, self._round = None, [], None

    def wait_quorum(self) -> None:
        """Nothing to wait for (see ``start_quorum``)."""

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ReduceOp.AVG
    ) -> SyncWork:
        """Add ``tensor`` to this sync's batch; it is averaged in place once the round is done."""
        if reduce_op != ReduceOp.AVG:
            raise ValueError(f"reduce_op {reduce_op}: the bucket collective averages (AVG) only")
        if self._round is not None:
            raise RuntimeError("allreduce after this sync was sent: call start_quorum() first")
        future: torch.futures.Future = torch.futures.Future()
        self._pending.append((tensor, future))
        self._quantize = self._quantize or should_quantize
        return SyncWork(self, future)

    def send(self) -> None:
        """Send the batch as one round (once; later calls do nothing)."""
        if self._round is not None or not self._pending:
            return
        started = time.perf_counter()
        flat = torch.cat(
            [t.detach().reshape(-1).to("cpu", torch.float32) for t, _ in self._pending]
        )
        codec = self._quantized_codec if self._quantize else self._codec
        self._round = self._collective.allreduce(
            flat, round_=self._sync, weight=self._weight, codec=codec
        )
        self._sync += 1
        self._written_back.clear()
        self._round.add_done_callback(self._complete(list(self._pending)))
        self.exposed_seconds += time.perf_counter() - started

    def _complete(self, batch: list[tuple[torch.Tensor, torch.futures.Future]]):
        """Write the mean back into the batch's tensors and complete their futures; on error
        keep it (``errored``) and complete them anyway, as torchft does."""

        def callback(work: Work) -> None:
            try:
                result = work.result()
                offset = 0
                for tensor, _ in batch:
                    values = result.mean[offset : offset + tensor.numel()].view(tensor.shape)
                    with torch.no_grad():
                        tensor.copy_(values)
                    offset += tensor.numel()
                self._last = result
            except Exception as exc:
                log.warning("sync %d failed: %s", self._sync - 1, exc)
                self.report_error(exc)
            self._written_back.set()
            for tensor, future in batch:
                future.set_result(tensor)

        return callback

    def wait_for_round(self, timeout: timedelta | None = None) -> None:
        """Wait until the round's results are in the tensors, or keep a timeout as the error."""
        if self._round is None:
            return
        started = time.perf_counter()
        try:
            self._round.wait((timeout or self._timeout).total_seconds())
            self._written_back.wait()
        except TimeoutError as exc:
            self.report_error(exc)
        except Exception:  # the round's own error: the done callback keeps it
            self._written_back.wait()
        finally:
            self.exposed_seconds += time.perf_counter() - started

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """True when this sync's round finished without error among at least ``min_replicas``;
        then the step advances. DiLoCo restores the global weights on False."""
        self.send()
        self.wait_for_round(timeout)
        self.syncs_attempted += 1
        commit = self._errored is None and (
            self._round is None or self.num_participants() >= self._min_replicas
        )
        if commit:
            self._step += 1
            self._batches_committed += self.num_participants()
        self._pending, self._round = [], None
        return commit

    def set_weight(self, weight: float) -> None:
        """This replica's weight in the next syncs (e.g. tokens since the last sync)."""
        self._weight = float(weight)

    # -- state ---------------------------------------------------------------------------------

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def num_participants(self) -> int:
        """Contributors of the last finished round (1 before any)."""
        return len(self._last.seal.contributors) if self._last else 1

    def participating_rank(self) -> int | None:
        if self._last is None:
            return 0
        names = self._last.seal.contributors
        me = self._collective.me.name
        return names.index(me) if me in names else None

    def is_participating(self) -> bool:
        return True  # a late replica is left out of a SEAL but still receives the result

    def report_error(self, e: Exception) -> None:
        self._errored = e

    def errored(self) -> Exception | None:
        return self._errored

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Kept for global checkpoints (DiLoCo registers each fragment's outer state)."""
        self._state_dict_fns[key] = (load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        """Called by DiLoCo after each inner step: nothing to do."""

    def disallow_state_dict_read(self) -> None:
        """Called by DiLoCo before each inner step: a batch still unsent is complete now."""
        self.send()

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = state_dict["step"]
        self._batches_committed = state_dict["batches_committed"]

    def shutdown(self, wait: bool = True) -> None:
        self._collective.close()

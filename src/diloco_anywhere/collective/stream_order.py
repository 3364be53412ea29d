"""CUDA stream order between the caller of an all-reduce and the threads of its round.

A round reads the caller's tensors and writes the mean into them on threads of its own
(``allreduce.py``, ``transfers.py``), while the caller queues GPU work on whatever stream is
current for it. torchft's DiLoCo runs its syncs under a side stream of its own
(``torchft/local_sgd.py``: ``prepare_sync`` and ``perform_sync`` run under
``get_stream_context(self._stream)``), and error feedback's accumulator is computed there
(``BucketManager.send``); a round thread's kernels go to its own current stream. Kernels on two
streams are not ordered (CUDA C++ Programming Guide, "Streams"), so without this a round could
encode an accumulator before its kernels ran, and a caller could read a mean before the copies
that write it landed.

Two rules close both gaps: the round's first read waits, on the GPU, for an event recorded on
the caller's stream when it called ``allreduce`` (no host wait); and a round that wrote into
CUDA tensors synchronizes its stream before its work completes, so the mean is in place for
any stream. On the CPU both are nothing.
"""

from __future__ import annotations

import torch


class StreamOrder:
    """Recorded on the caller's thread at ``allreduce``; used on the round's threads."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._queued: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._queued = torch.cuda.Event()
            self._queued.record(torch.cuda.current_stream(device))

    def before_reading(self) -> None:
        """This thread's stream (which the round's transfer threads share: each thread starts
        on the device's default stream) waits for the caller's queued work."""
        if self._queued is not None:
            torch.cuda.current_stream(self.device).wait_event(self._queued)

    def after_writing(self) -> None:
        """Block this thread until the writes it queued on the device are done."""
        if self._queued is not None:
            torch.cuda.current_stream(self.device).synchronize()

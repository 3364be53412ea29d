"""A process's batches from a prepared corpus: its units of the run's one order, read ahead.

A replica's inner steps fall in rounds (``RoundSpan``: the round, its first step, its steps),
which the replica's pace decides (``training/pacing/pace.py``; ``steps_of`` without one: every round
the same steps). A unit (``claims.py``, or a fixed one without a bucket) is ``batches_per_unit``
steps of the order's positions (``order.py``); a round of ``n`` steps trains ``n /
batches_per_unit`` of them, and its step ``k`` is positions ``(k mod batches_per_unit) x
batch_sequences`` onward of its unit ``k // batches_per_unit``. So where a replica's data
resumes is the round it resumes at, which the run's state already holds: no data position of
its own to save, and none to get wrong.

Batches are read by a background thread up to ``READ_AHEAD`` steps ahead of training, by
ranged reads (``reader.py``), within the round; a round's units are asked for in the caller's
thread (a replica of several processes shares its leader's claims through a collective, which
must not run elsewhere) when the caller asks for the round's first batch, so a run that ends
leaves no claim behind.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from diloco_anywhere.data.order import Order
from diloco_anywhere.data.reader import TokenReader

READ_AHEAD = 4
WINDOW_CHUNKS = 16  # chunks a batch's sequences are shuffled among (``order.py``)


@dataclass(frozen=True)
class StreamShape:
    """How a process's steps draw on the order."""

    seq_len: int
    batch_sequences: int  # sequences in one inner step of one process (micro-batches included)
    batches_per_unit: int

    @property
    def unit_sequences(self) -> int:
        return self.batch_sequences * self.batches_per_unit


@dataclass(frozen=True)
class RoundSpan:
    """The inner steps of a replica that one round holds."""

    round: int
    first_step: int
    steps: int


SpanOf = Callable[[int], RoundSpan]  # a replica's inner step -> its round
UnitsOf = Callable[[int, int], list[int]]  # (round, how many) -> this process's units


def steps_of(steps: int) -> SpanOf:
    """Rounds of ``steps`` inner steps each, from step 0: a replica not paced by time."""
    return lambda step: RoundSpan(step // steps, step // steps * steps, steps)


class Stream:
    """Batches of ``[batch_sequences, seq_len + 1]`` tokens (int64) from the training split,
    and the held-out split's evaluation batches."""

    def __init__(
        self,
        train: TokenReader,
        heldout: TokenReader,
        order: Order,
        shape: StreamShape,
        units_of: UnitsOf,
        span_of: SpanOf | None = None,
    ) -> None:
        """``span_of``: the rounds of the replica's steps (by default, one unit's steps each)."""
        self.train, self.heldout, self.order, self.shape = train, heldout, order, shape
        self.units_of, self.span_of = units_of, span_of or steps_of(shape.batches_per_unit)

    def batches(self, start: int) -> Iterator[torch.Tensor]:
        """The batches of inner steps ``start`` onward, without end. A round's units are asked
        for when its first batch is (never before the caller wants a batch of it: a run that
        ends claims nothing more), then its batches are read ahead. Closing the iterator (a
        heal reopens the data elsewhere) stops the reading."""
        per_unit = self.shape.batches_per_unit
        with ThreadPoolExecutor(1, thread_name_prefix="diloco-data") as reader:
            ahead: deque[Future[torch.Tensor]] = deque()
            step, span, units = start, RoundSpan(-1, start, 0), []  # the next step to read
            while True:
                if not ahead:  # every batch of the round is out: the next round's first
                    span = self.span_of(step)
                    units = self.units_of(span.round, -(-span.steps // per_unit))
                while len(ahead) < READ_AHEAD and step < span.first_step + span.steps:
                    unit, offset = divmod(step - span.first_step, per_unit)
                    ahead.append(reader.submit(self._batch, units[unit], offset))
                    step += 1
                yield ahead.popleft().result()

    def _batch(self, unit: int, offset: int) -> torch.Tensor:
        """Step ``offset`` of ``unit``."""
        shape = self.shape
        first = unit * shape.unit_sequences + offset * shape.batch_sequences
        sequences = self.order.sequences(first, first + shape.batch_sequences)
        return self._rows(self.train, sequences)

    def _rows(self, reader: TokenReader, sequences: np.ndarray) -> torch.Tensor:
        length = self.shape.seq_len
        rows = np.empty((len(sequences), length + 1), dtype=np.int64)
        for row, sequence in zip(rows, sequences.tolist(), strict=True):
            row[:] = reader.read(sequence * length, sequence * length + length + 1)
        return torch.from_numpy(rows)

    def evaluation(self, batches: int, size: int | None = None) -> list[torch.Tensor]:
        """``batches`` batches of ``size`` held-out sequences (a training batch's, unless
        given) spread evenly over the held-out split: the same on every replica, reading only
        them."""
        length, size = self.shape.seq_len, size or self.shape.batch_sequences
        available = max(0, self.heldout.tokens - 1) // length
        if available < 1:
            raise ValueError(
                f"the corpus's held-out split has {self.heldout.tokens} tokens, fewer than "
                f"seq_len + 1 = {length + 1}: hold out more of its documents (diloco data "
                f"prepare --heldout-fraction; the HF task's eval_fraction), give it more "
                f"documents, or use a smaller seq_len"
            )
        picks = np.linspace(0, available - 1, batches * size).round().astype(np.int64)
        return [self._rows(self.heldout, part) for part in np.split(picks, batches)]

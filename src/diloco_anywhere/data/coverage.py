"""How much of each epoch a run has trained, from its claims and SEALs (``claims.py``).

Every claim covers one unit of the order's stream (``unit_sequences`` positions from
``unit x unit_sequences``); an epoch is ``epoch_sequences`` consecutive positions. A position of
an epoch is trained once when one claim on it was trained, more than once when several were
(what the claims exist to prevent, counted so that a report would show it), in flight while
its claim's round is unsealed, and not trained otherwise (never claimed, or given back and not
claimed again yet). A claim given back trained its unit in vain: its tokens are lost work.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import RECORD_READ_LIMIT, decode_record
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.data.claims import GIVEN_BACK, TAKEN, TRAINED, Claims, DataPlan


@dataclass(frozen=True)
class EpochCoverage:
    epoch: int
    sequences: int
    trained_once: int
    trained_more: int
    in_flight: int
    not_trained: int
    lost_tokens: int  # of claims on this epoch's positions given back

    @property
    def trained_fraction(self) -> float:
        return (self.trained_once + self.trained_more) / self.sequences


@dataclass(frozen=True)
class Coverage:
    seq_len: int
    unit_sequences: int
    epochs: tuple[EpochCoverage, ...]

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line: the epoch in training and how far it is, what was lost."""
        current = self.epochs[-1]
        lost = sum(epoch.lost_tokens for epoch in self.epochs)
        twice = sum(epoch.trained_more for epoch in self.epochs)
        line = (
            f"data: epoch {current.epoch}, {current.trained_fraction:.1%} trained "
            f"({current.trained_once + current.trained_more:,} of {current.sequences:,} "
            f"sequences), {current.in_flight:,} in flight; {lost:,} tokens lost with "
            f"contributions left out of their rounds"
        )
        return line + (f"; {twice:,} sequences trained twice" if twice else "")


def read_coverage(store: Store, layout: RunLayout, min_replicas: int) -> Coverage | None:
    """The run's coverage, or None when it streams no prepared data (no plan recorded)."""
    try:
        data = store.get(layout.data_plan(), 0, RECORD_READ_LIMIT)
    except FileNotFoundError:
        return None
    plan = decode_record(data, DataPlan, key=layout.data_plan())
    claims = Claims(store, layout, "coverage-0", min_replicas).every_claim()
    counts: dict[str, Counter[int]] = {TRAINED: Counter(), TAKEN: Counter(), GIVEN_BACK: Counter()}
    for claim, outcome in claims:
        counts[outcome][claim.unit] += 1
    units = set().union(*counts.values())
    last = max(units, default=0)
    epochs = range((last + 1) * plan.unit_sequences // plan.epoch_sequences + 1)
    return Coverage(
        plan.seq_len,
        plan.unit_sequences,
        tuple(_epoch(plan, epoch, counts) for epoch in epochs),
    )


def _epoch(plan: DataPlan, epoch: int, counts: dict[str, Counter[int]]) -> EpochCoverage:
    first, end = epoch * plan.epoch_sequences, (epoch + 1) * plan.epoch_sequences
    size = plan.unit_sequences
    tally: Counter[str] = Counter()
    for unit in range(first // size, (end - 1) // size + 1):
        overlap = min(end, (unit + 1) * size) - max(first, unit * size)
        trained = counts[TRAINED][unit]
        if trained:
            tally["once" if trained == 1 else "more"] += overlap
        elif counts[TAKEN][unit]:
            tally["in flight"] += overlap
        tally["lost"] += overlap * counts[GIVEN_BACK][unit]
    placed = tally["once"] + tally["more"] + tally["in flight"]
    return EpochCoverage(
        epoch=epoch, sequences=plan.epoch_sequences, trained_once=tally["once"],
        trained_more=tally["more"], in_flight=tally["in flight"],
        not_trained=plan.epoch_sequences - placed, lost_tokens=tally["lost"] * plan.seq_len,
    )  # fmt: skip

"""How many inner steps a replica trains in each round (``[diloco] pace``; docs/tuning.md,
"Mixed hardware").

``pace = "steps"``: every replica trains ``round_steps`` (``sync_every / fragments``) a round,
DiLoCo's fixed H (arXiv 2311.08105, algorithm 1), so a round closes at its slowest replica's
pace and the faster ones wait. ``"time"``: each trains as many steps as fit in the round's
length, as Templar's peers train for a fixed window, and its contribution is weighted by the
tokens it trained (the outer step's weighted mean, as Decoupled DiLoCo, arXiv 2604.21428,
merges learners by tokens). The length is ``round_seconds``, else the time the fastest
contributor of the newest sealed round took for ``round_steps``: every replica reads the same
paces from the same sealed manifests (``collective.records.Pace``), so they agree on it with no
clock shared. A replica's own pace is a moving figure of its measured step times (the sync's
waiting left out): its first round's, then each round's blended in (``moving_step_seconds``),
which rides out a noisy round, while a round that differs by a factor of ``REGIME`` or more
(a spot instance replaced by a slower GPU, a noisy neighbour) replaces it at once, so a replica
that slows down mid-run is re-paced from its next sealed round. Its
steps are a multiple of ``step_quantum`` (a unit of the run's data, ``data/claims.py``) within
``round_steps_bounds``; one too slow to reach the fewest is said so (``behind``), not dropped.

Decisions lag a round: round r's SEAL plans round r + 2, so the steps of the round after the
current one are known before its first batch is read (a Trainer's data loader reads a batch
ahead). A replica is re-paced within two rounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from diloco_anywhere.collective.records import Pace
from diloco_anywhere.config import DilocoSection
from diloco_anywhere.data.stream import RoundSpan

LAG = 2  # round r's SEAL plans round r + LAG
SMOOTHING = 0.5  # the newest round's share of the moving step time
REGIME = 1.5  # a round's step time this far off the moving figure replaces it: new hardware


def moving_step_seconds(figure: float | None, newest: float | None) -> float | None:
    """The moving figure of a replica's step time after a round measured ``newest`` (None:
    it sent nothing): blended in, or taken whole when it is ``REGIME`` times off."""
    if figure is None or newest is None:
        return newest or figure
    if max(newest / figure, figure / newest) >= REGIME:
        return newest
    return figure + SMOOTHING * (newest - figure)


@dataclass(frozen=True)
class Plan:
    """One decision: round ``round``'s steps, from a round of ``length`` seconds at this
    replica's ``step_seconds`` (None: not measured yet). What the leader decides and its other
    ranks take as they are."""

    round: int
    steps: int
    length: float | None
    step_seconds: float | None


class Pacer:
    """This replica's steps per round: decided after each sealed round (``after_round``),
    read by the data (``span``) and by the training, which syncs after them."""

    def __init__(self, diloco: DilocoSection) -> None:
        self.timed = diloco.pace == "time"
        self.diloco = diloco
        self.reference, self.least = diloco.round_steps, diloco.round_steps_bounds[0]
        self.round_seconds = diloco.round_seconds or None
        self.length: float | None = self.round_seconds  # the newest round length
        self.step_seconds: float | None = None  # this replica's moving step time
        self._others: dict[str, float] = {}  # the other contributors' (replica id: seconds)
        self._planned: dict[int, int] = {}
        self._origin = self._cursor = RoundSpan(0, 0, self.steps(0))  # until ``start``

    def steps(self, round_: int) -> int:
        """The inner steps this replica trains in ``round_``."""
        if not self.timed:
            return self.reference
        return self._planned.setdefault(round_, self.fit(self.length, self.step_seconds))

    def start(self, round_: int, step: int) -> None:
        """This replica trains round ``round_`` from inner step ``step`` on (it joined or
        healed there); rounds it skipped keep no plan."""
        self._planned = {r: steps for r, steps in self._planned.items() if r >= round_}
        self._origin = self._cursor = RoundSpan(round_, step, self.steps(round_))

    def span(self, step: int) -> RoundSpan:
        """The round that inner ``step`` (from the last ``start`` on) falls in."""
        cursor = self._cursor if step >= self._cursor.first_step else self._origin
        while step >= cursor.first_step + cursor.steps:
            following = cursor.round + 1
            cursor = RoundSpan(following, cursor.first_step + cursor.steps, self.steps(following))
        self._cursor = cursor
        return cursor

    def decide(
        self, round_: int, own: Pace | None, sealed: Mapping[str, Pace], me: str = ""
    ) -> Plan | None:
        """After round ``round_``: this replica's plan for round ``round_ + LAG``, from its own
        pace in it (None: it sent nothing) and the paces it was sealed with, by contributor
        (``me``: this replica's name among them; None without pacing by time). Every
        contributor's pace is a moving figure, its own and the others' alike, so that a
        noisy round of the fastest does not shorten everyone's next one."""
        if not self.timed:
            return None
        newest = own.step_seconds if own is not None else None
        step_seconds = moving_step_seconds(self.step_seconds, newest)
        times = [step_seconds] if own is not None and step_seconds is not None else []
        for name, pace in sealed.items():
            replica = name.rsplit("-", 1)[0]  # its incarnations share a figure
            if name != me and (seconds := pace.step_seconds) is not None:
                self._others[replica] = moving_step_seconds(self._others.get(replica), seconds)
                times.append(self._others[replica])
        length = self.round_seconds or self._reference_length(times) or self.length
        return Plan(round_ + LAG, self.fit(length, step_seconds), length, step_seconds)

    def apply(self, plan: Plan | None) -> None:
        """Take a decision (this replica's, or its leader's): later ones never change it."""
        if plan is None:
            return
        self.length, self.step_seconds = plan.length, plan.step_seconds
        self._planned.setdefault(plan.round, plan.steps)

    def behind(self) -> str | None:
        """Why this replica holds its rounds up (None while it keeps up): even its fewest
        steps take longer than the round."""
        if self.length is None or self.step_seconds is None:
            return None
        needed = self.least * self.step_seconds
        if needed <= self.length:
            return None
        return (
            f"{self.step_seconds:.3g} s a step: its fewest steps a round (min_round_steps = "
            f"{self.least}) take {needed:.3g} s, the round {self.length:.3g} s; the others "
            f"wait for it"
        )

    def _reference_length(self, times: list[float]) -> float | None:
        """``round_steps`` at the fastest sealed contributor's step time (``times``: theirs,
        this replica's own as its moving figure, so the fastest trains ``round_steps``)."""
        return self.reference * min(times) if times else None

    def fit(self, length: float | None, step_seconds: float | None) -> int:
        """The steps that fit ``length`` at ``step_seconds`` (``DilocoSection.steps_to_fit``);
        ``round_steps`` while either is unknown."""
        if length is None or step_seconds is None:
            return self.reference
        return self.diloco.steps_to_fit(length, step_seconds)

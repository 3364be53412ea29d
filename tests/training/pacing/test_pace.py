"""A replica's steps per round (``training/pacing/pace.py``): fixed with ``pace = "steps"``; with
``"time"``, as many as fit in the round the fastest sealed contributor sets, in whole units of
data, planned two rounds ahead, within bounds, and said when even the fewest do not fit."""

from __future__ import annotations

import pytest

from diloco_anywhere.collective.records import Pace
from diloco_anywhere.config import DilocoSection
from diloco_anywhere.data.stream import RoundSpan
from diloco_anywhere.training.pacing.pace import LAG, Pacer, moving_step_seconds

TIMED = DilocoSection(sync_every=20, pace="time")  # 20 steps a round, units of 2


def paced(pacer: Pacer, round_: int, own: Pace, *others: Pace) -> int:
    """Decide after ``round_`` as the leader does, and take it; the steps planned."""
    sealed = {"me-0": own, **{f"other{k}-0": pace for k, pace in enumerate(others)}}
    plan = pacer.decide(round_, own, sealed, "me-0")
    pacer.apply(plan)
    return pacer.steps(round_ + LAG)


def test_with_pace_steps_every_round_is_sync_every_over_fragments():
    pacer = Pacer(DilocoSection(sync_every=20, fragments=2))
    assert pacer.decide(0, Pace(10, 9.0), {"other-0": Pace(10, 1.0)}) is None
    assert [pacer.steps(r) for r in range(3)] == [10, 10, 10]
    assert pacer.span(25) == RoundSpan(2, 20, 10)


def test_a_replica_four_times_slower_trains_a_quarter_of_the_steps():
    slow = Pacer(TIMED)
    assert slow.steps(0) == 20  # nothing measured yet: the reference pace
    # the round: 20 steps at 0.05 s = 1 s; 5 of this replica's fit, in units of 2 rounded
    # down: 4 (a sixth unit would keep the others waiting, a step short idles only itself)
    assert paced(slow, 0, Pace(20, 4.0), Pace(20, 1.0)) == 4
    fast = Pacer(TIMED)
    assert paced(fast, 0, Pace(20, 1.0), Pace(20, 4.0)) == 20  # the fastest sets the round


def test_steps_are_whole_units_within_the_bounds():
    assert paced(Pacer(TIMED), 0, Pace(20, 60.0), Pace(20, 1.0)) == 2  # the fewest: min
    bounded = DilocoSection(sync_every=20, pace="time", round_seconds=100.0, max_round_steps=40)
    assert paced(Pacer(bounded), 0, Pace(20, 1.0)) == 40  # 2000 steps fit: the most
    quarter = DilocoSection(sync_every=20, pace="time", min_round_steps=5)
    assert paced(Pacer(quarter), 0, Pace(20, 2.9), Pace(20, 1.0)) == 5  # 6.9 -> 5, not 6


def test_round_seconds_sets_the_length_whatever_the_others():
    pacer = Pacer(DilocoSection(sync_every=20, pace="time", round_seconds=3.0))
    assert paced(pacer, 0, Pace(20, 2.0), Pace(20, 0.1)) == 30


def test_a_decision_plans_two_rounds_ahead_and_never_changes_a_round_already_planned():
    """A Trainer's loader reads a batch ahead: round r + 1's steps are known before r ends."""
    pacer = Pacer(TIMED)
    assert pacer.steps(1) == 20  # read before anything was measured: it stays
    plan = pacer.decide(0, Pace(20, 4.0), {"other-0": Pace(20, 1.0)})
    assert plan is not None
    assert plan.round == 2
    pacer.apply(plan)
    assert (pacer.steps(1), pacer.steps(2), pacer.steps(3)) == (20, 4, 4)


def test_a_replica_that_slows_down_is_re_paced_within_two_rounds():
    pacer = Pacer(TIMED)
    for round_ in range(3):
        paced(pacer, round_, Pace(20, 1.0), Pace(20, 1.0))
    assert pacer.steps(4) == 20
    paced(pacer, 3, Pace(20, 4.0), Pace(20, 1.0))  # slowed 4x in round 3
    assert pacer.steps(5) == 4  # round 3 + LAG


def test_a_noisy_round_moves_the_pace_halfway_and_new_hardware_replaces_it():
    """The step time is a moving figure: one round 1.2x slower (a noisy neighbour) moves it
    halfway; a round 1.5x off or more is other hardware, taken whole."""
    assert moving_step_seconds(None, 0.2) == 0.2  # the first round's
    assert moving_step_seconds(0.2, None) == 0.2  # a round it sent nothing in
    assert moving_step_seconds(0.2, 0.24) == pytest.approx(0.22)
    assert moving_step_seconds(0.2, 0.8) == 0.8
    assert moving_step_seconds(0.8, 0.2) == 0.2  # faster again: at once too
    pacer = Pacer(TIMED)
    paced(pacer, 0, Pace(20, 1.0), Pace(20, 1.0))
    assert paced(pacer, 1, Pace(20, 1.2), Pace(20, 1.0)) == 20  # 0.055 s: within 10% of H
    assert pacer.step_seconds == pytest.approx(0.055)
    assert paced(pacer, 2, Pace(20, 1.4), Pace(20, 1.0)) == 16  # 0.0625 s: 16 fit
    twin = Pacer(TIMED)  # two of one GPU: the other's noisy round moves its figure halfway
    paced(twin, 0, Pace(20, 1.0), Pace(20, 1.0))
    assert paced(twin, 1, Pace(20, 1.0), Pace(20, 0.84)) == 20  # 0.042 s raw: 16.8 would fit
    fastest = Pacer(TIMED)  # the fastest sets the round by its moving figure: it trains H
    paced(fastest, 0, Pace(20, 1.0), Pace(20, 4.0))
    assert paced(fastest, 1, Pace(20, 1.2), Pace(20, 4.0)) == 20


def test_spans_follow_the_planned_steps_and_start_again_where_the_replica_heals():
    pacer = Pacer(TIMED)
    pacer.apply(pacer.decide(0, Pace(20, 4.0), {"other-0": Pace(20, 1.0)}))
    spans = [pacer.span(step) for step in (0, 19, 20, 39, 40, 45)]
    assert spans == [
        RoundSpan(0, 0, 20), RoundSpan(0, 0, 20), RoundSpan(1, 20, 4), RoundSpan(5, 36, 4),
        RoundSpan(6, 40, 4), RoundSpan(7, 44, 4),
    ]  # fmt: skip
    assert pacer.span(3) == RoundSpan(0, 0, 20)  # looked up again from the start
    pacer.start(7, 140)  # healed to round 7, numbered at the reference pace
    assert pacer.span(140) == RoundSpan(7, 140, 4)
    assert pacer.span(147) == RoundSpan(8, 144, 4)


def test_a_replica_too_slow_for_the_fewest_steps_is_said_to_hold_the_rounds_up():
    pacer = Pacer(TIMED)
    assert pacer.behind() is None
    paced(pacer, 0, Pace(20, 30.0), Pace(20, 1.0))  # 1.5 s a step; the round is 1 s
    said = pacer.behind()
    assert said is not None
    assert "min_round_steps = 2" in said
    assert "the others wait" in said


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"round_seconds": 3.0}, 'round_seconds applies only with pace = "time"'),
        ({"pace": "time", "min_round_steps": 3}, "must divide sync_every / fragments (20)"),
        ({"pace": "time", "max_round_steps": 25}, "max_round_steps (25) must be a multiple"),
        ({"pace": "time", "fragment_sync_delay": 2}, "must be less than min_round_steps (2)"),
    ],
)
def test_pace_settings_that_cannot_work_are_refused_saying_why(settings, said):
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        DilocoSection(sync_every=20, **settings)

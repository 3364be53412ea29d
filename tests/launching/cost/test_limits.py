"""The platform-limit plan (launching/cost/limits.py): attempts per platform, the step time used."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from diloco_anywhere.backends import get_backend
from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.cost.limits import plan_for, plan_limits, plan_platform
from diloco_anywhere.launching.cost.round_plan import (
    ASSUMED_STEP_SECONDS,
    StepTime,
    measured_step_seconds,
    round_plan_for,
    step_time,
)

HOUR = 3600.0
DAY = 24 * HOUR
KEEPER = "the keeper (`diloco keep`) starts the next attempt"


def test_a_three_day_run_needs_three_attempts_of_modals_24_hours():
    plan = plan_platform("modal", 3 * DAY, DAY)
    assert plan.attempts == 3
    assert plan.attempt_ends_hours == (24.0, 48.0, 72.0)
    assert plan.run_hours == 72.0
    assert plan.attempt_limit_hours == 24.0
    assert plan.needs_keeper
    assert KEEPER in plan.sentence
    assert "3 attempts, ending at 24.0, 48.0 and 72.0 h" in plan.sentence


def test_a_run_a_little_longer_than_two_limits_needs_a_third_attempt_ending_with_the_run():
    plan = plan_platform("sagemaker", 2 * DAY + 1.5 * HOUR, DAY)
    assert plan.attempts == 3
    assert plan.attempt_ends_hours == (24.0, 48.0, 49.5)


def test_no_limit_one_attempt_and_no_keeper_sentence():
    plan = plan_platform("k8s", 3 * DAY, None)
    assert plan.attempts == 1
    assert plan.attempt_limit_hours is None
    assert plan.attempt_ends_hours == (72.0,)
    assert not plan.needs_keeper
    assert plan.sentence == "k8s: no attempt limit; one attempt of 72.0 h."


def test_a_limit_after_the_run_ends_needs_one_attempt():
    plan = plan_platform("hf_jobs", 10 * HOUR, DAY)
    assert plan.attempts == 1
    assert plan.attempt_ends_hours == (10.0,)
    assert KEEPER not in plan.sentence
    assert "24.0 h limit is after the run's 10.0 h" in plan.sentence


def test_the_spot_wait_is_stated_where_configured():
    plan = plan_platform("sagemaker", 3 * DAY, DAY, spot_wait=2 * DAY)
    assert plan.spot_wait_hours == 48.0
    assert "spot: waiting plus running, at most 48.0 h" in plan.sentence


def test_plan_over_platforms_table_and_dict():
    plan = plan_limits(
        3 * 24 * 3600, StepTime(1.0, "[budget] step_seconds"), {"modal": DAY, "local": None}
    )
    assert plan.run_hours == 72.0
    assert plan.needs_keeper
    lines = plan.lines()
    assert lines[0] == "259,200 inner steps x 1 s ([budget] step_seconds) = 72.0 h"
    assert lines[1].startswith("platform  run     attempt limit  attempts  attempts end at (h)")
    assert lines[2].split() == ["modal", "72.0", "h", "24.0", "h", "3", "24.0,", "48.0,", "72.0"]
    assert lines[3].split() == ["local", "72.0", "h", "none", "1", "72.0"]
    assert KEEPER in lines[4]
    assert lines[5] == "local: no attempt limit; one attempt of 72.0 h."
    data = json.loads(json.dumps(plan.as_dict()))
    assert data["platforms"][0]["attempts"] == 3
    assert data["platforms"][0]["needs_keeper"] is True
    assert data["platforms"][1]["needs_keeper"] is False


def test_step_time_prefers_the_setting_then_the_measurement_then_an_assumption():
    assert step_time(2.0, 5.0) == StepTime(2.0, "[budget] step_seconds")
    assert step_time(None, 5.0) == StepTime(5.0, "measured from the run's metrics")
    assumed = step_time(None, None)
    assert assumed.seconds == ASSUMED_STEP_SECONDS
    assert "assumed" in assumed.source
    assert "[budget] step_seconds" in assumed.source


def _replica(*lines: tuple[int, float]) -> SimpleNamespace:
    return SimpleNamespace(steps=[SimpleNamespace(step=s, time=t) for s, t in lines])


def test_measured_step_seconds_leaves_out_restarts_and_takes_the_median_replica():
    metrics = {
        # 2 s a step; a restart (the step count falls back) and a long pause are left out
        "modal-0": _replica(
            (0, 100.0),
            (10, 120.0),
            (20, 140.0),
            (10, 5000.0),
            (20, 5020.0),
            (30, 9000.0),
            (40, 9020.0),
        ),
        "modal-1": _replica((0, 0.0), (10, 30.0), (20, 60.0)),  # 3 s a step
        "modal-2": _replica((0, 0.0), (10, 40.0)),  # 4 s a step
        "modal-3": _replica((5, 0.0)),  # one line: nothing to measure
    }
    assert measured_step_seconds(metrics) == pytest.approx(3.0)
    assert measured_step_seconds({"a": _replica((0, 0.0))}) is None
    assert measured_step_seconds({}) is None


def test_plan_for_a_config_uses_its_length_step_time_and_spot_wait():
    config = RunConfig.model_validate(
        {
            "diloco": {"outer_steps": 72, "sync_every": 100},
            "budget": {"step_seconds": 36.0},
            "backends": {"sagemaker": {"spot": True, "max_wait_hours": 30}},
        }
    )
    spot_waits = {"sagemaker": get_backend("sagemaker", config).spot_wait_limit()}
    assert spot_waits == {"sagemaker": 30 * HOUR}
    limits = {"modal": DAY, "sagemaker": DAY, "k8s": None}
    plan = plan_for(config, limits, round_plan_for(config, limits), spot_waits)
    assert plan.inner_steps == 7200
    assert plan.run_hours == 72.0
    assert [p.attempts for p in plan.platforms] == [3, 3, 1]
    assert plan.platforms[1].spot_wait_hours == 30.0


def test_plan_for_measures_the_step_time_when_run_toml_gives_none():
    config = RunConfig.model_validate({"diloco": {"outer_steps": 10, "sync_every": 360}})
    rounds = round_plan_for(config, ["modal"], metrics={"a": _replica((0, 0.0), (10, 20.0))})
    plan = plan_for(config, {"modal": DAY}, rounds)
    assert plan.step == StepTime(2.0, "measured from the run's metrics")
    assert plan.run_hours == 2.0
    assert get_backend("sagemaker", config).spot_wait_limit() is None


def test_a_run_paced_by_steps_lasts_as_long_as_its_slowest_platform_needs():
    """Modal 5x faster a step than SageMaker: with pace = "steps" every round takes
    SageMaker's time, so the run and Modal's attempts do too."""
    config = RunConfig.model_validate(
        {
            "diloco": {"outer_steps": 24, "sync_every": 100, "pace": "steps"},
            "budget": {"step_seconds": 7.2, "platform_step_seconds": {"sagemaker": 36.0}},
        }
    )
    limits = {"modal": DAY, "sagemaker": None}
    plan = plan_for(config, limits, round_plan_for(config, limits))
    assert plan.run_hours == pytest.approx(24.0)
    assert plan.step.seconds == 36.0
    assert "a round of 100 steps takes 3,600 s" in plan.step.source
    assert [p.attempts for p in plan.platforms] == [1, 1]
    timed = config.model_copy(update={"diloco": config.diloco.model_copy(update={"pace": "time"})})
    assert plan_for(timed, limits, round_plan_for(timed, limits)).run_hours == pytest.approx(4.8)

"""``diloco bench hetero`` at a tiny size: three real runs of a slow and a fast replica, and
the arithmetic the numbers come from (the numbers themselves are docs/benchmarks.md's)."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from diloco_anywhere.bench.hetero import loss_at, repaced
from diloco_anywhere.bench.tools.slowed_task import Slowness
from diloco_anywhere.cli.bench.training import hetero_table
from diloco_anywhere.training.records.metrics import ReplicaMetrics, SyncLine
from support.runs import diloco


@pytest.mark.integration
def test_the_hetero_bench_runs_each_pace_and_the_slow_replica_trains_fewer_steps_paced_by_time():
    result = diloco("bench", "hetero", "--speeds", "1,0.1", "--sync-every", "10",
                    "--outer-steps", "4", "--step-seconds", "0.05", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    runs = found["runs"]
    assert set(runs) == {"steps", "time", "equal"}
    assert runs["steps"]["round_steps"]["local-1"] == [10] * 4  # every replica H a round
    assert runs["time"]["round_steps"]["local-0"] == [10] * 4
    assert all(steps < 10 for steps in runs["time"]["round_steps"]["local-1"][2:])
    for run in runs.values():
        assert run["fleet_tokens_per_second"] > 0
        assert set(run["own_tokens_per_second"]) == {"local-0", "local-1"}
        assert len(run["curve"]) == 4  # a held-out loss at every outer step
    assert found["equal_tokens"] == min(runs["time"]["curve"][-1][0], runs["equal"]["curve"][-1][0])
    assert found["loss_ratio"] == pytest.approx(found["loss_time"] / found["loss_equal"])


def test_the_loss_at_equal_tokens_is_read_between_the_points_around_it():
    curve = [(100.0, 4.0), (300.0, 3.0), (600.0, 2.4)]
    assert loss_at(curve, 100.0) == 4.0
    assert loss_at(curve, 200.0) == pytest.approx(3.5)
    assert loss_at(curve, 450.0) == pytest.approx(2.7)
    assert loss_at(curve, 900.0) == 2.4  # past the last point: the last loss


def test_a_replica_that_slowed_down_is_found_with_the_rounds_it_took_to_be_re_paced():
    def sync(round_: int, seconds: float, steps: int) -> SyncLine:
        return SyncLine(
            outer_step=round_ + 1, round=round_, committed=True, participants=2,
            eval_loss=None, tokens=0, tokens_per_second=0.0, sync_exposed_seconds=0.0,
            bytes_up=0, bytes_down=0, time=float(round_), round_steps=steps,
            step_seconds=seconds,
        )  # fmt: skip

    lines = [sync(0, 0.1, 20), sync(1, 0.1, 20), sync(2, 0.1, 20), sync(3, 0.4, 20),
             sync(4, 0.4, 20), sync(5, 0.4, 6), sync(6, 0.4, 6)]  # fmt: skip
    assert repaced(ReplicaMetrics("local-0", syncs=lines)) == {"slowed_round": 3, "rounds": 2}
    assert repaced(ReplicaMetrics("local-0", syncs=lines[:3])) is None
    never = [*lines[:5], sync(5, 0.4, 20)]
    assert repaced(ReplicaMetrics("local-0", syncs=never)) == {"slowed_round": 3, "rounds": None}
    # a noisy round (1.4x: blended into the moving pace, not a slowdown) is not one; a round
    # slowed part-way (2.5x) is, and the pace, replaced by it, plans fewer steps 2 rounds on
    noisy = [sync(0, 0.1, 20), sync(1, 0.14, 20), sync(2, 0.1, 18), sync(3, 0.25, 20),
             sync(4, 0.4, 20), sync(5, 0.4, 8), sync(6, 0.4, 6)]  # fmt: skip
    assert repaced(ReplicaMetrics("local-0", syncs=noisy)) == {"slowed_round": 3, "rounds": 2}
    assert repaced(ReplicaMetrics("local-0", syncs=noisy[:3])) is None
    # a unit fewer in the slowed round (its plan, from before, measured a little slow) is noise,
    # not the re-pacing: that is the plan two rounds on
    unit = [sync(0, 0.1, 10), sync(1, 0.1, 10), sync(2, 0.1, 10), sync(3, 0.4, 9),
            sync(4, 0.4, 9), sync(5, 0.4, 3), sync(6, 0.4, 3)]  # fmt: skip
    assert repaced(ReplicaMetrics("local-0", syncs=unit)) == {"slowed_round": 3, "rounds": 2}
    # slowed part-way through round 3 (1.6x), which its pace took whole: slowed there, and
    # re-paced 2 rounds on (not 1 from round 4, the first round slow all through)
    part_way = [sync(0, 0.1, 20), sync(1, 0.1, 20), sync(2, 0.1, 20), sync(3, 0.16, 20),
                sync(4, 0.4, 20), sync(5, 0.4, 12), sync(6, 0.4, 6)]  # fmt: skip
    assert repaced(ReplicaMetrics("local-0", syncs=part_way)) == {"slowed_round": 3, "rounds": 2}
    # slowed part-way through round 3 by less than its pace's REGIME (its moving figure, still
    # high from a slow first round: 0.11 s), which blended it in (round 5's 16 steps): slowed
    # in round 4, re-paced in round 6
    blended = [sync(0, 0.14, 20), sync(1, 0.1, 20), sync(2, 0.1, 20), sync(3, 0.16, 20),
               sync(4, 0.4, 20), sync(5, 0.4, 16), sync(6, 0.4, 6)]  # fmt: skip
    assert repaced(ReplicaMetrics("local-0", syncs=blended)) == {"slowed_round": 4, "rounds": 2}


def test_a_replica_slows_down_after_its_own_steps_not_after_seconds():
    options = {"speeds": [1.0, 0.5], "step_seconds": 0.05, "slowdown": [0, 3, 4]}
    slowed, other = Slowness.of(options, 0), Slowness.of(options, 1)
    assert [slowed.step() for _ in range(5)] == pytest.approx([0.05, 0.05, 0.05, 0.2, 0.2])
    assert [other.step() for _ in range(5)] == pytest.approx([0.1] * 5)  # only replica 0
    for wrong in ([0, 2.5, 4], [0, -1, 4], [0, 3, 0.5], [0, 3]):
        with pytest.raises(ValueError, match="after_steps"):
            Slowness.of({**options, "slowdown": wrong}, 0)


@pytest.mark.parametrize("slowdown", ["0,2.5,4", "0,100", "2,100,4", "0,100,0.5"])
def test_the_hetero_bench_refuses_a_slowdown_that_is_not_a_replica_steps_and_a_factor(slowdown):
    result = diloco("bench", "hetero", "--speeds", "1,1", "--slowdown", slowdown)
    assert result.exit_code == 2
    assert "INDEX,STEPS,FACTOR" in " ".join(result.output.split())


def test_the_hetero_table_fits_80_columns_and_says_when_a_slowed_replica_was_not_re_paced():
    run = {"fleet_tokens_per_second": 4501.0, "own_tokens_per_second": {"local-0": 9637.0},
           "fleet_over_own": 0.47, "fast_waiting": 0.67,
           "round_steps": {"local-0": [20, 20, 20], "local-1": [20, 20], "local-2": [20, 6, 8],
                           "local-3": [20, 6, 10]}}  # fmt: skip
    slowed = {**run, "repaced": {"slowed_round": 9, "rounds": None}}
    result = {"speeds": [1, 1, 0.25, 0.25], "sync_every": 20, "outer_steps": 10,
              "equal_tokens": 143360, "loss_ratio": 0.975,
              "runs": {"time": run, "slowdown": slowed}}  # fmt: skip
    console = Console(width=80, record=True)
    console.print(hetero_table(result))
    shown = console.export_text()
    assert "…" not in shown
    assert "20 20 6-8 6-10" in shown  # each replica's steps a round after its first
    assert "not re-paced before the run ended (give more --outer-steps)" in " ".join(shown.split())

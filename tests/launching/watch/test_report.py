"""The run's loss plot (launching/watch/report.py): panels of the script's own logged values; the
fleet's throughput against its replicas' own (launching/watch/fleet.py)."""

from __future__ import annotations

import pytest

from diloco_anywhere.launching.watch.fleet import fleet_throughput
from diloco_anywhere.launching.watch.report import constant_limits, plot_losses
from diloco_anywhere.training.records.metrics import ReplicaMetrics, StepLine, SyncLine


@pytest.mark.parametrize(
    ("values", "limits"),
    [([1e-3, 1e-3, 1e-3], (0.0, 2e-3)), ([-2.0], (-4.0, 0.0)), ([0.0, 0.0], (-1.0, 1.0))],
)
def test_a_constant_series_gets_an_axis_as_wide_as_its_value(values, limits):
    assert constant_limits(values) == pytest.approx(limits)


@pytest.mark.parametrize("values", [[], [1e-3, 1.1e-3], [0.0, 1e-9]])
def test_a_changing_series_keeps_its_own_axis(values):
    assert constant_limits(values) is None


def test_the_plot_draws_a_constant_learning_rate_on_an_axis_as_wide_as_it(tmp_path, monkeypatch):
    from matplotlib import pyplot

    figures = []
    monkeypatch.setattr(pyplot, "close", figures.append)  # keep the figure to read its axes
    steps = [StepLine(step=i, loss=3.0 - 0.1 * i, tokens=64 * i, time=float(i),
                      values={"lr": 1e-3, "grad_norm": 1.0 / (i + 1)})
             for i in range(5)]  # fmt: skip
    path = plot_losses({"local-0": ReplicaMetrics("local-0", steps=steps)}, tmp_path / "p.png", "t")
    assert path.read_bytes().startswith(b"\x89PNG")
    panels = {axes.get_ylabel(): axes for axes in figures[0].axes}
    assert panels["lr"].get_ylim() == pytest.approx((0.0, 2e-3))
    low, high = panels["grad_norm"].get_ylim()  # its own, fitted axis: 0.2 to 1.0 and a margin
    assert low > 0.1
    assert low < 0.2
    assert high > 1.0
    assert high < 1.1


def _paced(round_: int, at: float, steps: int, step_seconds: float, tokens: int) -> SyncLine:
    """A sync of a replica that trains 10 tokens a step."""
    return SyncLine(
        outer_step=round_ + 1, round=round_, committed=True, participants=2, eval_loss=None,
        tokens=tokens, inner_steps=tokens // 10, tokens_per_second=0.0,
        sync_exposed_seconds=0.0, bytes_up=0, bytes_down=0, time=at, round_steps=steps,
        step_seconds=step_seconds,
    )  # fmt: skip


def test_the_fleet_throughput_is_committed_tokens_a_second_against_its_replicas_own():
    """A fast replica (0.1 s a step) and a slow one (0.4 s): rounds of 4 s. Paced by time,
    the slow one trains 10 steps a round and the fleet runs at its replicas' own pace."""
    fast = [_paced(r, 4.0 * (r + 1), 40, 0.1, 400 * (r + 1)) for r in range(4)]
    slow = [_paced(r, 4.0 * (r + 1), 10, 0.4, 100 * (r + 1)) for r in range(4)]
    found = fleet_throughput({"local-0": ReplicaMetrics("local-0", syncs=fast),
                              "local-1": ReplicaMetrics("local-1", syncs=slow)})  # fmt: skip
    assert found is not None
    assert found.own_tokens_per_second == {"local-0": 100.0, "local-1": 25.0}
    # rounds 1-3 after round 0 ended (at 4 s): 3 x 500 tokens in 12 s
    assert found.fleet_tokens_per_second == 125.0
    assert found.fleet_over_own == 1.0
    assert fleet_throughput({}) is None

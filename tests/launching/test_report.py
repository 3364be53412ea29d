"""The run's loss plot (launching/report.py): panels of the script's own logged values."""

from __future__ import annotations

import pytest

from diloco_anywhere.launching.report import constant_limits, plot_losses
from diloco_anywhere.training.metrics import ReplicaMetrics, StepLine


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

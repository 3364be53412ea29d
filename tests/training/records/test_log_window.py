"""``Training.log`` at any cadence: each ``log_every`` window's mean is recorded whenever the
script calls ``log``, and what the training counts (inner steps, tokens) does not depend on it."""

from __future__ import annotations

import pytest
import torch

from diloco_anywhere.launching.watch.report import summarize
from diloco_anywhere.training.records.log_window import LogWindow
from diloco_anywhere.training.records.metrics import ReplicaMetrics, StepLine, SyncLine


def _written(every: int, calls: range) -> list[tuple[int, float, dict[str, float]]]:
    """(step, mean loss, mean values) of each window written when ``log`` is called at each
    step of ``calls`` with the step as its loss and twice it as ``lr``."""
    window, lines = LogWindow(every), []
    for step in calls:
        window.add(torch.tensor(float(step)), {"lr": 2.0 * step})
        if window.due(step):
            lines.append((step, *window.close(step)))
    return lines


def test_logging_every_step_writes_each_windows_mean_at_its_end():
    assert _written(4, range(1, 9)) == [(4, 2.5, {"lr": 5.0}), (8, 6.5, {"lr": 13.0})]


def test_logging_every_five_steps_under_log_every_ten_records_every_ten():
    assert _written(10, range(5, 31, 5)) == [
        (10, 7.5, {"lr": 15.0}), (20, 17.5, {"lr": 35.0}), (30, 27.5, {"lr": 55.0}),
    ]  # fmt: skip


def test_logging_every_seven_steps_writes_at_the_first_call_past_each_multiple():
    assert [step for step, *_ in _written(10, range(7, 50, 7))] == [14, 21, 35, 42]


def test_logging_less_often_than_log_every_writes_every_call():
    assert [step for step, *_ in _written(2, range(5, 20, 5))] == [5, 10, 15]


def _sync(inner_steps: int, tokens: int) -> SyncLine:
    return SyncLine(
        outer_step=1, committed=True, participants=1, eval_loss=None, tokens=tokens,
        inner_steps=inner_steps, tokens_per_second=1.0, sync_exposed_seconds=0.0, bytes_up=0,
        bytes_down=0, time=0.0,
    )  # fmt: skip


def test_a_run_whose_script_never_logs_still_counts_its_steps_and_tokens():
    """The summary once said 0 tokens and a loss of 0.0000 for such a run."""
    silent = ReplicaMetrics("local-0", syncs=[_sync(inner_steps=50, tokens=6400)])
    summary = summarize({"local-0": silent})
    assert (summary.inner_steps_per_replica, summary.tokens) == (50, 6400)
    assert summary.final_loss is None
    assert summary.data_parallel_bytes_per_replica == 0  # one replica: no all-reduce to compare


@pytest.mark.parametrize(("logged_at", "expected"), [(40, (50, 6400)), (60, (60, 7680))])
def test_the_newest_of_the_step_and_sync_lines_counts(logged_at, expected):
    step = StepLine(step=logged_at, loss=1.0, tokens=128 * logged_at, time=0.0)
    metrics = ReplicaMetrics("local-0", steps=[step], syncs=[_sync(inner_steps=50, tokens=6400)])
    assert metrics.trained() == expected


def test_a_value_logged_unchanged_is_recorded_as_itself():
    window = LogWindow(10)
    for _ in range(10):
        window.add(torch.tensor(0.1, dtype=torch.float64), {"lr": 0.01})
    assert window.close(10) == (0.1, {"lr": 0.01})

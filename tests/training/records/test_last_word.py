"""A replica's last word in the run's metrics (``MetricsWriter.last_word``): what a process
about to end at once records, after what it had buffered; where the store refuses it, a
warning, never an error in the way of leaving."""

from __future__ import annotations

import logging

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.training.records.metrics import MetricsReader, MetricsWriter, StepLine

RUN = RunLayout("run")


def test_the_last_word_follows_what_was_buffered(tmp_path):
    store = Store(str(tmp_path))
    metrics = MetricsWriter(store, RUN, "local-0", 0, "local")
    metrics.add(StepLine(step=4, loss=2.5, tokens=64, time=1.0))
    metrics.last_word("superseded", "incarnation local-0-1 claimed replica local-0 since")
    replica = MetricsReader(store, RUN).read()["local-0"]
    assert [step.step for step in replica.steps] == [4]
    assert [(e.event, e.detail) for e in replica.events] == [
        ("superseded", "incarnation local-0-1 claimed replica local-0 since")
    ]


def test_a_last_word_the_store_refuses_is_a_warning(tmp_path, caplog):
    (tmp_path / "run").write_text("a file where the run's folder would be")
    metrics = MetricsWriter(Store(str(tmp_path)), RUN, "local-0", 0, "local")
    caplog.set_level(logging.WARNING)
    metrics.last_word("superseded", "a newer incarnation runs")
    assert "could not record superseded: " in caplog.text

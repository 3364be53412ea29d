"""A loop's own mistakes with the replica it joined, each stopped with what to do: data that
ends before the run does, and a replica started twice."""

from __future__ import annotations

import pytest
import torch

from diloco_anywhere import join
from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.start.launch import run_metrics


def _run(tmp_path) -> RunConfig:
    return RunConfig.model_validate({
        "run": {"name": "loop", "store": str(tmp_path / "store"), "replicas": 1},
        "diloco": {"sync_every": 4, "outer_steps": 2},
    })  # fmt: skip


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train_six_batches(config: RunConfig) -> None:
    """A loop whose data holds six batches; the run trains 2 rounds of 4."""
    model, optimizer = _model_and_optimizer()
    six_batches = [torch.ones(2, 4)] * 6
    with (
        join(config, replica_id="local-0") as replica,
        replica.diloco(model, optimizer) as training,
    ):
        for batch in training.batches(lambda start: iter(six_batches[start:])):
            optimizer.zero_grad()
            model(batch).sum().backward()
            optimizer.step()


def test_data_that_ends_before_the_run_stops_the_replica_saying_to_loop_over_epochs(tmp_path):
    config = _run(tmp_path)
    fix = r"open_at\(start\) must go on until the run ends \(loop over epochs\)"
    with pytest.raises(
        ValueError, match=rf"the data ran out at inner step 6 of the run's 8: {fix}"
    ):
        _train_six_batches(config)
    [event] = [e for e in run_metrics(config).read()["local-0"].events if e.event == "failed"]
    assert "the data ran out at inner step 6" in event.detail


def test_a_replica_started_twice_is_refused_at_the_second_start(tmp_path):
    config, (model, optimizer) = _run(tmp_path), _model_and_optimizer()
    with join(config, replica_id="local-0") as replica:
        replica.start(model, optimizer)
        with pytest.raises(RuntimeError, match=r"replica.start\(...\) was called already"):
            replica.start(model, optimizer)
        replica.finish()

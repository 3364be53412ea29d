"""A script that joined the run and steps an optimizer outside ``replica.diloco`` is stopped
within two rounds' steps, with the fix for a loop (training/mistakes/outside_diloco.py; the
Trainer's case is in test_hf_trainer.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco_anywhere import join
from diloco_anywhere.config import RunConfig
from diloco_anywhere.contract import EXIT_NOT_SYNCING
from diloco_anywhere.launching.start.launch import run_metrics


def _run(tmp_path) -> RunConfig:
    return RunConfig.model_validate({
        "run": {"name": "outside", "store": str(tmp_path / "store"), "replicas": 1},
        "diloco": {"sync_every": 4, "outer_steps": 2},
    })  # fmt: skip


def _steps(optimizer: torch.optim.Optimizer, count: int) -> None:
    for _ in range(count):
        optimizer.zero_grad()
        optimizer.param_groups[0]["params"][0].sum().backward()
        optimizer.step()


def test_a_loop_that_joined_but_trains_outside_diloco_is_stopped_with_the_fix(tmp_path):
    config, model = _run(tmp_path), torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SystemExit) as ended, join(config, replica_id="local-0"):
        _steps(optimizer, 100)
    assert ended.value.code == EXIT_NOT_SYNCING
    [event] = [e for e in run_metrics(config).read()["local-0"].events if e.event == "failed"]
    assert "took 9 optimizer steps, but none under DiLoCo" in event.detail  # 2 rounds of 4
    assert "Train inside `with replica.diloco(model, optimizer) as training:`" in event.detail


def test_no_step_is_counted_once_the_replica_has_ended(tmp_path):
    """The hook is PyTorch's, for every optimizer of the process: it goes with the replica."""
    config, model = _run(tmp_path), torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with join(config, replica_id="local-0"):
        _steps(optimizer, 8)  # two rounds' worth: allowed (a warm-up, say)
    _steps(optimizer, 100)  # after the replica: the script's own business


def test_another_threads_steps_are_not_the_joined_scripts(tmp_path):
    """Replicas in threads of one process (tests, notebooks): one's training is not the
    other's stepping outside DiLoCo."""
    config, model = _run(tmp_path), torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    raised = []

    def train_elsewhere() -> None:
        try:
            _steps(optimizer, 100)
        except BaseException as error:  # what the hook would raise in this thread
            raised.append(error)

    with join(config, replica_id="local-0"):
        elsewhere = threading.Thread(target=train_elsewhere)
        elsewhere.start()
        elsewhere.join()
    assert raised == []

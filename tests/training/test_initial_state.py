"""Replicas must start from the same model: one whose initial weights or structure differ from
the run's stops at once, naming the first tensor that differs and the fix, where it once waited
on rounds nobody else's fingerprint matched until they timed out (about 50 minutes)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from diloco_anywhere.bucket.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.contract import EXIT_MODEL_UNLIKE_RUN
from diloco_anywhere.training.initial_state import check_initial_state
from diloco_anywhere.training.mistakes import ModelUnlikeRunError
from support.runs import diloco, statuses

LAYOUT = RunLayout("r")
FIX = "seed the model the same on every replica (not per rank or per replica)"


def _model(seed: int, hidden: int = 8, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 1))[:layers]


def test_the_first_model_is_the_runs_and_the_same_model_is_accepted(tmp_path):
    store = Store(str(tmp_path))
    check_initial_state(store, LAYOUT, _model(0))
    check_initial_state(store, LAYOUT, _model(0))


@pytest.mark.parametrize(
    ("other", "problem"),
    [(_model(1), "0.weight [8, 4] holds other initial values than the run's"),
     (_model(0, hidden=16), "0.weight is float32 [16, 4] here, float32 [8, 4] in the run"),
     (_model(0, layers=1), "2 parameters here, 4 in the run's model"),
     (_model(0).double(), "0.weight is float64 [8, 4] here, float32 [8, 4] in the run")],
)  # fmt: skip
def test_a_model_unlike_the_runs_is_refused_naming_the_first_difference(tmp_path, other, problem):
    store = Store(str(tmp_path))
    check_initial_state(store, LAYOUT, _model(0))
    with pytest.raises(ModelUnlikeRunError) as info:
        check_initial_state(store, LAYOUT, other)
    assert f"({LAYOUT.initial_state()}): {problem}" in str(info.value)
    assert FIX in str(info.value)
    assert info.value.exit_code == EXIT_MODEL_UNLIKE_RUN


def test_a_compiled_model_is_the_same_model(tmp_path):
    """torch.compile's wrapper names every parameter ``_orig_mod.<name>``."""
    store = Store(str(tmp_path))
    check_initial_state(store, LAYOUT, _model(0))
    check_initial_state(store, LAYOUT, torch.compile(_model(0)))


SEEDED_PER_REPLICA = """
import os
import torch
import diloco_anywhere

torch.manual_seed(int(os.environ["DILOCO_REPLICA_INDEX"]))  # the mistake: a seed per replica
model = torch.nn.Linear(4, 1)
inner = torch.optim.SGD(model.parameters(), lr=0.1)


def data(start):
    while True:
        yield torch.randn(8, 4)


with diloco_anywhere.join() as replica:
    with replica.diloco(model, inner) as training:
        for x in training.batches(data):
            model(x).pow(2).mean().backward()
            inner.step()
            inner.zero_grad()
"""


@pytest.mark.integration
def test_replicas_seeded_apart_stop_at_once_naming_the_fix(tmp_path, monkeypatch):
    """Both must join before a round seals (min_replicas = 2), so neither can heal from a
    checkpoint: whichever records the run's model first waits, the other stops with exit 5, its
    status and its log saying why, within seconds."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(SEEDED_PER_REPLICA)
    (tmp_path / "run.toml").write_text(
        '[run]\nname = "seeded"\nstore = "store"\nreplicas = 2\nmin_replicas = 2\n'
        "[diloco]\nsync_every = 5\nouter_steps = 2\n"
        f"[task]\ncommand = {json.dumps(['python', 'train.py'])}\n"
    )
    assert diloco("launch", "--config", "run.toml", "--detach").exit_code == 0
    deadline = time.monotonic() + 120
    try:
        while "failed" not in {row["state"] for row in statuses("run.toml").values()}:
            assert time.monotonic() < deadline, statuses("run.toml")
            time.sleep(0.5)
        [refused] = [r for r, row in statuses("run.toml").items() if row["state"] == "failed"]
        logs = diloco("logs", refused, "--config", "run.toml").stdout
    finally:
        diloco("stop", "--config", "run.toml")
    assert "weight [1, 4] holds other initial values than the run's" in logs
    assert FIX in logs

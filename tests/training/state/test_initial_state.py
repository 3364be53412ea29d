"""Replicas must start from the same model: one whose initial weights or structure differ from
the run's stops at once, naming the first tensor that differs and the fix, where it once waited
on rounds nobody else's fingerprint matched until they timed out (about 50 minutes)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.contract import EXIT_MODEL_UNLIKE_RUN
from diloco_anywhere.training.mistakes import ModelUnlikeRunError
from diloco_anywhere.training.state.initial_state import check_initial_state
from support.runs import diloco, statuses
from support.scripts import SEEDED_PER_REPLICA, loop_script
from support.votes import voter

LAYOUT = RunLayout("r")
FIX = "seed the model the same on every replica (not per rank or per replica)"


def _model(seed: int, hidden: int = 8, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 1))[:layers]


def test_the_first_model_is_the_runs_and_the_same_model_is_accepted(tmp_path):
    store = Store(str(tmp_path))
    check_initial_state(store, LAYOUT, _model(0), voter(0))
    check_initial_state(store, LAYOUT, _model(0), voter(1))


@pytest.mark.parametrize(
    ("other", "problem", "cause"),
    [(_model(1), "0.weight [8, 4] holds other initial values than the run's",
      f"Every replica must start from the same weights: {FIX}"),
     (_model(0, hidden=16), "0.weight is float32 [16, 4] here, float32 [8, 4] in the run",
      "Another model size or config (hidden size, layers, heads), or another tokenizer"),
     (_model(0, layers=1), "2 parameters here, 4 in the run's model", "Another architecture"),
     (_model(0).double(), "0.weight is float64 [8, 4] here, float32 [8, 4] in the run",
      "The model was loaded or cast in another dtype")],
)  # fmt: skip
def test_a_model_unlike_the_runs_is_refused_naming_the_difference_and_its_likely_cause(
    tmp_path, other, problem, cause
):
    store = Store(str(tmp_path))
    check_initial_state(store, LAYOUT, _model(0), voter(0))
    with pytest.raises(ModelUnlikeRunError) as info:
        check_initial_state(store, LAYOUT, other, voter(1))
    assert f"({LAYOUT.initial_state()}, held by local-0): {problem}. {cause}" in str(info.value)
    assert info.value.exit_code == EXIT_MODEL_UNLIKE_RUN


def test_a_compiled_model_is_the_same_model(tmp_path):
    """torch.compile's wrapper names every parameter ``_orig_mod.<name>``."""
    store = Store(str(tmp_path))
    check_initial_state(store, LAYOUT, _model(0), voter(0))
    check_initial_state(store, LAYOUT, torch.compile(_model(0)), voter(1))


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


WIDER_AND_FIRST = loop_script(
    'index = int(os.environ["DILOCO_REPLICA_INDEX"])\n'
    "if index != 2:\n"
    "    time.sleep(3)  # the mistaken replica starts first\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Linear(4, 2 if index == 2 else 1)  # the mistake: a wider model on one\n"
    "inner = torch.optim.SGD(model.parameters(), lr=0.1)\n"
)


@pytest.mark.integration
def test_the_replica_unlike_the_others_is_stopped_though_it_started_first(tmp_path, monkeypatch):
    """The issue's case: of three replicas, the one with a wider model starts first. The
    others outvote it: it stops (exit 5) naming the replicas that hold the run's model and the
    likely cause, and the two alike train the run to its end."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(WIDER_AND_FIRST)
    (tmp_path / "run.toml").write_text(
        '[run]\nname = "wider"\nstore = "store"\nreplicas = 3\nmin_replicas = 2\n'
        "[diloco]\nsync_every = 5\nouter_steps = 2\n"
        f"[task]\ncommand = {json.dumps(['python', 'train.py'])}\n"
    )
    assert diloco("launch", "--config", "run.toml", "--detach").exit_code == 0
    deadline = time.monotonic() + 240
    try:
        while {row["state"] for row in statuses("run.toml").values()} - {"done", "failed"}:
            assert time.monotonic() < deadline, statuses("run.toml")
            time.sleep(0.5)
        logs = diloco("logs", "local-2", "--config", "run.toml").stdout
    finally:
        diloco("stop", "--config", "run.toml")
    states = {replica: row["state"] for replica, row in statuses("run.toml").items()}
    assert states == {"local-0": "done", "local-1": "done", "local-2": "failed"}
    assert "held by local-0, local-1): weight is float32 [2, 4] here, float32 [1, 4]" in logs
    assert "Another model size or config" in logs


@pytest.mark.integration
def test_a_replica_whose_run_cannot_go_on_stops_at_once_naming_who_stopped(tmp_path, monkeypatch):
    """Three replicas seeded apart, min_replicas = 2: the votes keep local-0's model (a tie
    goes to the lowest index) and stop the two others for good. local-0 alone cannot seal a
    round: its first round fails within a lease period or two, naming both and why, where it
    once waited out five sync timeouts (50 minutes at the defaults)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(SEEDED_PER_REPLICA)
    (tmp_path / "run.toml").write_text(
        '[run]\nname = "alone"\nstore = "store"\nreplicas = 3\nmin_replicas = 2\n'
        "[diloco]\nsync_every = 5\nouter_steps = 2\n"
        f"[task]\ncommand = {json.dumps(['python', 'train.py'])}\n"
    )
    started = time.monotonic()
    assert diloco("launch", "--config", "run.toml", "--detach").exit_code == 0
    try:
        while {row["state"] for row in statuses("run.toml").values()} - {"done", "failed"}:
            assert time.monotonic() - started < 240, statuses("run.toml")
            time.sleep(0.5)
        logs = diloco("logs", "local-0", "--config", "run.toml").stdout
    finally:
        diloco("stop", "--config", "run.toml")
    assert {row["state"] for row in statuses("run.toml").values()} == {"failed"}
    said = " ".join(logs.split())
    assert (
        "error: replica local-0: round 0 fragment 0 cannot seal: min_replicas = 2, and 2 of "
        "the run's 3 replicas stopped for good (local-1: failed: ModelUnlikeRunError" in said
    )

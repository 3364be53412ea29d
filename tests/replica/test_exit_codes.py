"""The entrypoint's exit codes for a training that ended in error: what the launcher and the
keeper read to restart a replica or leave it be (``replica.py``'s docstring)."""

from __future__ import annotations

import pytest

from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.collective.members.membership import SupersededError
from diloco_anywhere.config import ConfigError
from diloco_anywhere.contract import (
    EXIT_BAD_CONFIG,
    EXIT_MODEL_UNLIKE_RUN,
    EXIT_RUN_CANNOT_GO_ON,
    EXIT_SUPERSEDED,
    NOT_RETRIED,
)
from diloco_anywhere.replica import failure_exit_code
from diloco_anywhere.training.mistakes import ModelUnlikeRunError, RunCannotGoOnError


@pytest.mark.parametrize(
    ("error", "code", "said"),
    [
        (SupersededError("incarnation 2 runs"), EXIT_SUPERSEDED, "replica r-1: incarnation 2 runs"),
        (ModelUnlikeRunError("3 tensors"), EXIT_MODEL_UNLIKE_RUN, "error: replica r-1: 3 tensors"),
        (RunCannotGoOnError("1 of 2 left"), EXIT_RUN_CANNOT_GO_ON, "error: replica r-1: 1 of 2"),
        (ConfigError("run.toml: bad"), EXIT_BAD_CONFIG, "error: replica r-1: run.toml: bad"),
        (StoreError("503 from s3"), 1, "error: replica r-1 failed: 503 from s3"),
        (RuntimeError("NaN loss"), 1, "error: replica r-1 failed: NaN loss"),
    ],
    ids=["superseded", "mistake", "cannot-go-on", "config", "store", "failure"],
)
def test_each_way_training_ends_has_its_exit_code_and_says_why(capsys, error, code, said):
    assert failure_exit_code("r-1", error) == code
    assert said in capsys.readouterr().err
    # what a restart may fix (1) is retried by platforms; the rest never are
    assert (code in NOT_RETRIED) == (code != 1)

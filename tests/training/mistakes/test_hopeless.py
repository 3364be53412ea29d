"""A replica that waits before its first round (for the data plan, for its first SEAL) stops
as a round would once no round can seal again: ``stop_if_hopeless``'s check."""

from __future__ import annotations

import pytest

from diloco_anywhere.training.mistakes import (
    RunCannotGoOnError,
    mistake_exit_code,
    stop_if_hopeless,
)


def test_a_wait_goes_on_while_a_round_can_still_seal_and_ends_saying_why_once_none_can():
    reasons = iter([None, None, "2 of the run's 3 replicas left (min_replicas = 3)"])
    check = stop_if_hopeless(lambda: next(reasons), "agreeing on the run's data plan")
    check()
    check()
    with pytest.raises(RunCannotGoOnError) as raised:
        check()
    assert str(raised.value) == (
        "while agreeing on the run's data plan: 2 of the run's 3 replicas left (min_replicas = 3)"
    )
    assert mistake_exit_code(raised.value) == RunCannotGoOnError.exit_code
    assert mistake_exit_code(RuntimeError("a store hiccup")) is None  # a restart may get past

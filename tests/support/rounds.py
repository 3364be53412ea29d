"""Rounds of one process's replicas, finished together on threads of their own (each waits
for the others' contributions), as the collective tests run them without starting a process."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import TypeVar

from diloco_anywhere.collective.allreduce import RoundResult, finish_round
from diloco_anywhere.collective.round import Round

Key = TypeVar("Key", bound=Hashable)


def finish_in_threads(rounds: dict[Key, Round]) -> dict[Key, RoundResult | Exception]:
    """Each round's result, or the error it raised; fails if one has not ended in 120 s."""
    outcomes: dict[Key, RoundResult | Exception] = {}

    def finish(name: Key) -> None:
        try:
            outcomes[name] = finish_round(rounds[name])
        except Exception as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=finish, args=(name,)) for name in rounds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a round hung"
    return outcomes

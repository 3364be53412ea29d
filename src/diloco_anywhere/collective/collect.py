"""Garbage collection of rounds: delete a round's data once no live member still needs it.

A member needs round ``r`` until it has finished it, and a straggler (late, left out of SEALs,
still reading results) can be many rounds behind the others. So the deleter, the first sealed
contributor of each round, deletes only rounds that every live member's lease reports finished
(leases are up to a period old, which errs toward keeping), and never the newest
``keep_rounds``, nor any round after ``retained_after()`` (what healing replays from the
checkpoints kept, ``checkpoints/``). A round's SEAL stays: a replica that reaches a collected
round anyway finds it sealed without it and fails, rather than sealing a fresh round alone.
The bucket's lifecycle rule removes what the collector leaves (rounds of members that died).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store

log = logging.getLogger(__name__)
WINDOW = 64  # rounds a new deleter looks back over; older ones are the lifecycle rule's


class RoundCollector:
    def __init__(
        self,
        store: Store,
        layout: RunLayout,
        keep_rounds: int,
        retained_after: Callable[[], int] | None = None,
    ) -> None:
        self.store, self.layout, self.keep_rounds = store, layout, keep_rounds
        self._retained_after = retained_after
        self._floor: dict[int, int] = {}  # per fragment: rounds below are collected

    def collect(self, fragment: int, newest: int, progress: Iterable[dict[int, int]]) -> None:
        """Delete the data of every round of ``fragment`` up to ``newest - keep_rounds`` that
        every member in ``progress`` has finished. Best effort: errors are logged."""
        upper = min([newest - self.keep_rounds, *(p.get(fragment, -1) for p in progress)])
        if self._retained_after is not None:
            upper = min(upper, self._retained_after())
        floor = self._floor.get(fragment, max(0, upper - WINDOW))
        for old in range(floor, upper + 1):
            try:
                self.store.delete_prefix(
                    self.layout.fragment(old, fragment), keep=lambda key: key.endswith("/SEAL")
                )
            except StoreError as exc:
                log.warning("garbage collection of round %d fragment %d: %s", old, fragment, exc)
                upper = old - 1  # retried next time
                break
        self._floor[fragment] = max(floor, upper + 1)

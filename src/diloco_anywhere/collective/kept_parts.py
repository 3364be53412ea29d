"""The parts a round keeps in memory for its exchange, within ``policy.gather_memory`` bytes.

A gather exchange reduces every sealed contribution, this replica's included. Each part
held in memory until then is one the exchange need not make again: another replica's part,
checked while the round waited for its SEAL, need not be read again; our own, just
uploaded, need not be encoded again from the caller's tensors. Which is worth more decides
who keeps the room. From a store on this machine a part read again is a copy in memory, while
encoding ours again is the codec's work (int8: about 0.7 s per GiB of float32 on one core;
docs/benchmarks.md, "The reduction on the tensors' device"), so there our own parts keep
the room they took first. Through a network a part read again costs its transfer and, across
clouds, egress billed per GiB, so there another replica's part takes the place of one of ours.
"""

from __future__ import annotations

import threading

from diloco_anywhere.collective.transfers import Held

PartId = tuple[str, int]  # (contributor, shard)


class KeptParts:
    """Checked or just-uploaded parts by ``PartId``, at most ``budget`` bytes of them; ``own``
    names this replica's contributions; ``others_first``: another's part may evict ours."""

    def __init__(self, budget: int, own: str, others_first: bool) -> None:
        self._budget, self._own, self._others_first = budget, own, others_first
        self._held: dict[PartId, Held] = {}
        self._bytes = 0
        self._lock = threading.Lock()  # our own parts are kept from the upload threads

    def offer(self, part: PartId, held: Held) -> bool:
        """Keep ``held`` (its ``view`` is the part's bytes) if it fits, making room from our
        own parts first where others come first; False: not kept, the caller releases it."""
        nbytes = len(held.view)
        with self._lock:
            if self._others_first and part[0] != self._own:
                self._evict_own(nbytes)
            if self._bytes + nbytes > self._budget:
                return False
            self._held[part] = held
            self._bytes += nbytes
            return True

    def take(self, part: PartId) -> Held | None:
        """The kept bytes of ``part``, now the caller's to release; None if not kept."""
        with self._lock:
            held = self._held.pop(part, None)
            if held is not None:
                self._bytes -= len(held.view)
            return held

    def release(self) -> None:
        """Give back every buffer still kept (the round is over)."""
        with self._lock:
            kept, self._held, self._bytes = list(self._held.values()), {}, 0
        for held in kept:
            held.release()

    def _evict_own(self, nbytes: int) -> None:
        """Release our own parts, last shard first, until ``nbytes`` more fit; none if even
        all of them would not make room."""
        ours = sorted((part for part in self._held if part[0] == self._own), reverse=True)
        freeable = sum(len(self._held[part].view) for part in ours)
        if self._bytes - freeable + nbytes > self._budget:
            return
        while self._bytes + nbytes > self._budget:
            held = self._held.pop(ours.pop(0))
            self._bytes -= len(held.view)
            held.release()

"""A replica's place in the votes on what a run starts with (bucket/agreement.py), for tests
that check one replica's record against the run's: no grace, so a lone voter decides at once."""

from __future__ import annotations

from diloco_anywhere.bucket.agreement import Electorate


def voter(index: int = 0, replicas: int = 2) -> Electorate:
    return Electorate(index, f"local-{index}", replicas, 1, grace=0.0, timeout=600.0)

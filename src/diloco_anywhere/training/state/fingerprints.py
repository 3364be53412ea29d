"""A replica's fingerprint: its committed step and a checksum of its global state, which every
contribution and checkpoint carries, so that replicas holding different states are told apart
(``managers/bucket.py``). Torch-free: records that carry one are read without torch.
"""

from __future__ import annotations

import crc32c


def fingerprint(step: int, checksum: int) -> str:
    """What every manifest carries: equal only for replicas holding the same global state."""
    return f"step-{step}-{checksum:08x}"


def combine_fingerprints(fingerprints: list[str]) -> str:
    """A sharded replica's fingerprint: its ranks' (each of its own shard) in rank order, as
    one. One rank's is its own."""
    if len(fingerprints) == 1:
        return fingerprints[0]
    step = fingerprints[0].rpartition("-")[0]
    return f"{step}-{crc32c.crc32c('|'.join(fingerprints).encode()):08x}"

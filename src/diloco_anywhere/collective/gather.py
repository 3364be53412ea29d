"""``gather`` exchange: every replica reads every sealed contribution and reduces it itself.

Per replica it downloads ``(n - 1) P``: cheapest for few replicas or small payloads, and it
needs nothing from the others after the SEAL. A sealer in gather mode has checked every
contribution in full before sealing; a part that still reads back corrupt fails the round with
its key named, on every replica that reads it, and is never averaged.
"""

from __future__ import annotations

import torch

from diloco_anywhere.collective.mean import weighted_mean
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.collective.round import Round


def gather_mean(round_: Round, seal: Seal) -> torch.Tensor:
    manifests = round_.sealed_manifests(seal)
    shards = range(len(manifests[0].parts))
    parts = round_.read_parts((name, shard) for name in seal.contributors for shard in shards)
    for (name, _), part in parts.items():
        if isinstance(part, Exception):
            raise round_.unreadable(name, part)
    mean = torch.empty(manifests[0].numel)
    for shard, part in enumerate(manifests[0].parts):  # part by part: no copy of contributions
        contributions = [
            (parts[name, shard], manifest.weight)
            for name, manifest in zip(seal.contributors, manifests, strict=True)
        ]
        weighted_mean(contributions, out=mean[part.start : part.stop])  # type: ignore[arg-type]
    return mean

"""``gather`` exchange: every replica reads every sealed contribution and reduces it itself.

Per replica it downloads ``(n - 1) P``: cheapest for few replicas or small payloads, and it
needs nothing from the others after the SEAL. A sealer in gather mode has checked every
contribution in full before sealing; a part that still reads back corrupt fails the round with
its key named, on every replica that reads it, and is never averaged.

The reduction streams part by part: a window of parts in flight (kept from the prefetch, our
own encoded again, the rest downloaded), one accumulator, and each reduced part written into
the destination as soon as it is done.
"""

from __future__ import annotations

import contextlib

import torch

from diloco_anywhere.bucket.format import framing
from diloco_anywhere.collective.flat import FlatTensors
from diloco_anywhere.collective.mean import WeightedMean
from diloco_anywhere.collective.parts import release
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.collective.round import Round


def gather_mean(round_: Round, seal: Seal, destination: FlatTensors) -> None:
    manifests = round_.sealed_manifests(seal)
    layout, total = manifests[0].parts, sum(manifest.weight for manifest in manifests)
    wanted = ((name, shard) for shard in range(len(layout)) for name in seal.contributors)
    accumulator = torch.empty(max(entry.stop - entry.start for entry in layout))
    with contextlib.closing(round_.parts_in_order(wanted)) as parts:
        for entry in layout:
            mean = WeightedMean(accumulator[: entry.stop - entry.start], total)
            for name, manifest in zip(seal.contributors, manifests, strict=True):
                part = next(parts)
                try:
                    if isinstance(part, framing.WireFormatError):
                        raise part
                    for start, values in part.chunks():
                        mean.add(start, values, manifest.weight)
                except framing.WireFormatError as exc:
                    raise round_.unreadable(name, exc) from None
                finally:
                    release(part)
            destination.write(entry.start, mean.result())

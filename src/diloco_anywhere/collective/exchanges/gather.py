"""``gather`` exchange: every replica reads every sealed contribution and reduces it itself.

Per replica it downloads ``(n - 1) P``: cheapest for few replicas or small payloads, and it
needs nothing from the others after the SEAL. A sealer in gather mode has checked every
contribution in full before sealing; a part that still reads back corrupt fails the round with
its key named, on every replica that reads it, and is never averaged.

The reduction streams part by part (``reduction.py``): a window of parts in flight (those kept
in memory, ``kept_parts.py``; our own encoded again where it was not kept; the rest
downloaded), decoded and averaged where the destination lives, several parts at a time, each
reduced part written into the destination as soon as it is done.
"""

from __future__ import annotations

from diloco_anywhere.collective.exchanges.reduction import ShardMean, reduce_shards
from diloco_anywhere.collective.flat import FlatTensors
from diloco_anywhere.collective.records import Seal
from diloco_anywhere.collective.round import Round


def gather_mean(round_: Round, seal: Seal, destination: FlatTensors) -> None:
    layout = round_.sealed_manifests(seal)[0].parts

    def write(reduced: ShardMean) -> None:
        if reduced.failure is not None:
            raise round_.unreadable(*reduced.failure) from None
        destination.write(layout[reduced.shard].start, reduced.mean.result())

    reduce_shards(round_, seal, range(len(layout)), destination.device, write)

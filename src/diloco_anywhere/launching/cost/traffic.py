"""What a run sends and asks of its store: one replica's bytes and requests per outer step, and
its heartbeat's per hour. The bill's quantities, which prices (``prices``, ``clouds``) turn
into dollars in the estimate (``cost_estimate``).

Where the bytes go (docs/collective.md, "One round"): per outer step each replica puts its
encoded pseudo-gradient, ``P`` bytes, and reads the others'. ``gather`` reads ``(n - 1) P``;
``sharded`` puts ``P + R/n`` (its contribution and its reduced shard, ``R`` bytes for the
whole result: ``P`` but for a sparse codec, whose result is int8) and reads
``(P + R)(n - 1) / n``; ``[sync] mode = "auto"`` picks per round as the sealer does
(``RoundPolicy.exchange_mode``). Wire headers, manifests and records are small and not counted.
Checkpoints (written every ``[checkpoint] every`` syncs and read when a replica heals) are not
counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# Requests of one round beyond its parts (docs/collective.md, "One round" and "What it
# costs"), approximate: the listings of members/ at its start and before its SEAL, and its
# polls (one get_many of the SEAL and the manifests still missing, every 50-200 ms while the
# contributions arrive, then slower): 50 polls of about 2 keys, ~10 s of waiting.
LISTS_PER_ROUND = 2
POLL_GETS_PER_ROUND = 100


@dataclass(frozen=True)
class RoundTraffic:
    """One replica's bytes and requests per outer step (every fragment synced once)."""

    mode: str  # gather or sharded (the first fragment's, where they differ)
    payload: int  # bytes of one encoded contribution
    up: int
    down: int
    parts: int  # objects of one contribution
    put_list: float  # requests: puts and listings
    get: float


def fragment_sizes(parameters: int, fragments: int) -> list[int]:
    """Elements per fragment: consecutive parameters in about equal shares."""
    base, extra = divmod(parameters, fragments)
    return [base + (index < extra) for index in range(fragments)]


def exchange_bytes(
    mode: str, payload: int, replicas: int, reduced: int | None = None
) -> tuple[int, int]:
    """(up, down) bytes per replica for one round of ``payload`` bytes whose reduced result
    takes ``reduced`` (``payload`` by default; docs/collective.md, "What it costs")."""
    n, reduced = replicas, payload if reduced is None else reduced
    if mode == "gather":
        return payload, (n - 1) * payload
    return payload + reduced // n, (payload + reduced) * (n - 1) // n


def exchange_requests(mode: str, parts: int, replicas: int) -> tuple[float, float]:
    """(put_list, get) requests per replica for one round of ``parts`` parts each: the parts,
    the manifest, the round's listings and polls; sharded adds the reduced shards it owns and
    reads the others' instead of whole contributions."""
    n = replicas
    put_list = parts + 1 + LISTS_PER_ROUND
    if mode == "gather":
        return put_list, (n - 1) * (parts + 1) + POLL_GETS_PER_ROUND
    shard = parts / n
    return put_list + shard, 2 * (n - 1) * shard + (n - 1) + POLL_GETS_PER_ROUND


def round_traffic(
    parameters: int,
    codec: str,
    replicas: int,
    mode: str = "auto",
    fragments: int = 1,
    part_size: int = 4 << 20,
    codec_params: Mapping[str, int] | None = None,
) -> RoundTraffic:
    """Bytes and requests per replica per outer step: a round per fragment, each split into
    parts and exchanged as the round does (``collective/round.py``), plus one metrics chunk.
    ``codec_params``: the codec's own (``DilocoSection.codec_params``)."""
    from diloco_anywhere.bucket.codecs.codec import make_codec, reduced_codec
    from diloco_anywhere.collective.parts import part_ranges
    from diloco_anywhere.collective.policy import RoundPolicy

    encoder = make_codec(codec, **(codec_params or {}))
    policy = RoundPolicy(mode=mode)  # type: ignore[arg-type]
    modes, totals = [], [0.0] * 6  # payload, parts, up, down, put_list, get
    for numel in fragment_sizes(parameters, fragments):
        payload = encoder.payload_nbytes(numel)
        reduced = reduced_codec(encoder).payload_nbytes(numel)
        parts = len(part_ranges(numel, encoder, part_size // 4, replicas))
        chosen = policy.exchange_mode(replicas, payload, reduced)
        modes.append(chosen)
        values = (payload, parts, *exchange_bytes(chosen, payload, replicas, reduced),
                  *exchange_requests(chosen, parts, replicas))  # fmt: skip
        totals = [total + value for total, value in zip(totals, values, strict=True)]
    payload, parts, up, down, put_list, get = totals
    return RoundTraffic(
        modes[0], int(payload), int(up), int(down), int(parts), put_list + 1, get
    )  # + 1: the metrics chunk


def heartbeat_requests_per_hour(lease_period: float) -> tuple[float, float]:
    """(put_list, get) a replica's heartbeat makes per hour: each lease period a listing of
    members/, its lease's put and its claim's read (the delete is free; the clock's HEAD
    every 30 periods is left out)."""
    periods = 3600 / lease_period
    return 2 * periods, periods

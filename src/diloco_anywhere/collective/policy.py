"""The collective's settings, each default written here once: when a round seals and gives up,
how it exchanges and splits contributions (``RoundPolicy``), how often members renew their
leases (``LeasePolicy``), and what goes on the wire (``CollectiveConfig``). run.toml's
``[sync]`` section takes its defaults from these and builds them (``config/sections.py``).

Torch-free, so that reading a run's configuration (every ``diloco`` command) loads no torch:
a codec is built, in torch, only when a collective is (``_codec``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from diloco_anywhere.bucket.codecs.codec_names import DEFAULT_CODEC, CodecName
from diloco_anywhere.bucket.retry import JITTER

if TYPE_CHECKING:
    from diloco_anywhere.bucket.codecs.codec import Codec

ExchangeMode = Literal["gather", "sharded"]
ExchangeChoice = Literal["auto", "gather", "sharded"]
FLOAT32_BYTES = 4  # a part holds float32 values: its size, and a sync's memory, count in them


def _codec(name: CodecName) -> Codec:
    from diloco_anywhere.bucket.codecs.codec import (
        make_codec,  # torch: only when a collective is built
    )

    return make_codec(name)


@dataclass(frozen=True)
class RoundPolicy:
    """When to seal, how to exchange, when to give up, and how contributions are split."""

    min_replicas: int = 1
    grace: float = 10.0  # seconds after the first contribution is seen
    timeout: float = 600.0
    # "auto" picks per round from the sealed count and the payload size (``exchange_mode``).
    mode: ExchangeChoice = "auto"
    # The run's replica count: contributions split into a multiple of this many parts, so that
    # in sharded mode every owner reduces an equal share.
    expected_replicas: int = 1
    # auto: shard once that saves at least this many download bytes per replica (see below).
    sharded_min_saving: int = 64 << 20
    # sharded: a shard whose reduction is still missing this long after the SEAL was seen is
    # reduced by whoever notices (its owner died or stalls).
    orphan_grace: float = 30.0
    # At most 4 MiB of float32 per part: many parts per phase keep a window of connections
    # busy to its end, and a sync's memory is window x part (docs/benchmarks.md, "Sync over
    # a WAN", where the size was chosen).
    part_elements: int = 1 << 20
    # Parts in flight per round (encoding, uploading, downloading, waiting to be reduced): the
    # bound on a round's host memory (window x part size) and its concurrent requests. The
    # window starts here and widens between rounds, up to window_max, while a wider one moves
    # a round's parts faster (``transfers.AdaptiveWindow``); window_max = window: fixed.
    window: int = 8
    window_max: int = 32
    # Shards reduced at once, each by a thread of its own (``exchanges/reduction.py``); None:
    # one per core this process may use on the CPU (at most ``window``), two on a GPU.
    reducers: int | None = None
    # gather: checked parts kept in memory between the wait for the SEAL and the exchange, at
    # most this many bytes; ``auto`` shards when the others' contributions would not fit.
    gather_memory: int = 256 << 20
    # Between polls: from poll_min, doubling to poll_max while a wait is young; once it has
    # lasted a while, up to poll_share of its age, at most poll_cap (``poll_delays``).
    poll_min: float = 0.05
    poll_max: float = 0.2
    poll_share: float = 0.05
    poll_cap: float = 5.0

    def poll_delays(self, clock: Callable[[], float] = time.monotonic) -> Iterator[float]:
        """Seconds between polls: jittered exponential backoff whose ceiling follows the wait.

        The upper bound doubles from ``poll_min`` to ``poll_max``, so a round whose
        contributions arrive together is noticed within ~0.2 s. A wait that goes on (a
        straggler, a slow owner) raises the ceiling to ``poll_share`` of its age, up to
        ``poll_cap``: noticing the end of a 10-minute wait up to 5 s late costs under 1% of
        it, and the waiting replica sends ~10x fewer requests than at a 200 ms ceiling (stores
        rate-limit requests, and bill them; docs/benchmarks.md, "What waiting costs"). Each
        delay is uniform between ``poll_min`` and the bound, so replicas polling the same
        keys spread out. Restart it when a poll finds something."""
        started, upper = clock(), self.poll_min
        while True:
            yield JITTER.uniform(self.poll_min, upper)
            ceiling = max(self.poll_max, self.poll_share * (clock() - started))
            upper = min(self.poll_cap, ceiling, 2 * upper)

    def exchange_mode(
        self, contributors: int, payload_bytes: int, reduced_bytes: int | None = None
    ) -> ExchangeMode:
        """The exchange that downloads fewer bytes per replica, by enough to pay for its
        extra requests. ``gather`` downloads the others' contributions, ``(n - 1) P``, and
        what of them did not fit ``gather_memory`` once more (a gather keeps what it checked
        before the SEAL and reads the rest again). ``sharded`` downloads ``(n - 1)(P + R) / n``,
        ``R`` being the reduced result's bytes (``reduced_bytes``: ``P`` for a dense codec,
        int8's for a sparse one, ``codec.reduced_codec``), but adds a put and a get in
        sequence. Shard when it saves at least ``sharded_min_saving``: two more store round
        trips at ~50 ms each and ~1 GB/s per replica are ~100 MB; the default is 64 MiB. With
        a dense codec that is ``P (n - 1)(n - 2) / n`` or a gather that does not fit its
        memory; with a sparse one, whose int8 reduced result is ~14 times its contribution
        at the default 8% (~49 at SparseLoCo's 1.56%), gathering moves fewer bytes up to
        about 14 replicas, or fewer when the others' contributions overflow
        ``gather_memory`` (a 1B-parameter model shards from 10 replicas)."""
        if self.mode != "auto":
            return self.mode
        n, reduced = contributors, payload_bytes if reduced_bytes is None else reduced_bytes
        if n < 2:
            return "gather"
        others = (n - 1) * payload_bytes
        gather = others + max(0, others - self.gather_memory)
        sharded = (n - 1) * (payload_bytes + reduced) / n
        return "sharded" if gather - sharded >= self.sharded_min_saving else "gather"


@dataclass(frozen=True)
class LeasePolicy:
    period: float = 10.0  # seconds between a member's leases, on its own monotonic clock
    # A member whose lease a reader has seen unchanged for ``misses`` periods is dead: one
    # period between beats, plus room for a slow put and for the reader's polling interval.
    misses: int = 3
    skew_every: int = 30  # beats between measurements of the clock's skew (every 5 min)

    @property
    def expiry(self) -> float:
        return self.period * self.misses


@dataclass(frozen=True)
class CollectiveConfig:
    """A collective's settings: what goes on the wire, rounds, leases, garbage collection. A
    run builds it from run.toml once (``RunConfig.collective_config``), codec included."""

    codec: Codec = field(default_factory=lambda: _codec(DEFAULT_CODEC))
    # What torchft's DiLoCo sends when it asks to quantize (``should_quantize=True``)
    quantized_codec: Codec = field(default_factory=lambda: _codec("int8"))
    round: RoundPolicy = field(default_factory=RoundPolicy)
    lease: LeasePolicy = field(default_factory=LeasePolicy)
    max_rounds_in_flight: int = 4  # e.g. one per Streaming DiLoCo fragment
    keep_rounds: int = 2  # per fragment: the newest rounds never collected (collect.py)

"""The all-reduce alone: average tensors with processes that share nothing but a bucket.

    from diloco_anywhere import Collective

    with Collective("s3://bucket/runs", replica="worker-0", replicas=2) as collective:
        collective.allreduce(tensor)  # tensor now holds the mean over the replicas

No torchft, no run.toml: a store URL, this process's name and how many replicas to wait for.
Every replica calls ``allreduce`` the same number of times, in the same order, as with any
collective; each call is one sealed round (docs/collective.md), numbered on from the newest
round sealed in the bucket when the first call is made, so a process that restarts joins at
the round the others are at rather than at round 0 (finding it lists the rounds' objects once;
a round that timed out without a SEAL is not skipped, and a restart then waits in it). A round
seals once ``replicas`` have contributed, or ``grace`` seconds after the first contribution
with at least ``min_replicas``; a replica late
for a round sealed without it gets the mean of the others and its own values are dropped, as in
a DiLoCo run, while the round's data is kept (the two newest rounds; older ones are collected,
and reading one fails saying so). ``RoundTimeoutError`` or ``SealedContributionError`` say
why a round failed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.bucket.codecs.codec_names import DEFAULT_CODEC, CodecName
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective, Work
from diloco_anywhere.collective.policy import CollectiveConfig, RoundPolicy


class Collective:
    """A weighted-mean all-reduce among the processes that open the same ``url`` and
    ``name``, each with its own ``replica`` name."""

    def __init__(
        self,
        url: str,
        replica: str,
        *,
        replicas: int,
        min_replicas: int | None = None,
        name: str = "allreduce",
        codec: CodecName = DEFAULT_CODEC,
        grace: float = RoundPolicy.grace,
        timeout: float = RoundPolicy.timeout,
    ) -> None:
        """``replicas``: how many contribute to a round when all are up; ``min_replicas``
        (default: all of them) the fewest a round may seal with after ``grace`` seconds;
        ``codec``: ``fp32``, ``bf16`` or ``int8`` on the wire (not ``sparse``: it drops
        most values, which only a DiLoCo run's error feedback sends later)."""
        if codec == "sparse":
            raise ValueError(
                "codec 'sparse' sends only the largest values of each chunk and needs error "
                "feedback to send the rest later, which a DiLoCo run has (run.toml: [diloco] "
                'codec = "sparse"); a plain all-reduce takes fp32, bf16 or int8'
            )
        policy = RoundPolicy(
            min_replicas=replicas if min_replicas is None else min_replicas,
            expected_replicas=replicas, grace=grace, timeout=timeout,
        )  # fmt: skip
        self.store = Store(url)
        config = CollectiveConfig(codec=make_codec(codec), round=policy)
        self._collective = BucketCollective(self.store, name, replica, config)
        self._rounds: Iterator[int] | None = None  # numbered at the first round

    @property
    def rounds(self) -> BucketCollective:
        """The bucket collective underneath, for ``BucketManager.over``: its rounds are the
        syncs of torchft's DiLoCo, numbered by the manager instead of ``allreduce``."""
        return self._collective

    def _next_round(self) -> int:
        """The round after the newest sealed one (0 for a new collective)."""
        layout = self._collective.layout
        sealed = (layout.parse_seal(key) for key in self.store.list_prefix(layout.rounds()))
        return max((round_ + 1 for round_ in sealed if round_ is not None), default=0)

    def allreduce_async(self, tensor: torch.Tensor, weight: float = 1.0) -> Work:
        """Start the next round with ``tensor`` (weighted by ``weight``); ``wait()`` on the
        result. ``tensor`` must not be touched until then: the mean is written into it."""
        if self._rounds is None:  # now, not when built: setting up may take a while
            self._rounds = itertools.count(self._next_round())
        return self._collective.allreduce(tensor, round_=next(self._rounds), weight=weight)

    def allreduce(self, tensor: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """``tensor``, now holding the weighted mean over this round's contributors."""
        self.allreduce_async(tensor, weight).wait()
        return tensor

    def close(self, wait: bool = True) -> None:
        """Leave; with ``wait``, first let a round in flight finish."""
        self._collective.close(wait=wait)
        self.store.close()

    def __enter__(self) -> Collective:
        return self

    def __exit__(self, _kind: object, error: BaseException | None, _traceback: object) -> None:
        self.close(wait=error is None)

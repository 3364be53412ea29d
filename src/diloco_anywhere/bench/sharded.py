"""``diloco bench sharded``: what sharding a replica over N ranks does to each rank's traffic.

With ``[run] sharding = "fsdp"`` and ``processes_per_replica = N``, rank r of every replica
holds shard r of the model and exchanges only that shard, 1/N of the pseudo-gradient, in a
round namespace of its own (``{run}/ranks/{r}/``), in parallel with the other ranks
(``training/ranks/sharding.py``). The claim to check: each rank moves about 1/N of what an
unsharded replica moves, so the bytes through any one host fall by N when every rank has a
host (and a NIC) of its own, while a replica's bytes in all stay the same.

For each N in ``ranks``, ``replicas`` x N processes start (spawned, as real ranks are
processes), each with its own ``Store`` (so its counters are its own) and its own
``BucketCollective`` for rank r. Every rank all-reduces its slice of a float32 pseudo-gradient
of ``size`` bytes per replica; each round starts on a barrier of all the processes, and its
wall time runs from the first rank starting to the last finishing, on this machine's monotonic
clock. Traffic is each rank's store counters over the round (lease heartbeats, polls,
manifests and SEAL included), median over rounds. "Busiest host" is the busiest rank's bytes:
here every rank is a process, as on a deployment where each rank is its own host; where a
replica's ranks share one host, its bytes are the replica's (reported too). The mean each rank
gets is checked against the one its replicas' known contributions give.

One rank's exchange is a ``diloco bench sync`` of ``replicas`` replicas at ``size / N`` bytes
(``SyncBench``): same round policy, same bound per mode.

With a WAN shape (``wan.py``) every rank reaches the store through a shaped link of its own,
as a rank with its own host and NIC does, and a round is compared with what the busiest rank's
link allows, ``(its bytes up + down) / link``, and with the round of the fewest ranks measured.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from diloco_anywhere.bench.sync import SyncBench, traffic_bound
from diloco_anywhere.bench.tools.processes import collect, report, worker_context
from diloco_anywhere.bench.tools.wan import WanShape
from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.bucket.redaction import redact_url
from diloco_anywhere.bucket.stats import StoreStats
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.policy import CollectiveConfig

CHUNK = 1 << 20  # elements per step when filling a pattern: no temporaries the shard's size
PATTERN_PERIOD = 65521  # prime: a slice misplaced within or across shards reads other values


@dataclass(frozen=True)
class ShardedBench:
    """``replicas`` replicas of ``ranks`` ranks each, ``size`` bytes of float32 per replica."""

    replicas: int
    ranks: int
    size: int
    rounds: int = 3
    mode: str = "auto"
    wan: WanShape | None = None  # each rank's link to the store

    def exchange(self) -> SyncBench:
        """What one rank's exchange is: a sync of the replicas over its shard."""
        return SyncBench(self.replicas, self.size // self.ranks, self.rounds, mode=self.mode)

    def shard(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s elements ``[start, stop)`` of a replica's pseudo-gradient."""
        numel = self.size // 4
        return numel * rank // self.ranks, numel * (rank + 1) // self.ranks

    @property
    def run(self) -> str:
        return f"bench-sharded-{self.ranks}"


@dataclass(frozen=True)
class RankRound:
    started: float  # time.perf_counter(): CLOCK_MONOTONIC, one clock for all processes here
    finished: float
    traffic: StoreStats
    mode: str
    mean_error: float  # max |mean - expected mean| over the shard


def _fill(tensor: torch.Tensor, first: int, round_: int, offset: float) -> None:
    """Elements ``first + i`` of a pseudo-gradient: a pattern of the position and the round,
    plus ``offset``. Replica j contributes ``offset = j``, so the mean is the pattern plus
    the mean of the offsets, and every rank can check its own shard of it."""
    for begin in range(0, tensor.numel(), CHUNK):
        stop = min(begin + CHUNK, tensor.numel())
        index = torch.arange(first + begin, first + stop, dtype=torch.int64)
        pattern = (index * 7919 + round_) % PATTERN_PERIOD
        tensor[begin:stop] = pattern.to(torch.float32) / PATTERN_PERIOD + offset


def _mean_error(tensor: torch.Tensor, first: int, round_: int, replicas: int) -> float:
    expected = torch.empty_like(tensor)
    _fill(expected, first, round_, (replicas - 1) / 2)
    return float((tensor - expected).abs().max())


def _round(
    collective: BucketCollective, tensor: torch.Tensor, first: int, round_: int, replicas: int
) -> RankRound:
    before, started = collective.store.stats(), time.perf_counter()
    work = collective.allreduce(tensor, round_=round_)
    work.wait()
    finished = time.perf_counter()
    traffic = collective.store.stats() - before
    error = _mean_error(tensor, first, round_, replicas)
    return RankRound(started, finished, traffic, work.result().seal.mode, error)


def _rank(url, options, replica, rank, bench: ShardedBench, barrier, results) -> None:
    exchange = bench.exchange()
    config = CollectiveConfig(
        codec=make_codec(exchange.codec), round=exchange.policy(), keep_rounds=1
    )
    start, stop = bench.shard(rank)

    def measure() -> list[RankRound]:
        with (
            Store(url, storage_options=options) as store,
            BucketCollective(store, bench.run, f"r{replica}", config, rank=rank) as collective,
        ):
            tensor = torch.empty(stop - start)  # this rank's shard, refilled every round
            measured = []
            for round_ in range(bench.rounds):
                _fill(tensor, start, round_, replica)
                barrier.wait()
                measured.append(_round(collective, tensor, start, round_, bench.replicas))
        return measured

    report(results, (replica, rank), barrier, measure)


def _run_ranks(
    url, options: list[dict[str, Any]], bench: ShardedBench, progress
) -> list[list[RankRound]]:
    """Per rank process (replica by replica, rank by rank), its ``RankRound`` of every round;
    process ``j * ranks + r`` reaches the store with ``options[j * ranks + r]``."""
    context = worker_context()
    processes = bench.replicas * bench.ranks
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(
            target=_rank,
            args=(url, options[j * bench.ranks + r], j, r, bench, barrier, results),
        )
        for j in range(bench.replicas)
        for r in range(bench.ranks)
    ]
    for worker in workers:
        worker.start()
    outcomes = collect(
        workers,
        results,
        lambda key: f"replica r{key[0]} rank {key[1]}",
        lambda done: progress(f"{bench.ranks} rank(s) x {bench.replicas} replicas: {done}"),
    )
    return [outcomes[j, r] for j in range(bench.replicas) for r in range(bench.ranks)]


def _measure(url: str, options: list[dict[str, Any]], bench: ShardedBench, progress) -> dict:
    """One rank count: traffic per rank and per replica, round wall time, the check."""
    per_rank = _run_ranks(url, options, bench, progress)
    with Store(url, storage_options=options[0]) as store:
        store.delete_prefix(bench.run)  # the last round stays otherwise (``keep_rounds=1``)
    up = [int(statistics.median(m.traffic.bytes_up for m in rounds)) for rounds in per_rank]
    down = [int(statistics.median(m.traffic.bytes_down for m in rounds)) for rounds in per_rank]
    both = [u + d for u, d in zip(up, down, strict=True)]
    walls = [
        max(rounds[k].finished for rounds in per_rank)
        - min(rounds[k].started for rounds in per_rank)
        for k in range(bench.rounds)
    ]
    mode = statistics.mode(m.mode for rounds in per_rank for m in rounds)
    exchange = bench.exchange()
    payload = make_codec(exchange.codec).payload_nbytes(exchange.size // 4)
    bound_up, bound_down = traffic_bound(mode, bench.replicas, payload)
    replica_bytes = [sum(both[j * bench.ranks : (j + 1) * bench.ranks])
                     for j in range(bench.replicas)]  # fmt: skip
    measured = {
        "ranks": bench.ranks,
        "shard_bytes": exchange.size,
        "mode": mode,
        "bytes_up_per_rank_mean": round(statistics.mean(up)),
        "bytes_up_per_rank_max": max(up),
        "bytes_down_per_rank_mean": round(statistics.mean(down)),
        "bytes_down_per_rank_max": max(down),
        "bytes_per_rank_mean": round(statistics.mean(both)),
        # every rank is a process of its own here: the busiest host is the busiest rank
        "busiest_host_bytes": max(both),
        # where a replica's ranks share one host (one NIC): that host's bytes
        "bytes_per_replica_max": max(replica_bytes),
        "up_vs_bound": statistics.mean(up) / bound_up,
        "down_vs_bound": statistics.mean(down) / bound_down if bound_down else float("nan"),
        "round_seconds": statistics.median(walls),
        "round_seconds_each": walls,
        "max_mean_error": max(m.mean_error for rounds in per_rank for m in rounds),
    }
    if bench.wan is not None:
        # every rank has a link of its own: the round cannot end before the busiest rank's
        # bytes have crossed its link
        link_seconds = max(both) / bench.wan.link
        measured["link_bound_seconds"] = link_seconds
        measured["round_vs_link_bound"] = measured["round_seconds"] / link_seconds
    return measured


def bench_sharded(
    url: str, options: list[dict[str, Any]], replicas: int, ranks: list[int], size: int,
    rounds: int, mode: str, wan: WanShape | None, progress,
) -> dict:  # fmt: skip
    """Every rank count in ``ranks``, one after the other, against the same store; per-rank
    traffic and round time are also given relative to the fewest ranks measured (expected
    traffic: their ratio). ``options``: each rank process's storage options, replica by
    replica, rank by rank, ``replicas x max(ranks)`` of them (its own shaped link, with a
    WAN); a rank count of N uses the first ``replicas x N``."""
    if size // 4 < max(ranks):
        raise ValueError(f"{size} bytes is fewer float32 values than {max(ranks)} ranks")
    configs = [
        _measure(url, options, ShardedBench(replicas, n, size, rounds, mode, wan), progress)
        for n in sorted(set(ranks))
    ]
    baseline = configs[0]
    for config in configs:
        config["bytes_per_rank_vs_baseline"] = (
            config["bytes_per_rank_mean"] / baseline["bytes_per_rank_mean"]
        )
        config["busiest_host_vs_baseline"] = (
            config["busiest_host_bytes"] / baseline["busiest_host_bytes"]
        )
        config["expected_vs_baseline"] = baseline["ranks"] / config["ranks"]
        config["round_vs_baseline"] = config["round_seconds"] / baseline["round_seconds"]
    result = {
        "url": redact_url(url),
        "replicas": replicas,
        "size_bytes": size,
        "codec": "fp32",
        "rounds": rounds,
        "baseline_ranks": baseline["ranks"],
        "configs": configs,
    }
    if wan is not None:
        result["wan"] = asdict(wan)
    return result

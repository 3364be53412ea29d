"""``diloco bench sync``: N replica processes all-reduce through a store, beside a raw copy.

Each replica is its own OS process with its own ``BucketCollective``. Every round starts on a
barrier, so a round's wall time is the exchange alone (encode, put, poll, seal, fetch, reduce).
Traffic comes from each replica's store counters (lease heartbeats, manifests, SEAL and polls
included; they are bytes) and is compared with the bound of the mode for the encoded payload
``P``: gather up ``P``, down ``(n - 1) P``; sharded up ``P (1 + 1/n)``, down ``2 P (n - 1) / n``.
The raw copy, in the same run, moves the same per-replica bytes with plain files and threads:
every replica writes what it uploaded, then reads what it downloaded.
"""

from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from diloco_anywhere.bench.store import sample_tensor
from diloco_anywhere.codec import make_codec
from diloco_anywhere.collective.allreduce import BucketCollective, CollectiveConfig
from diloco_anywhere.collective.round import RoundPolicy
from diloco_anywhere.store import Store, redact_url

MODES = ("gather", "sharded", "auto")


def _replica(url, options, index, replicas, numel, rounds, codec, mode, barrier, results) -> None:
    store = Store(url, storage_options=options)
    config = CollectiveConfig(
        codec=make_codec(codec),
        round=RoundPolicy(
            min_replicas=replicas, grace=600.0, timeout=600.0, mode=mode,
            expected_replicas=replicas,
        ),
    )  # fmt: skip
    try:
        with BucketCollective(store, f"bench-{replicas}", f"r{index}", config) as collective:
            measured = []
            for round_ in range(rounds):
                tensor = sample_tensor("gaussian", numel, seed=1000 * round_ + index)
                barrier.wait()
                before, started = store.stats(), time.perf_counter()
                work = collective.allreduce(tensor, round_=round_)
                work.wait()
                seconds, traffic = time.perf_counter() - started, store.stats() - before
                measured.append(
                    (
                        seconds,
                        traffic.bytes_up,
                        traffic.bytes_down,
                        traffic.puts + traffic.gets + traffic.lists,
                        work.result().seal.mode,
                    )
                )
        results.put((index, measured))
    except Exception as exc:  # reported to the parent instead of a silent hang
        results.put((index, f"{type(exc).__name__}: {exc}"))


def _run_replicas(url, options, replicas, numel, rounds, codec, mode, progress) -> list:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(replicas), context.Queue()
    processes = [
        context.Process(
            target=_replica,
            args=(url, options, i, replicas, numel, rounds, codec, mode, barrier, results),
        )
        for i in range(replicas)
    ]
    for process in processes:
        process.start()
    outcomes = []
    for done in range(replicas):
        progress(f"{replicas} replicas x {rounds} rounds: {done}/{replicas} finished")
        index, measured = results.get(timeout=3600)
        if isinstance(measured, str):
            raise RuntimeError(f"replica r{index} failed: {measured}")
        outcomes.append(measured)
    for process in processes:
        process.join(timeout=60)
    return outcomes


def _raw_copy_seconds(replicas: int, up: int, down: int) -> float:
    """Every replica writes ``up`` bytes, then reads ``down`` bytes of the others' files."""
    payload = bytes(up)
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(replicas) as pool:
        paths = [Path(folder) / str(i) for i in range(replicas)]
        started = time.perf_counter()
        list(pool.map(lambda path: path.write_bytes(payload), paths))
        reads = max(1, round(down / up)) if up else 0

        def read_others(i: int) -> None:
            for k in range(reads):
                paths[(i + 1 + k) % replicas].read_bytes()

        list(pool.map(read_others, range(replicas)))
        return time.perf_counter() - started


def traffic_bound(mode: str, replicas: int, payload: int) -> tuple[float, float]:
    """(up, down) bytes per replica per round that the mode cannot go below."""
    n = replicas
    if mode == "sharded":
        return payload * (1 + 1 / n), 2 * payload * (n - 1) / n
    return payload, payload * (n - 1)


def bench_sync(
    url: str,
    options: dict[str, Any],
    replicas: int,
    size: int,
    rounds: int,
    codec: str,
    mode: str,
    progress,
) -> dict[str, Any]:
    """Medians over rounds (and replicas) of traffic and wall time per round."""
    outcomes = _run_replicas(url, options, replicas, size // 4, rounds, codec, mode, progress)
    rows = [row for measured in outcomes for row in measured]
    up = int(statistics.median(row[1] for row in rows))
    down = int(statistics.median(row[2] for row in rows))
    round_seconds = statistics.median(max(m[r][0] for m in outcomes) for r in range(rounds))
    progress("raw parallel copy of the same bytes")
    raw = statistics.median(_raw_copy_seconds(replicas, up, down) for _ in range(rounds))
    sealed_mode = statistics.mode(row[4] for row in rows)
    payload = make_codec(codec).payload_nbytes(size // 4)
    bound_up, bound_down = traffic_bound(sealed_mode, replicas, payload)
    return {
        "url": redact_url(url),
        "mode": sealed_mode,
        "codec": codec,
        "replicas": replicas,
        "size_bytes": size,
        "payload_bytes": payload,
        "rounds": rounds,
        "bytes_up_per_replica": up,
        "bytes_down_per_replica": down,
        "bound_up_per_replica": int(bound_up),
        "bound_down_per_replica": int(bound_down),
        "up_vs_bound": up / bound_up,
        "down_vs_bound": down / bound_down if bound_down else float("nan"),
        "requests_per_replica": int(statistics.median(row[3] for row in rows)),
        "round_seconds": round_seconds,
        "raw_copy_seconds": raw,
        "round_vs_raw": round_seconds / raw if raw else float("inf"),
        "up_vs_payload": up / size,
        "down_vs_payload": down / size,
    }

"""``diloco bench sync``: N replica processes all-reduce through a store, beside a raw copy.

Each replica is its own OS process with its own ``BucketCollective``. Every round starts on a
barrier, so a round's wall time is the exchange alone (encode, put, poll, seal, fetch, reduce).
Traffic comes from each replica's store counters (lease heartbeats, manifests, SEAL and polls
included; they are bytes) and is compared with the bound of the mode for the encoded payload
``P``: gather up ``P``, down ``(n - 1) P``; sharded up ``P + R/n``, down ``(P + R)(n - 1) / n``,
``R`` the reduced result's bytes (``P``; int8's for a sparse codec: ``traffic_bound``).
The raw copy, in the same run, moves the same per-replica bytes with plain files and threads:
every replica writes what it uploaded, then reads what it downloaded, in part-sized files,
``window`` at a time, from and into reused buffers (``_raw_copy_seconds``); with a WAN, it
puts and gets them through the same links with the store client (``_raw_store_copy_seconds``).

Host memory: each replica samples its own resident set every 5 ms (``memory.py``); a round's
figure is its peak minus the resident set before the first round (the pseudo-gradient itself
and the collective already there), so buffers a sync keeps between rounds count too. The codec
work is what a round needs (``codec_passes``: encodes and decodes of the whole payload per
replica), each pass timed alone on one thread here, summed over the replicas and spread over
this machine's cores: a round is compared with "raw copy of the encoded bytes + that floor".

With a WAN shape (``wan.py``) each replica reaches the store through its own shaped link, and
a round is compared with what its link allows: ``(bytes up + bytes down) / link``. With a
straggler, the last replica contributes ``straggler`` seconds after the others every round, and
the requests of the replicas that wait are reported, priced at S3's list prices.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco_anywhere.bench.codecs import codec_of
from diloco_anywhere.bench.store import BENCH_META
from diloco_anywhere.bench.tools.memory import PeakMemory, resident_bytes
from diloco_anywhere.bench.tools.processes import collect, report
from diloco_anywhere.bench.tools.wan import WanShape
from diloco_anywhere.bucket.codecs.codec import reduced_codec
from diloco_anywhere.bucket.format import wire
from diloco_anywhere.bucket.redaction import redact_url
from diloco_anywhere.bucket.stats import StoreStats
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.phases import PHASES
from diloco_anywhere.collective.policy import CollectiveConfig, RoundPolicy

MODES = ("gather", "sharded", "auto")
# S3 Standard request prices, us-east-1 (aws.amazon.com/s3/pricing, 2026): USD per 1,000.
S3_PUT_LIST_PER_1000 = 0.005  # PUT, COPY, POST, LIST
S3_GET_PER_1000 = 0.0004  # GET and all other requests (DELETE is free; counted here as GET)


@dataclass(frozen=True)
class SyncBench:
    """One ``diloco bench sync`` configuration."""

    replicas: int
    size: int  # bytes of float32 pseudo-gradient per replica
    rounds: int = 3
    codec: str = "fp32"
    mode: str = "auto"
    window: int = RoundPolicy.window
    part_bytes: int = 4 * RoundPolicy.part_elements
    straggler: float = 0.0  # seconds the last replica is late every round
    wan: WanShape | None = None
    device: str = "cpu"  # where each replica's pseudo-gradient is: "cuda" syncs from GPU tensors
    window_max: int = RoundPolicy.window_max  # the window widens up to this (= window: fixed)

    def policy(self) -> RoundPolicy:
        return RoundPolicy(
            min_replicas=self.replicas,
            grace=3600.0,
            timeout=3600.0,
            mode=self.mode,  # type: ignore[arg-type]
            expected_replicas=self.replicas,
            window=self.window,
            window_max=self.window_max,
            part_elements=max(1, self.part_bytes // 4),
        )


@dataclass(frozen=True)
class RoundMeasure:
    seconds: float
    traffic: StoreStats
    mode: str
    memory_added: int | None
    phases: dict[str, float]  # thread-seconds per phase (``collective/phases.py``)
    window: int  # parts in flight it ran with (``transfers.AdaptiveWindow``)


def _replica(url, options, index, bench: SyncBench, barrier, results) -> None:
    report(results, index, barrier, lambda: _measured_rounds(url, options, index, bench, barrier))


def _measured_rounds(url, options, index, bench: SyncBench, barrier) -> list[RoundMeasure]:
    store = Store(url, storage_options=options)
    # keep_rounds=1: a large benchmark's rounds must fit the store (tmpfs is memory)
    config = CollectiveConfig(codec=codec_of(bench.codec), round=bench.policy(), keep_rounds=1)
    late = bench.straggler if index == bench.replicas - 1 else 0.0
    measured = []
    with BucketCollective(store, f"bench-{bench.replicas}", f"r{index}", config) as collective:
        # one pseudo-gradient, refilled every round
        tensor = torch.empty(bench.size // 4, device=bench.device)
        baseline = None
        for round_ in range(bench.rounds):
            fill_gaussian(tensor, seed=1000 * round_ + index)
            baseline = baseline or resident_bytes()  # with the device's context, if any
            barrier.wait()
            time.sleep(late)
            before, started = store.stats(), time.perf_counter()
            window = collective.window  # this round's, before it widens the next
            with PeakMemory() as peak:
                work = collective.allreduce(tensor, round_=round_)
                work.wait()
            added = None if baseline is None or peak.bytes is None else peak.bytes - baseline
            result = work.result()
            measured.append(
                RoundMeasure(
                    time.perf_counter() - started + late,
                    store.stats() - before,
                    result.seal.mode,
                    added,
                    result.seconds,
                    window,
                )
            )
    return measured


def fill_gaussian(tensor: torch.Tensor, seed: int) -> None:
    """Standard normal values drawn straight into ``tensor`` where it is: no float64
    temporaries 3x its size on the host, no host copy of a GPU tensor."""
    if tensor.device.type == "cpu":
        np.random.default_rng(seed).standard_normal(dtype=np.float32, out=tensor.numpy())
    else:
        tensor.normal_(generator=torch.Generator(tensor.device).manual_seed(seed))


def _run_replicas(url, options: list[dict[str, Any]], bench: SyncBench, progress) -> list:
    """Per replica (in index order), its ``RoundMeasure`` of every round."""
    context = multiprocessing.get_context("spawn")  # measured from a fresh start: processes.py
    barrier, results = context.Barrier(bench.replicas), context.Queue()
    processes = [
        context.Process(target=_replica, args=(url, options[i], i, bench, barrier, results))
        for i in range(bench.replicas)
    ]
    for process in processes:
        process.start()
    outcomes = collect(
        processes,
        results,
        lambda index: f"replica r{index}",
        lambda done: progress(f"{bench.replicas} replicas x {bench.rounds} rounds: {done}"),
    )
    return [outcomes[i] for i in range(bench.replicas)]


def _raw_copy_seconds(
    replicas: int, up: int, down: int, part: int, window: int, near: str | None, copies: int
) -> list[float]:
    """The least that moving the same bytes through this machine's file system costs, once
    per round: every replica writes ``up`` bytes as files of ``part`` bytes, then reads
    ``down`` bytes of the others' files, ``window`` at a time per replica, from and into
    buffers touched beforehand (as the sync's are), with ``readinto`` (no allocation per file).
    ``near``: a local store's folder, so the copy runs on the same file system (a disk's
    writeback, or tmpfs). A copy's files stay until the next copy is done, as a round's stay
    in the store (``keep_rounds=1``): on tmpfs every copy then writes into memory pages the
    machine must hand out afresh, as every round does."""
    threads = replicas * window
    buffers = [bytearray(b"\x01") * part for _ in range(threads)]
    local = threading.local()

    def buffer() -> memoryview:
        if not hasattr(local, "buffer"):
            local.buffer = memoryview(buffers.pop())
        return local.buffer

    def sizes(total: int) -> list[int]:
        return [min(part, total - start) for start in range(0, total, part)]

    def copy(folder: Path, pool: ThreadPoolExecutor) -> float:
        def write(item: tuple[tuple[int, int], int]) -> None:
            ((i, k), size) = item
            with open(folder / f"{i}-{k}", "wb") as file:
                file.write(buffer()[:size])

        def read(item: tuple[int, int]) -> None:
            with open(folder / f"{item[0]}-{item[1]}", "rb") as file:
                file.readinto(buffer())

        started = time.perf_counter()
        writes = [((i, k), size) for i in range(replicas) for k, size in enumerate(sizes(up))]
        list(pool.map(write, writes))
        count = len(sizes(down))
        reads = [((i + 1 + k // len(sizes(up))) % replicas, k % len(sizes(up)))
                 for i in range(replicas) for k in range(count)]  # fmt: skip
        list(pool.map(read, reads))
        return time.perf_counter() - started

    seconds = []
    with ThreadPoolExecutor(threads) as pool:
        kept: list[tempfile.TemporaryDirectory[str]] = []
        for _ in range(copies):
            kept.append(tempfile.TemporaryDirectory(dir=near))
            seconds.append(copy(Path(kept[-1].name), pool))
            if len(kept) > 1:
                kept.pop(0).cleanup()
        for folder in kept:
            folder.cleanup()
    return seconds


def _raw_store_copy_seconds(
    url: str, options: list[dict[str, Any]], up: int, down: int, part: int, window: int
) -> float:
    """With a WAN: the same bytes moved through the same links with the store client alone
    (plain puts, then gets; no protocol, no codec), every replica through its own link,
    ``window`` requests at a time: what the stand-in, the shaper and the client allow. Gets
    start once every replica's puts are done, as a round's reads wait for its SEAL."""
    stores = [Store(url, storage_options=option) for option in options]
    payload = b"\x01" * part
    uploaded = threading.Barrier(len(stores))  # a replica reads once every upload is in

    def parts(total: int) -> range:
        return range(-(-total // part))

    def replica(index: int) -> None:
        store, prefix = stores[index], f"raw-copy/{index}"
        with ThreadPoolExecutor(window) as pool:
            try:
                list(pool.map(lambda k: store.put(f"{prefix}/{k}", payload), parts(up)))
            except BaseException:
                uploaded.abort()  # the others stop waiting; this error surfaces
                raise
            uploaded.wait()
            others = [f"raw-copy/{(index + 1) % len(stores)}/{k % len(parts(up))}"
                      for k in parts(down)]  # fmt: skip
            list(pool.map(store.get, others))

    started = time.perf_counter()
    with ThreadPoolExecutor(len(stores)) as replicas:
        list(replicas.map(replica, range(len(stores))))
    seconds = time.perf_counter() - started
    stores[0].delete_prefix("raw-copy")
    return seconds


def _local_folder(url: str) -> str | None:
    """The folder that holds a local store's folder (None for a bucket)."""
    path = Path(url.removeprefix("file://"))
    return (
        str(path.parent)
        if "://" not in url.removeprefix("file://") and path.parent.is_dir()
        else None
    )


def _codec_seconds(numel: int, spec: str, device: str) -> tuple[float, float]:
    """(encode, decode) seconds of the whole payload, each alone, on one thread here: encoded
    from ``device`` and decoded onto it, as a round does (it reduces where the tensors are)."""
    codec = codec_of(spec)
    tensor = torch.empty(numel, device=device)
    fill_gaussian(tensor, seed=0)
    torch.set_num_threads(1)  # as a round's threads run
    # into a buffer touched before, as the sync's pooled buffers are
    buffer = memoryview(bytearray(b"\x01") * wire.max_object_nbytes(codec, numel))
    started = time.perf_counter()
    encoded = wire.encode(tensor, codec, BENCH_META, into=buffer)
    encoded_at = time.perf_counter()
    for _ in wire.WireReader(encoded).chunks(torch.device(device)):
        pass  # checked and decoded chunk by chunk into temporaries, as a round reduces them
    if device == "cuda":
        torch.cuda.synchronize()
    return encoded_at - started, time.perf_counter() - encoded_at


def codec_passes(mode: str, replicas: int) -> tuple[float, float]:
    """(encodes, decodes) of the whole payload that one replica's round needs. Sharded: its
    contribution, its own parts again for the shards it reduces (``parts.py``), its reduced
    shards; it decodes the parts it reduces (all contributors' 1/n) and every reduced shard.
    Gather: its contribution and its own parts again; every contribution decoded."""
    n = replicas
    if mode == "sharded":
        return 1 + 2 / n, 2.0
    return 2.0, float(n)


def traffic_bound(
    mode: str, replicas: int, payload: int, reduced: int | None = None
) -> tuple[float, float]:
    """(up, down) bytes per replica per round that the mode cannot go below, for
    contributions of ``payload`` bytes whose reduced result takes ``reduced`` (``payload``
    but for a sparse codec, whose reduced shards are int8)."""
    n, reduced = replicas, payload if reduced is None else reduced
    if mode == "sharded":
        return payload + reduced / n, (payload + reduced) * (n - 1) / n
    return payload, payload * (n - 1)


def _requests(traffic: StoreStats) -> dict[str, int]:
    return {"puts": traffic.puts, "gets": traffic.gets, "lists": traffic.lists}


def request_cost(requests: dict[str, int], rounds: int = 1000) -> float:
    """USD that ``rounds`` rounds of ``requests`` (per round) cost at S3's list prices."""
    put_list = (requests["puts"] + requests["lists"]) * S3_PUT_LIST_PER_1000 / 1000
    return rounds * (put_list + requests["gets"] * S3_GET_PER_1000 / 1000)


def _median_requests(rows: list[RoundMeasure]) -> dict[str, int]:
    return {
        kind: int(statistics.median(_requests(row.traffic)[kind] for row in rows))
        for kind in ("puts", "gets", "lists")
    }


def phase_split(rows: list[RoundMeasure]) -> dict[str, float]:
    """The median thread-seconds of each phase over ``rows`` (``collective/phases.py``)."""
    return {
        phase: statistics.median(row.phases.get(phase, 0.0) for row in rows) for phase in PHASES
    }


def bench_sync(url: str, options: list[dict[str, Any]], bench: SyncBench, progress) -> dict:
    """Medians over rounds (and replicas) of traffic and wall time per round; ``options``
    are each replica's storage options (its own shaped link, with a WAN)."""
    outcomes = _run_replicas(url, options, bench, progress)
    waiting = outcomes[:-1] if bench.straggler and bench.replicas > 1 else outcomes
    rows = [row for measured in waiting for row in measured]
    up = int(statistics.median(row.traffic.bytes_up for row in rows))
    down = int(statistics.median(row.traffic.bytes_down for row in rows))
    rounds = range(bench.rounds)
    round_seconds = statistics.median(max(m[r].seconds for m in outcomes) for r in rounds)
    progress("raw parallel copy of the same bytes")
    if bench.wan is not None:
        raw_each = [
            _raw_store_copy_seconds(url, options, up, down, bench.part_bytes, bench.window)
            for _ in rounds
        ]
    else:
        near = _local_folder(url)
        raw_each = _raw_copy_seconds(
            bench.replicas, up, down, bench.part_bytes, bench.window, near, bench.rounds
        )
    raw = statistics.median(raw_each)
    sealed_mode = statistics.mode(row.mode for row in rows)
    encode, decode = _codec_seconds(bench.size // 4, bench.codec, bench.device)
    encodes, decodes = codec_passes(sealed_mode, bench.replicas)
    # the codec work of one round, every replica's, spread over this machine's cores
    codec_floor = bench.replicas * (encodes * encode + decodes * decode) / (os.cpu_count() or 1)
    added = [row.memory_added for m in outcomes for row in m if row.memory_added is not None]
    codec = codec_of(bench.codec)
    payload = codec.payload_nbytes(bench.size // 4)
    reduced = reduced_codec(codec).payload_nbytes(bench.size // 4)
    bound_up, bound_down = traffic_bound(sealed_mode, bench.replicas, payload, reduced)
    requests = _median_requests(rows)
    result = {
        "url": redact_url(url),
        "mode": sealed_mode,
        "codec": bench.codec,
        "device": bench.device,
        "replicas": bench.replicas,
        "size_bytes": bench.size,
        "payload_bytes": payload,
        "rounds": bench.rounds,
        "window": bench.window,
        "part_bytes": bench.part_bytes,
        "bytes_up_per_replica": up,
        "bytes_down_per_replica": down,
        "bound_up_per_replica": int(bound_up),
        "bound_down_per_replica": int(bound_down),
        "up_vs_bound": up / bound_up,
        "down_vs_bound": down / bound_down if bound_down else float("nan"),
        "requests_per_replica": sum(requests.values()),
        "requests_by_kind_per_replica": requests,
        "s3_request_usd_per_1000_rounds_per_replica": request_cost(requests),
        "round_seconds": round_seconds,
        "round_seconds_each": [max(m[r].seconds for m in outcomes) for r in rounds],
        "window_each": [outcomes[0][r].window for r in rounds],  # replica 0's, round by round
        # thread-seconds per phase of a replica's round (medians; they overlap: phases.py)
        "phase_seconds": phase_split(rows),
        "phase_seconds_each": [
            max((m[r] for m in outcomes), key=lambda row: row.seconds).phases for r in rounds
        ],
        "raw_copy_seconds": raw,
        "raw_copy_seconds_each": raw_each,
        "round_vs_raw": round_seconds / raw if raw else float("inf"),
        "encode_seconds": encode,
        "decode_seconds": decode,
        "codec_passes_per_replica": {"encodes": encodes, "decodes": decodes},
        "codec_floor_seconds": codec_floor,
        "round_vs_raw_plus_codec": round_seconds / (raw + codec_floor),
        # the peak a sync added to a replica process's resident memory: worst over replicas
        # and rounds, and over the fp32 pseudo-gradient (``size``)
        "host_memory_added_bytes": max(added) if added else None,
        "host_memory_added_vs_fp32": max(added) / bench.size if added else None,
        "up_vs_payload": up / bench.size,
        "down_vs_payload": down / bench.size,
        "straggler_seconds": bench.straggler,
    }
    if bench.wan is not None:
        link_seconds = (up + down) / bench.wan.link
        result["wan"] = asdict(bench.wan)
        result["link_bound_seconds"] = link_seconds
        result["round_vs_link_bound"] = round_seconds / link_seconds
    return result

"""Check 3: what a sync from device tensors costs the host. Two replica processes each hold a
pseudo-gradient on the device (4 GiB of float32 on a GPU: a 1B-parameter model) and all-reduce
it with int8 through a local store in memory (/dev/shm where it has room), as ``diloco bench
sync`` measures on the CPU (``bench/sync.py``): each replica's host memory added by a sync
(target at most half the float32 pseudo-gradient: the round streams parts through a window of
pinned buffers, never a whole copy), the round's time beside a raw copy of the same bytes
(target at most ``ROUND_TARGET`` times it: the parts are decoded and averaged on the GPU) and
where the round's time goes. It also requires that replicas whose tensors are on the device
reach the very bits that replicas on the CPU reach from the same values, in both exchanges
(``device_mean``: the reduction is the same IEEE operations in the same order anywhere)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import uuid
from pathlib import Path

import torch

from diloco_anywhere.bench.gpu.outcome import Judge, Outcome
from diloco_anywhere.bench.gpu.plan import Sizes
from diloco_anywhere.bench.store import sample_tensor
from diloco_anywhere.bench.sync import SyncBench, bench_sync
from diloco_anywhere.bucket.codecs.codec import make_codec
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.allreduce import BucketCollective
from diloco_anywhere.collective.policy import CollectiveConfig, RoundPolicy

log = logging.getLogger(__name__)
MEMORY_TARGET = 0.5  # host memory a sync adds, over the float32 pseudo-gradient
ROUND_TARGET = 2.0  # a round's time, over a raw copy of the same bytes (issue 53)
SHARED_MEMORY = Path("/dev/shm")
AGREEMENT_REPLICAS = 3  # weights 1, 2, 3: unequal shares, a chain of two adds per element
AGREEMENT_NUMEL = 300_000  # several parts per shard owner, the last one short


def device_mean(device: torch.device, mode: str) -> torch.Tensor:
    """The mean (on the host) that ``AGREEMENT_REPLICAS`` replicas, threads of this process
    with their tensors on ``device``, reach through a store in memory with int8 in ``mode``:
    the same Student-t values whatever the device."""
    policy = RoundPolicy(
        min_replicas=AGREEMENT_REPLICAS, expected_replicas=AGREEMENT_REPLICAS, grace=600.0,
        timeout=600.0, mode=mode, part_elements=1 << 14,  # type: ignore[arg-type]
    )  # fmt: skip
    config = CollectiveConfig(codec=make_codec("int8"), round=policy)
    store = Store(f"memory://device-mean-{uuid.uuid4().hex}")
    tensors = [
        sample_tensor("student_t", AGREEMENT_NUMEL, seed=i).to(device)
        for i in range(AGREEMENT_REPLICAS)
    ]
    errors: list[BaseException] = []

    def replica(index: int) -> None:
        try:
            with BucketCollective(store, "agreement", f"r{index}", config) as collective:
                collective.allreduce(tensors[index], round_=0, weight=index + 1.0).wait()
        except BaseException as exc:  # raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(AGREEMENT_REPLICAS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return agreed_mean([tensor.cpu() for tensor in tensors], f"replicas on {device}, {mode}")


def agreed_mean(means: list[torch.Tensor], who: str) -> torch.Tensor:
    """The one mean every replica holds after a round; ``AssertionError`` naming ``who`` if
    any bit differs (the round's result is the same bytes on every replica)."""
    if not all(torch.equal(mean, means[0]) for mean in means):
        raise AssertionError(f"{who}: the replicas' means differ")
    return means[0]


def disagreements(device: torch.device) -> list[str]:
    """The exchanges whose mean on ``device`` differs in any bit from the CPU's."""
    cpu = torch.device("cpu")
    return [
        mode
        for mode in ("gather", "sharded")
        if not torch.equal(device_mean(device, mode), device_mean(cpu, mode))
    ]


def store_parent(device: torch.device, size: int, work: Path) -> Path:
    """/dev/shm for a GPU's sizes when it has room for a few rounds of them (tmpfs: the
    store's own speed drops out), else the check's own folder."""
    roomy = SHARED_MEMORY.is_dir() and shutil.disk_usage(SHARED_MEMORY).free > 3 * size
    return SHARED_MEMORY if device.type == "cuda" and roomy else work


def check(device: torch.device, sizes: Sizes, work: Path) -> Outcome:
    bench = SyncBench(
        replicas=2, size=sizes.sync_bytes, rounds=sizes.sync_rounds, codec="int8",
        device=device.type,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(dir=store_parent(device, sizes.sync_bytes, work)) as folder:
        log.info("store in %s", folder)
        result = bench_sync(f"{folder}/store", [{}, {}], bench, log.info)
    memory = result["host_memory_added_vs_fp32"]
    judge = Judge(device)
    judge.require(memory is not None, "host memory read (/proc/self/statm)")
    judge.target(
        memory is not None and memory <= MEMORY_TARGET,
        f"a sync adds at most {MEMORY_TARGET} x the float32 pseudo-gradient to host memory: "
        f"{memory}",
    )
    judge.target(
        result["round_vs_raw"] <= ROUND_TARGET,
        f"a round takes at most {ROUND_TARGET} x a raw copy of its bytes: "
        f"{result['round_vs_raw']:.2f}",
    )
    differ = disagreements(device)
    judge.require(
        not differ, f"means reduced on {device.type} equal the CPU's bit for bit; differ: {differ}"
    )
    keys = ("mode", "round_seconds", "round_seconds_each", "raw_copy_seconds", "round_vs_raw",
            "encode_seconds", "decode_seconds", "phase_seconds", "host_memory_added_bytes",
            "host_memory_added_vs_fp32", "bytes_up_per_replica", "bytes_down_per_replica",
            "url")  # fmt: skip
    numbers = {"gib": sizes.sync_bytes / 2**30, **{key: result[key] for key in keys}}
    added = "n/a" if memory is None else f"{result['host_memory_added_bytes'] / 2**20:,.0f} MiB"
    split = ", ".join(
        f"{phase} {seconds:.2f}" for phase, seconds in result["phase_seconds"].items()
    )
    summary = (
        f"{sizes.sync_bytes / 2**30:g} GiB from {device.type} tensors, {result['mode']}: round "
        f"{result['round_seconds']:.2f} s (raw copy {result['raw_copy_seconds']:.2f} s, "
        f"{result['round_vs_raw']:.2f}x; thread-s: {split}), host memory added {added} "
        f"({memory if memory is None else round(memory, 3)}x fp32), bits equal to the CPU's "
        f"in {2 - len(differ)} of 2 exchanges"
    )
    return judge.outcome(summary, numbers)

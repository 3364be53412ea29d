"""Check 3: what a sync from device tensors costs the host. Two replica processes each hold a
pseudo-gradient on the device (4 GiB of float32 on a GPU: a 1B-parameter model) and all-reduce
it with int8 through a local store in memory (/dev/shm where it has room), as ``diloco bench
sync`` measures on the CPU (``bench/sync.py``): each replica's host memory added by a sync
(target at most half the float32 pseudo-gradient: the round streams parts through a window of
pinned buffers, never a whole copy), and the round's time beside a raw copy of the same
bytes."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import torch

from diloco_anywhere.bench.gpu.outcome import Judge, Outcome
from diloco_anywhere.bench.gpu.plan import Sizes
from diloco_anywhere.bench.sync import SyncBench, bench_sync

log = logging.getLogger(__name__)
MEMORY_TARGET = 0.5  # host memory a sync adds, over the float32 pseudo-gradient
SHARED_MEMORY = Path("/dev/shm")


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
    keys = ("mode", "round_seconds", "round_seconds_each", "raw_copy_seconds", "round_vs_raw",
            "encode_seconds", "decode_seconds", "host_memory_added_bytes",
            "host_memory_added_vs_fp32", "bytes_up_per_replica", "bytes_down_per_replica",
            "url")  # fmt: skip
    numbers = {"gib": sizes.sync_bytes / 2**30, **{key: result[key] for key in keys}}
    added = "n/a" if memory is None else f"{result['host_memory_added_bytes'] / 2**20:,.0f} MiB"
    summary = (
        f"{sizes.sync_bytes / 2**30:g} GiB from {device.type} tensors, {result['mode']}: round "
        f"{result['round_seconds']:.2f} s (raw copy {result['raw_copy_seconds']:.2f} s), host "
        f"memory added {added} ({memory if memory is None else round(memory, 3)}x fp32)"
    )
    return judge.outcome(summary, numbers)

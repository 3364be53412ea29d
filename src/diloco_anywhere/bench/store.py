"""``diloco bench store``: store throughput beside a raw file copy, and codec speed, size, error.

Store: P bytes split into k objects are written with create-only puts (k concurrent requests),
then read back with one ``get_many``. In the same run, the same k chunks are written to and read
from local files with plain ``open``/``write``/``read`` on the same number of threads: the ratio
says what the store layer costs over the disk (local store) or what the network path costs
(remote store). Medians over repeats.

Codecs: encode and decode speed of the whole wire path (header, checksum, payload), size relative
to raw float32, and relative L2 error on Gaussian and Student-t(3) tensors (heavy tails are what
break per-tensor scales; Student-t(3) stands in for real pseudo-gradients).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco_anywhere.bucket.codecs.codec import Codec, make_codec
from diloco_anywhere.bucket.format import wire
from diloco_anywhere.bucket.store import Store

MiB = 1 << 20
BENCH_META = wire.ObjectMeta(run="bench", round=0, replica="bench", incarnation=0, shard=0)
BENCH_CODECS: dict[str, Codec] = {
    "fp32": make_codec("fp32"),
    "bf16": make_codec("bf16"),
    "int8": make_codec("int8", block=64),
    "sparse": make_codec("sparse"),  # 8% of each 4,096 at 2 bits (its error feedback aside)
}
Progress = Callable[[str], None]


def sample_tensor(kind: str, numel: int, seed: int = 0) -> torch.Tensor:
    """Gaussian or Student-t(3) float32 values, drawn by numpy.

    The tests compare these bit for bit across processes. torch's CPU kernels did not give
    that: a fresh process on a loaded machine computed other values for part of a tensor
    (the split fell where two intra-op threads would divide it). numpy's generator and math
    run in one thread, in one way."""
    generator = np.random.default_rng(seed)
    if kind == "gaussian":
        values = generator.standard_normal(numel)
    elif kind == "student_t":
        values = generator.standard_t(3, numel)
    else:
        raise ValueError(f"unknown sample kind {kind!r}; choose gaussian or student_t")
    return torch.from_numpy(values.astype(np.float32))


def _timed(operation: Callable[[], object]) -> float:
    start = time.perf_counter()
    operation()
    return time.perf_counter() - start


def _rate(size: int, seconds: float) -> float:
    return size / MiB / seconds if seconds > 0 else float("inf")


def _store_round(store: Store, prefix: str, chunks: Sequence[bytes], pool) -> tuple[float, float]:
    keys = [f"{prefix}/{i}" for i in range(len(chunks))]
    put_seconds = _timed(lambda: list(pool.map(store.put, keys, chunks)))
    got: dict[str, bytes | None] = {}
    get_seconds = _timed(lambda: got.update(store.get_many(keys, limit=max(map(len, chunks)) + 1)))
    if [got[k] for k in keys] != list(chunks):
        raise RuntimeError(f"store {store.url} returned different bytes than were written")
    store.delete_prefix(prefix)
    return put_seconds, get_seconds


def _raw_round(folder: Path, chunks: Sequence[bytes], pool) -> tuple[float, float]:
    paths = [folder / f"{i}" for i in range(len(chunks))]
    put_seconds = _timed(lambda: list(pool.map(Path.write_bytes, paths, chunks)))
    get_seconds = _timed(lambda: list(pool.map(Path.read_bytes, paths)))
    for path in paths:
        path.unlink()
    return put_seconds, get_seconds


def _throughput(size: int, rounds: list[tuple[float, float]]) -> dict[str, float]:
    put = statistics.median(r[0] for r in rounds)
    get = statistics.median(r[1] for r in rounds)
    return {"put_seconds": put, "get_seconds": get, "put_mib_s": _rate(size, put),
            "get_mib_s": _rate(size, get)}  # fmt: skip


def bench_store(
    store: Store, size: int, objects: int, repeats: int, progress: Progress
) -> dict[str, Any]:
    """Put/get throughput of ``size`` bytes in ``objects`` objects, and of a raw file copy."""
    chunk = max(1, size // objects)
    chunks = [os.urandom(chunk) for _ in range(objects)]
    total = chunk * objects
    prefix = f"bench-{uuid.uuid4().hex[:12]}"
    with ThreadPoolExecutor(min(objects, 32)) as pool, tempfile.TemporaryDirectory() as folder:
        store_rounds, raw_rounds = [], []
        for repeat in range(repeats):
            progress(f"store round {repeat + 1}/{repeats}")
            before = store.stats()
            store_rounds.append(_store_round(store, f"{prefix}/{repeat}", chunks, pool))
            requests = store.stats() - before
            progress(f"raw copy round {repeat + 1}/{repeats}")
            raw_rounds.append(_raw_round(Path(folder), chunks, pool))
        store.delete_prefix(prefix)
    measured, raw = _throughput(total, store_rounds), _throughput(total, raw_rounds)
    return {
        "url": store.url,
        "size_bytes": total,
        "objects": objects,
        "repeats": repeats,
        **measured,
        "raw_copy": raw,
        "put_vs_raw": measured["put_seconds"] / raw["put_seconds"],
        "get_vs_raw": measured["get_seconds"] / raw["get_seconds"],
        "requests_per_round": asdict(requests),
    }


def _relative_l2(codec: Codec, tensor: torch.Tensor) -> float:
    decoded = wire.decode(wire.encode(tensor, codec, BENCH_META)).tensor
    return float((decoded - tensor).norm() / tensor.norm())


def bench_codecs(numel: int, repeats: int, progress: Progress) -> dict[str, dict[str, float]]:
    """Speed, size ratio and error of each codec on ``numel`` float32 values."""
    gaussian = sample_tensor("gaussian", numel, seed=1)
    student_t = sample_tensor("student_t", numel, seed=2)
    raw_bytes = 4 * numel
    results = {}
    for name, codec in BENCH_CODECS.items():
        progress(f"codec {name}")
        encoded = wire.encode(gaussian, codec, BENCH_META)
        encode = statistics.median(
            _timed(lambda c=codec: wire.encode(gaussian, c, BENCH_META)) for _ in range(repeats)
        )
        decode = statistics.median(_timed(lambda e=encoded: wire.decode(e)) for _ in range(repeats))
        results[name] = {
            "ratio": len(encoded) / raw_bytes,
            "rel_l2_gaussian": _relative_l2(codec, gaussian),
            "rel_l2_student_t": _relative_l2(codec, student_t),
            "encode_gib_s": raw_bytes / encode / 1024**3,
            "decode_gib_s": raw_bytes / decode / 1024**3,
        }
    return results

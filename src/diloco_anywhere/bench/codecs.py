"""``diloco bench codecs``: what each codec costs per GiB of pseudo-gradient, in one run.

For each codec, in a fresh process of its own (so that one codec's freed memory does not hide
the next one's): the whole wire path's encode and decode of ``size`` bytes of float32
(header, CRC32C, finiteness checks, the codec), the error feedback's ``applied`` on the same
values (the encode and decode a sync adds for a sparse codec, ``bucket/feedback.py``), each the
median of ``repeats``; the peak resident memory each adds over the tensor it starts from
(decoding's includes its float32 result, ``size`` bytes); the bytes over fp32; and the relative
L2 error on Gaussian and Student-t(3) values. Every codec is also reported over int8's times
measured in the same run, since the machine is shared and timings drift between runs.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from typing import Any

import numpy as np
import torch

from diloco_anywhere.bench.store import BENCH_META, Progress, sample_tensor
from diloco_anywhere.bench.tools.memory import PeakMemory, resident_bytes
from diloco_anywhere.bench.train import results_of
from diloco_anywhere.bucket.codecs.codec import Codec, make_codec
from diloco_anywhere.bucket.feedback import ErrorFeedback
from diloco_anywhere.bucket.format import wire
from diloco_anywhere.config import DilocoSection, describe_codec, parse_codec

REFERENCE = "int8"  # what the others are compared with


def codec_of(spec: str) -> Codec:
    """The codec a ``--codec`` spec names (``config.parse_codec``)."""
    name, sparse = parse_codec(spec)
    return make_codec(name, **DilocoSection(codec=name, sparse=sparse).codec_params())


def _added(operation: Any) -> tuple[float, int | None, Any]:
    """(seconds, peak resident bytes added, result) of ``operation()``."""
    before = resident_bytes()
    with PeakMemory() as peak:
        started = time.perf_counter()
        result = operation()
        seconds = time.perf_counter() - started
    added = None if before is None or peak.bytes is None else peak.bytes - before
    return seconds, added, result


def _relative_l2(codec: Codec, kind: str, numel: int) -> float:
    tensor = sample_tensor(kind, numel, seed=2)
    decoded = wire.decode(wire.encode(tensor, codec, BENCH_META)).tensor
    return float((decoded - tensor).norm() / tensor.norm())


def _measure(spec: str, numel: int, repeats: int, results: Any) -> None:
    """One codec, in its own process; puts its row on ``results``."""
    codec = codec_of(spec)
    tensor = torch.empty(numel)
    np.random.default_rng(1).standard_normal(dtype=np.float32, out=tensor.numpy())
    encodes, decodes, feedback_seconds = [], [], []
    memory: dict[str, list[int]] = {"encode": [], "decode": []}
    encoded: Any = None
    for _ in range(repeats):
        encoded = None  # freed before the next encode is measured
        seconds, added, encoded = _added(lambda: wire.encode(tensor, codec, BENCH_META))
        encodes.append(seconds)
        memory["encode"].append(added)
        seconds, added, _ = _added(lambda e=encoded: wire.decode(e))
        decodes.append(seconds)
        memory["decode"].append(added)
    feedback = ErrorFeedback(0.95)
    for _ in range(repeats):
        feedback.compensate(0, [tensor])
        started = time.perf_counter()
        feedback.applied(0, codec)
        feedback_seconds.append(time.perf_counter() - started)
    gib = 4 * numel / 2**30
    results.put({
        "codec": spec,
        "label": describe_codec(*parse_codec(spec)),
        "ratio": len(encoded) / (4 * numel),
        "encode_seconds_per_gib": statistics.median(encodes) / gib,
        "decode_seconds_per_gib": statistics.median(decodes) / gib,
        "feedback_seconds_per_gib": statistics.median(feedback_seconds) / gib,
        "encode_memory_added_per_gib": _worst(memory["encode"], gib),
        "decode_memory_added_per_gib": _worst(memory["decode"], gib),
        "rel_l2_gaussian": _relative_l2(codec, "gaussian", 1 << 20),
        "rel_l2_student_t": _relative_l2(codec, "student_t", 1 << 20),
    })  # fmt: skip


def _worst(values: list[int | None], gib: float) -> float | None:
    known = [value for value in values if value is not None]
    return max(known) / gib if known else None


def bench_codecs_per_gib(
    specs: list[str], size: int, repeats: int, progress: Progress
) -> dict[str, Any]:
    """Every codec of ``specs`` (int8 added as the reference) on ``size`` bytes of float32."""
    specs = [*dict.fromkeys([REFERENCE, *specs])]
    for spec in specs:
        codec_of(spec)  # every spec checked before any process starts
    # spawned, not forked from a server: a memory figure must not include faulting in the
    # library pages a forkserver's worker starts without (``processes.py``)
    context, rows = multiprocessing.get_context("spawn"), []
    for spec in specs:
        progress(f"codec {spec}: {size / 2**30:.2f} GiB, {repeats} repeats")
        results = context.Queue()
        process = context.Process(target=_measure, args=(spec, size // 4, repeats, results))
        rows += results_of([process], results)
    reference = rows[0]
    both = reference["encode_seconds_per_gib"] + reference["decode_seconds_per_gib"]
    for row in rows:
        row["encode_plus_decode_vs_int8"] = (
            row["encode_seconds_per_gib"] + row["decode_seconds_per_gib"]
        ) / both
    return {"size_bytes": size, "repeats": repeats, "codecs": rows}

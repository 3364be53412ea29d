"""Check 2: the codecs on device tensors. A Gaussian pseudo-gradient held on the device is
encoded there into pinned host memory (as a round's parts are: ``collective/transfers.py``)
and decoded onto the device, each timed alone (GB/s of float32, the median of the repeats
after one that warms the kernels up). The device's bytes are compared with the host's for the
same values: int8's must be equal; the sparse codec's must decode to the host's within 1e-3
(relative L2: a kept position chosen differently at a tie) and keep as much of the values.
The sparse codec's error feedback (``bucket/feedback.py``) runs on the device too."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from diloco_anywhere.bench.codecs import codec_of
from diloco_anywhere.bench.gpu.outcome import Judge, Outcome
from diloco_anywhere.bench.gpu.plan import Sizes
from diloco_anywhere.bench.store import BENCH_META
from diloco_anywhere.bench.sync import fill_gaussian
from diloco_anywhere.bucket.feedback import ErrorFeedback
from diloco_anywhere.bucket.format import wire

CODECS = ("int8", "sparse")
SPARSE_AGREEMENT = 1e-3  # relative L2 between the device's and the host's decoded values
T = TypeVar("T")


def timed(device: torch.device, operation: Callable[[], T]) -> tuple[float, T]:
    """Seconds of ``operation`` with the device's queued work done at both ends."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = operation()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started, result


def relative_l2(values: torch.Tensor, reference: torch.Tensor) -> float:
    return float((values - reference).norm() / reference.norm())


def same_bytes(a: memoryview | bytearray, b: memoryview | bytearray) -> bool:
    return len(a) == len(b) and torch.equal(
        torch.frombuffer(a, dtype=torch.uint8), torch.frombuffer(b, dtype=torch.uint8)
    )


def _codec_numbers(
    spec: str, values: torch.Tensor, host_values: torch.Tensor, repeats: int
) -> dict[str, Any]:
    device, numel = values.device, values.numel()
    codec = codec_of(spec)
    pinned = torch.empty(
        wire.max_object_nbytes(codec, numel), dtype=torch.uint8,
        pin_memory=device.type == "cuda",
    )  # fmt: skip
    into = memoryview(pinned.numpy())
    encodes, decodes, encoded, decoded = [], [], memoryview(b""), values
    for _ in range(repeats + 1):  # the first warms the kernels up: not counted
        seconds, encoded = timed(device, lambda: wire.encode(values, codec, BENCH_META, into=into))
        encodes.append(seconds)
        seconds, decoded = timed(device, lambda e=encoded: wire.decode(e, device=device).tensor)
        decodes.append(seconds)
    host_seconds, host_encoded = timed(host_values.device, lambda: wire.encode(
        host_values, codec, BENCH_META))  # fmt: skip
    from_device, from_host = wire.decode(encoded).tensor, wire.decode(host_encoded).tensor
    gigabytes = 4 * numel / 1e9
    return {
        "encode_gb_per_second": gigabytes / statistics.median(encodes[1:]),
        "decode_gb_per_second": gigabytes / statistics.median(decodes[1:]),
        "host_encode_gb_per_second": gigabytes / host_seconds,
        "bytes_vs_fp32": len(encoded) / (4 * numel),
        "bytes_equal_to_host": same_bytes(encoded, host_encoded),
        "decoded_vs_host": relative_l2(from_device, from_host),
        "device_decode_vs_host_decode": relative_l2(decoded.cpu(), from_device),
        "error_vs_input": relative_l2(from_device, host_values),
        "host_error_vs_input": relative_l2(from_host, host_values),
    }


def _feedback_numbers(values: torch.Tensor) -> dict[str, Any]:
    """One sparse sync's error feedback on the device: its time, and whether what it keeps
    is exactly what the codec left out."""
    codec, feedback = codec_of("sparse"), ErrorFeedback(0.95)
    feedback.compensate(0, [values])
    seconds, _ = timed(values.device, lambda: feedback.applied(0, codec))
    sent = wire.decode(wire.encode(values, codec, BENCH_META), device=values.device).tensor
    residual = feedback.residual(0)
    return {
        "feedback_seconds_per_gib": seconds / (4 * values.numel() / 2**30),
        "feedback_residual_exact": residual is not None and torch.equal(residual, values - sent),
        "feedback_residual_device": str(None if residual is None else residual.device),
    }


def check(device: torch.device, sizes: Sizes, work: Path) -> Outcome:
    values = torch.empty(sizes.codec_bytes // 4, device=device)
    fill_gaussian(values, seed=3)
    host_values = values.cpu()
    rows = {spec: _codec_numbers(spec, values, host_values, sizes.codec_repeats) for spec in CODECS}
    feedback = _feedback_numbers(values)
    judge = Judge(device)
    judge.require(
        rows["int8"]["bytes_equal_to_host"], "int8's bytes from the device equal the host's"
    )
    sparse = rows["sparse"]
    judge.require(
        sparse["decoded_vs_host"] <= SPARSE_AGREEMENT,
        f"sparse from the device decodes to the host's within {SPARSE_AGREEMENT} relative L2: "
        f"{sparse['decoded_vs_host']:.2e}",
    )
    judge.require(
        sparse["error_vs_input"] <= 1.01 * sparse["host_error_vs_input"],
        f"sparse from the device keeps as much as the host's: error "
        f"{sparse['error_vs_input']:.4f} vs {sparse['host_error_vs_input']:.4f}",
    )
    for spec, row in rows.items():
        judge.require(
            row["device_decode_vs_host_decode"] <= 1e-6,
            f"{spec} decoded on the device equals the host's decode of the same bytes: "
            f"{row['device_decode_vs_host_decode']:.2e}",
        )
    judge.require(
        feedback["feedback_residual_exact"]
        and torch.device(feedback["feedback_residual_device"]).type == device.type,
        f"error feedback keeps exactly what the codec left out, on {device}: {feedback}",
    )
    summary = "; ".join(
        f"{spec} encode {row['encode_gb_per_second']:.1f} GB/s (host "
        f"{row['host_encode_gb_per_second']:.1f}), decode {row['decode_gb_per_second']:.1f} GB/s,"
        f" {'same bytes' if row['bytes_equal_to_host'] else 'bytes differ'} as the host's"
        for spec, row in rows.items()
    )
    numbers = {"gib": sizes.codec_bytes / 2**30, **feedback, "codecs": rows}
    return judge.outcome(summary, numbers)

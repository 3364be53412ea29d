"""The reduction: a weighted mean in a fixed order, so every machine computes the same bits."""

from __future__ import annotations

import torch


def weighted_mean(
    contributions: list[tuple[torch.Tensor, float]], out: torch.Tensor | None = None
) -> torch.Tensor:
    """sum(w_i * g_i) * (1 / sum(w_i)) in the given order, each step one IEEE float32 operation
    (a multiply, then an add; no fused multiply-add), so any machine gets the same bits.

    The order is the SEAL's (sorted contributor names). Element-wise, gather and sharded mode
    run the same operations in the same order, so with an exact codec they agree bit for bit.
    ``out`` (e.g. a slice of the whole result) receives the mean instead of a new tensor.
    """
    total = sum(weight for _, weight in contributions)
    accumulator = torch.zeros_like(contributions[0][0]) if out is None else out.zero_()
    scaled = torch.empty_like(accumulator)
    for tensor, weight in contributions:
        torch.mul(tensor, weight, out=scaled)
        accumulator.add_(scaled)
    # Times the reciprocal, not a division: torch may divide by a scalar as a multiplication in
    # its vectorized loop but truly in the scalar tail, and where tails fall follows the thread
    # count, so a division would differ by an ulp between replicas on some elements.
    return accumulator.mul_(1.0 / total)

"""The reduction: a weighted mean in a fixed order, so every machine computes the same bits."""

from __future__ import annotations

import torch

from diloco_anywhere.bucket.codecs.codec import require_finite


class WeightedMean:
    """sum((w_i / sum(w)) * g_i) accumulated into ``out`` one contribution at a time, in the
    order given, each step one IEEE float32 operation (a multiply, then an add; no fused
    multiply-add), so any machine gets the same bits, a CPU or a GPU alike. The sum starts
    from the first term.

    Each contribution is scaled by its share of the total weight (computed in float64, then
    used as a float32 scalar), not by its weight: every share is at most 1, so every partial
    sum is a convex combination of finite values and cannot overflow, whatever the weights
    (a weight of 1e39 is finite in a manifest's float64 and infinite in float32). ``result``
    refuses a non-finite mean all the same: a mean that is not finite is never applied.

    The order is the SEAL's (sorted contributor names). Contributions arrive in chunks
    (``add``), so a reducer holds one accumulator, not N decoded contributions. Element-wise,
    gather and sharded mode run the same operations in the same order, so with an exact codec
    they agree bit for bit, whatever the chunking.
    """

    def __init__(
        self, out: torch.Tensor, total_weight: float, scratch: torch.Tensor | None = None
    ) -> None:
        """``scratch``: room for a scaled chunk on ``out``'s device, reused across shards (one
        is made, and grown, when not given)."""
        self.out = out
        self._flat = out.view(-1)
        self._total = total_weight
        self._scaled = torch.empty(0, device=out.device) if scratch is None else scratch
        self._filled = 0  # elements the first contribution has set so far

    def add(self, start: int, values: torch.Tensor, weight: float) -> None:
        """Add ``(weight / total) * values`` to elements ``[start, start + len(values))``. The
        first contribution's chunks come in order and set the sum (no zeroing pass, no add);
        every later one adds to it."""
        count, share = values.numel(), weight / self._total
        target = self._flat[start : start + count]
        if start >= self._filled:
            torch.mul(values, share, out=target)
            self._filled = start + count
            return
        if self._scaled.numel() < count:
            self._scaled = torch.empty(count, device=self.out.device)
        scaled = self._scaled[:count]
        torch.mul(values, share, out=scaled)
        target.add_(scaled)

    def result(self) -> torch.Tensor:
        """The mean; ``ValueError`` if any element is not finite."""
        require_finite(self.out, "the weighted mean", ValueError)
        return self.out


def weighted_mean(
    contributions: list[tuple[torch.Tensor, float]], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``WeightedMean`` of whole tensors (``out`` receives it when given)."""
    first = contributions[0][0]
    mean = WeightedMean(
        torch.empty_like(first) if out is None else out, sum(w for _, w in contributions)
    )
    for tensor, weight in contributions:
        mean.add(0, tensor.reshape(-1), weight)
    return mean.result()

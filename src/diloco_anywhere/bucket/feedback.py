"""Error feedback: the sender keeps what a lossy codec dropped and sends it in later rounds.

Seide et al. 2014 ("1-bit SGD"), Karimireddy et al. 2019 ("Error Feedback Fixes SignSGD"), and
for DiLoCo's pseudo-gradients SparseLoCo (arXiv 2508.15706, Algorithm 1) and MuLoCo (arXiv
2505.23725, section 3). Per stream (one fragment's pseudo-gradient), round ``t`` sends the
codec's version of ``e_t = decay * e_{t-1} + x_t`` and keeps ``e_t - decode(encode(e_t))``.
With ``decay = 1`` the errors telescope: what was sent over R rounds differs from the sum of
the true tensors by the last residual alone, not by R rounds of error. SparseLoCo decays the
accumulator (0.95) and lets it stand in for DiLoCo's outer momentum: what the top-k leaves
out of one round builds up until it is among the largest of its chunk.

Nothing is lost when a round's mean does not include this replica's contribution (the round
failed, was not committed, or sealed without it): ``applied`` is then not called, and the
accumulator keeps all it would have sent. The buffers are the replica's own state: they are
saved with it and restored on a restart (``training/recovery/own_state.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from diloco_anywhere.bucket.codecs.codec import Codec
from diloco_anywhere.bucket.format.wire import chunk_elements

log = logging.getLogger(__name__)


class ErrorFeedback:
    """Per-stream residual memory on the sender, decayed by ``decay`` each round."""

    def __init__(self, decay: float = 1.0) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"error feedback decay {decay!r} must be in (0, 1]")
        self.decay = decay
        self._buffers: dict[int, torch.Tensor] = {}

    def compensate(self, stream: int, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``e = decay * e + x``, with ``x`` the ``tensors`` flattened in order: what this
        round sends, as one flat float32 tensor on their device, which must not change until
        the round is done (the round reads it part by part). A new tensor every round: a
        round given up on (a sync that timed out) may still be reading the last one. A stream
        whose size changed starts again from zero, logged."""
        numel, device = sum(tensor.numel() for tensor in tensors), tensors[0].device
        previous = self._buffers.get(stream)
        if previous is not None and (previous.numel(), previous.device) != (numel, device):
            log.warning(
                "error feedback stream %d held %d values on %s, the round %d on %s: "
                "starting it again from zero", stream, previous.numel(), previous.device,
                numel, device,
            )  # fmt: skip
            previous = None
        buffer = torch.zeros(numel, device=device) if previous is None else previous * self.decay
        start = 0
        for tensor in tensors:
            buffer[start : start + tensor.numel()].add_(tensor.detach().reshape(-1))
            start += tensor.numel()
        self._buffers[stream] = buffer
        return buffer

    def applied(self, stream: int, codec: Codec) -> None:
        """The round's mean included what ``compensate`` returned: keep only what ``codec``
        dropped of it, ``e - decode(encode(e))``, encoding chunk by chunk as the wire does
        (the same bytes as the round sent: the codecs are deterministic per block)."""
        buffer = self._buffers[stream]
        numel, step = buffer.numel(), chunk_elements(codec, buffer.device, buffer.numel())
        payload = memoryview(bytearray(codec.payload_nbytes(min(step, numel))))
        for start in range(0, numel, step):
            values = buffer[start : start + step]
            count = values.numel()
            codec.encode_range(values, payload, count, 0)
            values.sub_(codec.decode_range(payload, count, 0, count, buffer.device))

    def residual(self, stream: int) -> torch.Tensor | None:
        """What stream ``stream`` holds back now (None before its first round)."""
        return self._buffers.get(stream)

    def clear(self) -> None:
        """Drop every stream's accumulator (a replica healed onto other global weights)."""
        self._buffers.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every stream's buffer, by its number as text (a safetensors name)."""
        return {str(stream): buffer for stream, buffer in self._buffers.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Buffers ``state_dict`` gave (checked by the caller against the model's fragments)."""
        self._buffers = {int(stream): buffer.float() for stream, buffer in state.items()}

"""Error feedback: the sender keeps what a lossy codec dropped and sends it next round.

Seide et al. 2014 ("1-bit SGD"), Karimireddy et al. 2019 ("Error Feedback Fixes SignSGD"), and
for DiLoCo's pseudo-gradients MuLoCo (arXiv 2505.23725, section 3). Round r encodes
``x_r + e_r`` and keeps ``e_{r+1} = (x_r + e_r) - decode(encode(x_r + e_r))``. The errors
telescope: the sum of what was sent over R rounds differs from the sum of the true tensors by the
last residual alone, not by R rounds of error.
"""

from __future__ import annotations

import torch

from diloco_anywhere.bucket import wire
from diloco_anywhere.bucket.codec import Codec


class ErrorFeedback:
    """Per-stream residual memory on the sender (a stream is e.g. one fragment's buffer)."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def encode(
        self, stream: str, tensor: torch.Tensor, codec: Codec, meta: wire.ObjectMeta
    ) -> bytearray:
        """Encode ``tensor`` plus the stream's residual, and keep the new residual."""
        compensated = tensor.detach().float()
        residual = self._residuals.get(stream)
        if residual is not None:
            if residual.shape != compensated.shape:
                raise ValueError(
                    f"stream {stream!r} changed shape {tuple(residual.shape)} -> "
                    f"{tuple(compensated.shape)}; call reset({stream!r}) first"
                )
            compensated = compensated + residual
        encoded = wire.encode(compensated, codec, meta)
        sent = wire.decode(encoded).tensor.to(compensated.device)
        self._residuals[stream] = compensated - sent
        return encoded

    def residual(self, stream: str) -> torch.Tensor | None:
        return self._residuals.get(stream)

    def reset(self, stream: str) -> None:
        self._residuals.pop(stream, None)

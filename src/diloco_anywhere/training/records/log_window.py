"""What ``Training.log`` records: the mean of everything a script logged in each window of
``task.log_every`` inner steps, whenever it calls ``log`` (every step, every few steps, now and
then). A script that logs every 5 steps under ``log_every = 10`` records a line every 10 steps,
not none; one that logs every 7 records a line at the first call past each multiple of 10.

Values stay where the script computed them (a loss on its GPU) until their window is written:
one device-to-host copy per window, not per call. A window holds at most ``log_every`` values of
each name; their mean is ``statistics.fmean``'s (exactly rounded), so a value logged unchanged
(a constant learning rate) is recorded as itself.
"""

from __future__ import annotations

import statistics

import torch

LOSS = "loss"


class LogWindow:
    """The sums and counts of the values logged since the last written window."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._due_at = every  # the step from which the current window is written
        self._values: dict[str, list[torch.Tensor | float]] = {}

    def add(self, loss: torch.Tensor | float, values: dict[str, torch.Tensor | float]) -> None:
        for name, value in ((LOSS, loss), *values.items()):
            value = value.detach() if isinstance(value, torch.Tensor) else float(value)
            self._values.setdefault(name, []).append(value)

    def due(self, step: int) -> bool:
        """Whether a call at inner step ``step`` closes the window."""
        return step >= self._due_at

    def close(self, step: int) -> tuple[float, dict[str, float]]:
        """The window's mean loss and mean values; the next window ends at the first multiple
        of ``every`` after ``step``."""
        means = {name: statistics.fmean(_on_host(values)) for name, values in self._values.items()}
        self._values = {}
        self._due_at = (step // self.every + 1) * self.every
        return means.pop(LOSS), means


def _on_host(values: list[torch.Tensor | float]) -> list[float]:
    """The numbers of ``values``, its tensors copied to the host together."""
    tensors = [value.reshape(()).to(torch.float64) for value in values
               if isinstance(value, torch.Tensor)]  # fmt: skip
    copied = torch.stack(tensors).tolist() if tensors else []
    return copied + [value for value in values if not isinstance(value, torch.Tensor)]

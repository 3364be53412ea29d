"""How a check ends: PASS, FAIL or SKIP, with its numbers and, for FAIL, every requirement it
missed. A requirement is judged on every device; a target (a speed, a memory bound) only on a
GPU: the CPU's tiny sizes say nothing about speed, and a loaded CI machine must not fail on it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

Status = Literal["PASS", "FAIL", "SKIP"]


@dataclass
class Outcome:
    status: Status
    summary: str = ""  # the line's numbers, in words
    numbers: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # each requirement missed, stated
    notes: list[str] = field(default_factory=list)  # targets not judged on this device
    reason: str = ""  # why it was skipped, or why it could not run

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def skipped(reason: str) -> Outcome:
    return Outcome("SKIP", reason=reason)


class Judge:
    """Collects what a check found against what it requires and targets."""

    def __init__(self, device: torch.device) -> None:
        self.on_gpu = device.type == "cuda"
        self.failures: list[str] = []
        self.notes: list[str] = []

    def require(self, met: bool, what: str) -> None:
        """``what`` (the requirement, with the value found) must hold on every device."""
        if not met:
            self.failures.append(what)

    def target(self, met: bool, what: str) -> None:
        """``what`` must hold on a GPU; elsewhere it is noted, not judged."""
        if not met:
            (self.failures if self.on_gpu else self.notes).append(what)

    def outcome(self, summary: str, numbers: dict[str, Any]) -> Outcome:
        status: Status = "FAIL" if self.failures else "PASS"
        return Outcome(status, summary, numbers, self.failures, self.notes)

"""A replica that joined the run but trains outside DiLoCo: a Hugging Face Trainer given no
``DilocoCallback``, a loop never wrapped in ``with replica.diloco(...)``. Its optimizer steps
and nothing syncs: it would train all its epochs alone (days, in a real run) while the others'
rounds wait for it, and say so only at its end.

From ``join`` until ``replica.diloco`` is entered, a hook PyTorch calls after every optimizer's
step (``register_optimizer_step_post_hook``) counts this process's steps; past two rounds'
worth (``2 x round_steps``) it stops the replica with the fix for its kind of script. A script
that only builds its model, prepares data or loads a checkpoint before ``replica.diloco`` takes
no optimizer step, however long that takes, so it is never stopped for it.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from diloco_anywhere.training.mistakes import TrainingOutsideDilocoError

ROUNDS = 2  # rounds' worth of steps a script may take outside DiLoCo before it is stopped


class OutsideDilocoWatch:
    """Counts the optimizer steps the thread that joined takes before ``replica.diloco``
    (PyTorch's hook sees every thread's: another replica's in the same process is not this
    one's); ``stop`` once it is entered."""

    def __init__(self, round_steps: int) -> None:
        self.limit, self.steps = ROUNDS * round_steps, 0
        self._thread = threading.get_ident()
        self._handle = register_optimizer_step_post_hook(self._after_step)

    def stop(self) -> None:
        self._handle.remove()

    def _after_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() != self._thread:
            return
        self.steps += 1
        if self.steps > self.limit:
            self.stop()
            raise TrainingOutsideDilocoError(_message(self.steps, _in_a_trainer()))


def _in_a_trainer() -> bool:
    """The step was taken by a Hugging Face ``Trainer`` (a frame of ``transformers``'s)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("transformers."):
            return True
        frame = frame.f_back
    return False


def _message(steps: int, trainer: bool) -> str:
    said = (f"this replica joined the run and took {steps} optimizer steps, but none under "
            f"DiLoCo: it would train alone and never sync, while the others' rounds wait for "
            f"it. ")  # fmt: skip
    if trainer:
        return said + (
            "A Hugging Face Trainer syncs through the callback: pass "
            '`callbacks=[DilocoCallback(replica)]` to the Trainer (docs/api.md, "Hugging Face '
            '`Trainer` as a replica")'
        )
    return said + (
        "Train inside `with replica.diloco(model, optimizer) as training:` and step that "
        "optimizer: DiLoCo syncs inside its step() (docs/api.md)"
    )

"""The held-out evaluation under a fixed random state: an ``evaluate`` that draws from the
global generators (a random batch of the validation set, dropout left on) then gives the same
number for the same weights on every replica and after every restart, and the training's own
random streams go on from where they were, as if no evaluation had run.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def fixed_random_state(seed: int, device: torch.device) -> Iterator[None]:
    """Python's, NumPy's and torch's generators (the CPU's, and ``device``'s when it is a
    GPU) seeded with ``seed`` inside, and put back as they were after."""
    python, numpy = random.getstate(), np.random.get_state()
    gpus = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)

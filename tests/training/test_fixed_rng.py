"""The held-out evaluation runs under the run's seed: an ``evaluate`` drawing from the global
generators gives the same number for the same weights whenever it runs, and the training's own
random streams are left as they were."""

from __future__ import annotations

import random

import numpy as np
import torch

from diloco_anywhere.training.fixed_rng import fixed_random_state

CPU = torch.device("cpu")


def _draws() -> tuple[float, float, float]:
    return float(torch.rand(())), random.random(), float(np.random.rand())


def test_an_evaluation_drawing_from_the_global_generators_gives_one_number():
    with fixed_random_state(7, CPU):
        first = _draws()
    _draws()  # the training draws in between, as many times as it likes
    with fixed_random_state(7, CPU):
        assert _draws() == first


def test_the_trainings_random_streams_go_on_as_if_no_evaluation_had_run():
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = [_draws() for _ in range(3)]
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    seen = [_draws()]
    with fixed_random_state(7, CPU):
        _draws()
    seen += [_draws() for _ in range(2)]
    assert seen == expected

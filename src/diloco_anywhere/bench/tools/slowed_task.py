"""Replicas of unlike hardware on one machine (``diloco bench hetero``): the built-in GPT task,
each replica's inner step slowed to its share of the fastest's pace.

``[task] entrypoint = "diloco_anywhere.bench.tools.slowed_task:build"`` with, beside the GPT task's
own options, ``speeds`` (one per replica index, 1 the fastest: ``[1, 1, 0.25, 0.25]``),
``step_seconds`` (what a step of speed 1 takes, padded with a sleep: the tiny model's own
compute is a few milliseconds) and ``slowdown = [index, after_steps, factor]`` (replica
``index`` becomes ``factor`` times slower after ``after_steps`` of its own inner steps: a spot
instance replaced by a slower GPU). The slowdown counts the steps the replica's process trained
(its calls of the task's loss; the held-out evaluation is not one), not seconds: when it comes
does not depend on how loaded the machine is, so it lands in the round its steps put it in.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import nn

from diloco_anywhere.task import Batch, Task, TaskContext
from diloco_anywhere.tasks import gpt

OPTIONS = ("speeds", "step_seconds", "slowdown")


@dataclasses.dataclass
class Slowness:
    """How long replica ``index``'s inner step takes, counting its steps."""

    step_seconds: float
    speed: float
    slowdown: tuple[int, float] | None  # (after steps, factor)
    steps: int = 0  # the inner steps padded so far

    @classmethod
    def of(cls, options: dict[str, Any], index: int) -> Slowness:
        speeds = [float(speed) for speed in options.get("speeds", [1.0])]
        if not speeds or min(speeds) <= 0:
            raise ValueError(f"task option speeds = {speeds}: give one speed > 0 per replica")
        slowdown = options.get("slowdown")
        mine = None
        if slowdown is not None:
            try:
                who, after, factor = slowdown
                valid = float(after).is_integer() and after >= 0 and factor >= 1
            except (TypeError, ValueError):
                valid = False
            if not valid:
                raise ValueError(
                    f"task option slowdown = {slowdown!r}: give [index, after_steps, factor], "
                    f"a replica index, its inner steps before it slows (0 or more) and a "
                    f"factor of 1 or more, e.g. [0, 100, 4]"
                )
            mine = (int(after), float(factor)) if int(who) == index else None
        step = float(options.get("step_seconds", 0.05))
        return cls(step, speeds[index % len(speeds)], mine)

    def seconds(self) -> float:
        """The padding of the next step."""
        padding = self.step_seconds / self.speed
        if self.slowdown is not None and self.steps >= self.slowdown[0]:
            padding *= self.slowdown[1]
        return padding

    def step(self) -> float:
        """The padding of this step, counted."""
        padding = self.seconds()
        self.steps += 1
        return padding


def build(context: TaskContext) -> Task:
    """The GPT task, its loss slowed to this replica's pace."""
    slowness = Slowness.of(context.options, context.replica_index)
    gpt_options = {k: v for k, v in context.options.items() if k not in OPTIONS}
    task = gpt.build(dataclasses.replace(context, options=gpt_options))

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        time.sleep(slowness.step())
        return task.loss(model, batch)

    return dataclasses.replace(task, loss=loss)

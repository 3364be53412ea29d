"""The baseline a replica's speed is measured against: the built-in loop without DiLoCo.

The same task, batches, inner optimizer, gradient clipping, learning-rate schedule and
``[task] compile`` as the built-in loop (``training/loop.py``), on run.toml's device, with no
manager, bucket or metrics. Its step times are taken as a replica's step lines are: every
``log_every`` steps, once the losses of the window are read back (which waits for the device's
queued work), so both are timed the same way on a GPU.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch

from diloco_anywhere.config import RunConfig
from diloco_anywhere.task import build_task
from diloco_anywhere.training.builders import SINGLE_PROCESS, inner_optimizer, task_context
from diloco_anywhere.training.loop import backward_batch, before_inner_step, compiled


@dataclass(frozen=True)
class StepTime:
    """Inner steps done, wall time and tokens trained at a logged step (a step line's)."""

    step: int
    time: float
    tokens: int


def plain_loop(
    config: RunConfig, replica_index: int, steps: int, start_together: Any = None
) -> list[StepTime]:
    """Train ``steps`` inner steps of replica ``replica_index``'s data; the logged steps, from
    step 0. ``start_together``: a barrier waited on once the model is built, so that loops
    sharing a device train side by side as a run's replicas do."""
    task = build_task(config.task.entrypoint, task_context(config, replica_index, SINGLE_PROCESS))
    model = compiled(task.model, config.task.compile)
    inner = inner_optimizer(config, task.model)
    batches, window = task.batches(0), []
    if start_together is not None:
        start_together.wait()
    lines = [StepTime(0, time.time(), 0)]
    for step in range(1, steps + 1):
        inner.zero_grad(set_to_none=True)
        window.append(backward_batch(task, model, next(batches)))
        before_inner_step(task, inner, config.diloco.inner_lr, step - 1)
        inner.step()
        if step % config.task.log_every == 0:
            torch.stack(window).tolist()  # the window's losses on the host: its work is done
            window.clear()
            lines.append(StepTime(step, time.time(), step * task.tokens_per_batch))
    return lines


def inner_intervals(
    lines: list[StepTime], sync_every: int, first: int = 1, last: int | None = None
) -> list[tuple[StepTime, StepTime]]:
    """The intervals between logged steps that hold no sync (a replica syncs, evaluates and
    checkpoints inside its every ``sync_every``-th step), from the ``first``-th sync on (every
    replica has started by the first) and before the ``last``-th. The same intervals of a
    plain loop are its baseline."""
    last_step = float("inf") if last is None else last * sync_every
    return [
        (before, after)
        for before, after in itertools.pairwise(lines)
        if first * sync_every <= before.step
        and after.step <= last_step
        and after.step // sync_every == before.step // sync_every
    ]


def inner_tokens_per_second(intervals: list[tuple[StepTime, StepTime]]) -> tuple[float, int]:
    """Tokens/s over ``intervals`` (``inner_intervals``), and the inner steps they hold."""
    seconds = sum(after.time - before.time for before, after in intervals)
    if not seconds:
        raise ValueError(
            "no logged interval free of syncs to measure: log more often than every sync_every "
            "steps, over more outer steps"
        )
    tokens = sum(after.tokens - before.tokens for before, after in intervals)
    return tokens / seconds, sum(after.step - before.step for before, after in intervals)

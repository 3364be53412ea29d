"""What a replica trains: a model, its data and its loss, built by a ``package.module:function``.

A task is the user's code; everything around it (DiLoCo, the bucket, metrics) is ours. run.toml
names the function (``[task] entrypoint``); the replica imports it and calls it with a
``TaskContext``. The built-in task is ``diloco_anywhere.tasks.gpt:build``.

Replicas must train on different data (DiLoCo's workers each train on their own shard, arXiv
2311.08105 section 2), deterministic for a given ``context.seed``, so a run can be
reproduced; ``batches(start)`` begins at batch ``start``: a replica that restarts or heals
resumes its data where its round is (every replica trains ``sync_every / fragments`` batches
per round), without replaying the batches before. ``context.stream(...)`` gives all of that
for token data (``data/``: a corpus prepared once, shared out through the bucket so that
every sequence is trained once an epoch whatever the replicas do); a task that draws its own
data shards it by ``context.replica_index`` and, in a replica of several processes, by
``context.rank``.
The model's initial weights must be the same on every replica (seed them from ``context.seed``):
a replica joining a run with no checkpoint yet replays the rounds from its own initial weights.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diloco_anywhere.data.source import DataSource
from diloco_anywhere.data.stream import Stream
from diloco_anywhere.data.tokenizers import ByteTokenizer, HfTokenizer

Batch = Any  # whatever the task's ``loss`` takes


@dataclass(frozen=True)
class TaskContext:
    replica_index: int  # 0 .. replicas - 1: which data shard
    replicas: int
    seed: int
    device: torch.device
    options: dict[str, Any] = field(default_factory=dict)  # run.toml [task.options]
    # A replica of several processes (torchrun, DDP inside the replica): this process's rank
    # among them. Each rank trains on its own part of the replica's shard.
    rank: int = 0
    ranks: int = 1
    # The run's inner steps (outer_steps x sync_every): what a learning-rate schedule spans.
    total_steps: int = 0
    # The run's data and where its raw text is prepared (``training.builders.task_context``);
    # none for a task built only for its model (``diloco export``)
    data: DataSource | None = None

    def stream(
        self, seq_len: int, batch_sequences: int,
        tokenizer: ByteTokenizer | HfTokenizer | None = None, **raw: Any,
    ) -> Stream:  # fmt: skip
        """This process's share of the run's data (``data/stream.py``): ``stream.batches``
        is a ``Task``'s ``batches``, each a ``[batch_sequences, seq_len + 1]`` tensor of
        token ids; ``stream.evaluation(n)`` the held-out batches. ``raw``: the task's own data
        where run.toml gives none, and how to prepare raw text (``DataSource.open``)."""
        if self.data is None:
            raise ValueError(
                "this task context has no data source: build it with "
                "diloco_anywhere.training.builders.task_context(config, ...)"
            )
        return self.data.open(seq_len, batch_sequences, tokenizer, **raw)


@dataclass
class Task:
    model: nn.Module
    batches: Callable[[int], Iterator[Batch]]  # batches(start): endless, from batch ``start``
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    tokens_per_batch: int  # weights the replica's contribution and drives tokens/s
    evaluate: Callable[[nn.Module], float] | None = None  # held-out loss, same on every replica
    # writes the model in the task's own format into a folder (`diloco export`), e.g. a
    # Hugging Face model's save_pretrained
    save: Callable[[nn.Module, Path], None] | None = None
    # The built-in loop's extras, for tasks that want them:
    # each batch is a list of micro-batches, each its own forward and backward (gradient
    # accumulation: one inner step, the mean of their losses)
    micro_batches: bool = False
    max_grad_norm: float | None = None  # clip the gradients' global norm before each step
    # the inner learning rate's multiplier at the run's inner step (warmup, decay); the run's
    # step, not the process's, so it is right after a heal or a restart
    lr_schedule: Callable[[int], float] | None = None


# -- building blocks for token tasks ---------------------------------------------------------


def inputs_and_targets(
    rows: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A stream's ``[batch, seq_len + 1]`` rows as (inputs, targets) on ``device``."""
    rows = rows.to(device, non_blocking=True)
    return rows[:, :-1], rows[:, 1:]


def held_out_loss(
    loss: Callable[[nn.Module, Batch], torch.Tensor], eval_set: Callable[[], list[Batch]]
) -> Callable[[nn.Module], float]:
    """``evaluate``: the mean loss over ``eval_set()`` (made at the first evaluation, then kept)
    in eval mode, without gradients."""
    batches = cache(eval_set)

    def evaluate(model: nn.Module) -> float:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            chosen = batches()
            total = sum(float(loss(model, batch)) for batch in chosen)
        model.train(was_training)
        return total / len(chosen)

    return evaluate


def load_entrypoint(entrypoint: str) -> Callable[[TaskContext], Task]:
    """``'package.module:function'`` -> the function; errors say what was wrong and the fix."""
    module_name, _, function_name = entrypoint.partition(":")
    if not module_name or not function_name.isidentifier():
        raise ValueError(f"task entrypoint {entrypoint!r}: write it as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"task entrypoint {entrypoint!r}: cannot import {module_name!r} ({exc}); install "
            f"the package that holds it in the replica's environment or image"
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"task entrypoint {entrypoint!r}: {module_name} has no {function_name}()")
    return function


def build_task(entrypoint: str, context: TaskContext) -> Task:
    task = load_entrypoint(entrypoint)(context)
    if not isinstance(task, Task):
        raise TypeError(
            f"task entrypoint {entrypoint!r} returned {type(task).__name__}; it must return a "
            f"diloco_anywhere.task.Task"
        )
    return task

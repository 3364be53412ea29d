"""The built-in replica loop (``task.entrypoint`` in run.toml), written on the public API
(docs/api.md): what a script of one's own would do with ``join`` and ``Replica.diloco``.
"""

from __future__ import annotations

import torch
from torch import nn

from diloco_anywhere.task import Batch, Task, build_task
from diloco_anywhere.training.builders import inner_optimizer
from diloco_anywhere.training.replica import Replica
from diloco_anywhere.training.state.warm_start import warm_start
from diloco_anywhere.training.training import TrainingResult


def train(replica: Replica) -> TrainingResult:
    """The built-in replica loop, on the public API (docs/api.md): build run.toml's task (from
    ``[task] init_from``'s weights, if given), then train it under torchft's DiLoCo until the
    run's outer steps are committed."""
    task = build_task(replica.config.task.entrypoint, replica.task_context())
    if replica.config.task.init_from:
        warm_start(task.model, replica.config.resolve(replica.config.task.init_from))
    trained = compiled(replica.parallelize(task.model), replica.config.task.compile)
    inner = inner_optimizer(replica.config, task.model)
    with replica.diloco(
        task.model, inner, tokens_per_step=task.tokens_per_batch, evaluate=task.evaluate
    ) as training:
        for batch in training.batches(task.batches):
            inner.zero_grad(set_to_none=True)
            loss = backward_batch(task, trained, batch)
            before_inner_step(task, inner, replica.config.diloco.inner_lr, training.run_step)
            inner.step()  # DiLoCo's hook syncs here every sync_every / fragments steps
            training.log(loss, lr=inner.param_groups[0]["lr"])
    return training.result()


def compiled(module: nn.Module, compile_module: bool | str) -> nn.Module:
    """``module`` through ``torch.compile`` when run.toml's ``[task] compile`` asks (true:
    torch's default backend, Inductor; else the backend it names): the compiled wrapper runs
    the forward and backward; DiLoCo, the outer step, checkpoints and the held-out evaluation
    work on the module's own parameters, which it shares."""
    if compile_module is False:
        return module
    return torch.compile(module, backend="inductor" if compile_module is True else compile_module)


def backward_batch(task: Task, model: nn.Module, batch: Batch) -> torch.Tensor:
    """Forward and backward the batch (each of its micro-batches, for a task that accumulates
    gradients); the mean loss, detached."""
    parts = batch if task.micro_batches else [batch]
    losses = []
    for part in parts:
        loss = task.loss(model, part) / len(parts)
        loss.backward()
        losses.append(loss.detach())  # on its device: read only when logged
    return torch.stack(losses).sum()


def before_inner_step(task: Task, inner: torch.optim.Optimizer, base_lr: float, step: int) -> None:
    """The task's gradient clipping and learning-rate schedule, at the run's inner step."""
    if task.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(task.model.parameters(), task.max_grad_norm)
    if task.lr_schedule is not None:
        for group in inner.param_groups:
            group["lr"] = base_lr * task.lr_schedule(step)

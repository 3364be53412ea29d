"""Check 4: FSDP2 on the device. One replica of the built-in GPT, one rank under ``torchrun``
with ``[run] sharding = "fsdp"`` (its process group on NCCL on a GPU, ``replica_group.py``),
trains two outer steps; the same run then trains on the CPU (gloo). The two must agree within
rounding: their final global weights differ by at most 1% of how far training moved them, and
their held-out losses by at most 1%. (On ``--device cpu`` the one CPU run is compared with
itself: there the script is what is checked.)

Short and gentle on purpose: rounding differences grow with every step of a run that trains
fast enough to be chaotic. The same small GPT on the same CPU with one intra-op thread and
then two (which changes only the order of the matmuls' sums) ended 23% of its update apart
after 3 outer steps of 20 at an inner rate of 3e-3, and 6.5e-5 apart after 2 of 10 at 1e-3;
on an H200 against its CPU, 41% at the former. The latter is what this check runs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from diloco_anywhere.bench.gpu.gpt_runs import (
    eval_losses,
    final_weights,
    gpt_config,
    run_under_torchrun,
    the_replica,
)
from diloco_anywhere.bench.gpu.outcome import Judge, Outcome, skipped
from diloco_anywhere.bench.gpu.plan import Sizes
from diloco_anywhere.config import RunConfig
from diloco_anywhere.task import build_task
from diloco_anywhere.training.builders import SINGLE_PROCESS, task_context

log = logging.getLogger(__name__)
UPDATE_AGREEMENT = 0.01  # |w_device - w_cpu| over |w_cpu - w_initial|
LOSS_AGREEMENT = 0.01  # relative
SYNC_EVERY, OUTER_STEPS, INNER_LR = 10, 2, 1e-3  # see the module docstring


def initial_weights(config: RunConfig) -> dict[str, torch.Tensor]:
    task = build_task(config.task.entrypoint, task_context(config, 0, SINGLE_PROCESS))
    return {name: tensor.detach().cpu() for name, tensor in task.model.state_dict().items()}


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum(((a[name].float() - b[name].float()) ** 2).sum() for name in b) ** 0.5)


def _train(device: str, sizes: Sizes, folder: Path) -> tuple[RunConfig, float]:
    config = gpt_config(
        device, sizes, folder, outer_steps=OUTER_STEPS, run={"sharding": "fsdp"},
        diloco={"codec": "int8", "sync_every": SYNC_EVERY, "inner_lr": INNER_LR}, task={},
    )  # fmt: skip
    started = time.perf_counter()
    config = run_under_torchrun(config, folder, timeout=600)
    return config, time.perf_counter() - started


def check(device: torch.device, sizes: Sizes, work: Path) -> Outcome:
    if device.type == "cuda" and not torch.distributed.is_nccl_available():
        return skipped("this torch has no NCCL (torch.distributed.is_nccl_available() is False)")
    places = dict.fromkeys([device.type, "cpu"])  # on the CPU, its one run is the reference
    runs = {where: _train(where, sizes, work / where) for where in places}
    (on_device, device_seconds), (on_cpu, cpu_seconds) = runs[device.type], runs["cpu"]
    weights, reference = final_weights(on_device).tensors, final_weights(on_cpu).tensors
    initial = {name: t for name, t in initial_weights(on_cpu).items() if name in reference}
    moved = _distance(reference, initial)
    apart = _distance(weights, reference)
    losses, reference_losses = eval_losses(the_replica(on_device)), eval_losses(the_replica(on_cpu))
    loss_gap = abs(losses[-1] - reference_losses[-1]) / reference_losses[-1]
    judge = Judge(device)
    judge.require(weights.keys() == reference.keys(), "both runs hold the same parameters")
    judge.require(
        apart <= UPDATE_AGREEMENT * moved,
        f"final weights within {UPDATE_AGREEMENT:.0%} of how far training moved them: "
        f"{apart:.3g} apart, moved {moved:.3g}",
    )
    judge.require(
        loss_gap <= LOSS_AGREEMENT,
        f"held-out losses within {LOSS_AGREEMENT:.0%}: {losses[-1]:.5f} vs "
        f"{reference_losses[-1]:.5f}",
    )
    numbers = {
        "outer_steps": OUTER_STEPS, "sync_every": SYNC_EVERY, "inner_lr": INNER_LR,
        "preset": sizes.gpt_preset, "seconds": device_seconds, "cpu_seconds": cpu_seconds,
        "eval_losses": losses, "cpu_eval_losses": reference_losses,
        "weights_apart": apart, "weights_moved": moved, "apart_vs_moved": apart / moved,
        "max_abs_difference": max(
            float((weights[name] - reference[name]).abs().max()) for name in reference
        ),
        "loss_gap": loss_gap,
    }  # fmt: skip
    summary = (
        f"{device.type} vs cpu after {OUTER_STEPS} outer steps: weights apart "
        f"{apart / moved:.2e} of their update, held-out loss {losses[-1]:.4f} vs "
        f"{reference_losses[-1]:.4f} ({device_seconds:.0f} s vs {cpu_seconds:.0f} s)"
    )
    return judge.outcome(summary, numbers)

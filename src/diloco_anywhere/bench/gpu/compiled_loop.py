"""Check 5: the built-in loop under ``torch.compile`` (``[task] compile = true``). One replica
of the built-in GPT with the sparse codec (its error feedback on the device) trains a few outer
steps compiled; a second launch of the same run with one more outer step resumes from its
checkpoint and its own saved state, exactly, and trains on, compiled again; then the run's
weights, read back from its last checkpoint, load into a fresh model whose held-out loss is
the run's last (within 0.1%: that model is evaluated on the CPU).

On a GPU it compiles with Inductor (``compile = true``), the kernels a user's run gets. On the
CPU, where ``make test`` runs every check at tiny sizes, it compiles with ``aot_eager``: the
same wrapper, parameter names, traced forward and backward, resume and export, without
Inductor's C++ code generation, which no GPU run uses (it generates Triton there) and which
cost a fresh machine a minute of g++ on every ``make test``."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import torch

from diloco_anywhere.bench.gpu.gpt_runs import eval_losses, final_weights, gpt_config, the_replica
from diloco_anywhere.bench.gpu.outcome import Judge, Outcome, skipped
from diloco_anywhere.bench.gpu.plan import Sizes
from diloco_anywhere.bench.train import run_diloco
from diloco_anywhere.launching.watch.export import trained_task
from diloco_anywhere.training.fixed_rng import fixed_random_state

log = logging.getLogger(__name__)
LOSS_AGREEMENT = 1e-3


def missing_compiler(device: torch.device) -> str | None:
    """Why Inductor cannot compile for ``device`` here, or None (the CPU's check needs none)."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "Inductor compiles for CUDA with Triton, which is not installed"
    return None


def backend(device: torch.device) -> str:
    """``[task] compile`` for the check: Inductor (what ``true`` means) on a GPU, ``aot_eager``
    on the CPU."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def check(device: torch.device, sizes: Sizes, work: Path) -> Outcome:
    if reason := missing_compiler(device):
        return skipped(reason)
    folder, seconds = work / "run", []
    folder.mkdir(parents=True)
    first, then = (
        gpt_config(
            device.type, sizes, folder, outer_steps=outer_steps, run={},
            diloco={"codec": "sparse"}, task={"compile": backend(device)},
        )
        for outer_steps in (sizes.gpt_outer_steps, sizes.gpt_outer_steps + 1)
    )  # fmt: skip
    for config in (first, then):
        started = time.perf_counter()
        run_diloco(config, folder, log.info)
        seconds.append(time.perf_counter() - started)
    replica = the_replica(then)
    losses = eval_losses(replica)
    resumed = [event.detail for event in replica.events if event.event == "resumed"]
    task = trained_task(then, final_weights(then))
    with fixed_random_state(then.run.seed, torch.device("cpu")):
        exported_loss = task.evaluate(task.model)  # type: ignore[misc]
    logs = "".join(path.read_text(errors="replace") for path in folder.rglob("local-0.log"))
    judge = Judge(device)
    judge.require(
        [s.outer_step for s in replica.syncs if s.committed]
        == list(range(1, sizes.gpt_outer_steps + 2)),
        f"every outer step committed once, across the two launches: "
        f"{[s.outer_step for s in replica.syncs]}",
    )
    judge.require(
        len(resumed) == 1 and "exact" in resumed[0],
        f"the second launch resumed its own state exactly: {resumed}",
    )
    judge.require(
        "starting it again from zero" not in logs, "the error feedback resumed, not from zero"
    )
    judge.require(
        bool(losses) and abs(exported_loss - losses[-1]) <= LOSS_AGREEMENT * losses[-1],
        f"the checkpoint's weights load into a fresh model with the run's held-out loss: "
        f"{exported_loss:.5f} vs {losses[-1:]}",
    )
    numbers = {
        "first_launch_seconds": seconds[0], "resumed_launch_seconds": seconds[1],
        "eval_losses": losses, "exported_eval_loss": exported_loss, "resumed": resumed,
    }  # fmt: skip
    summary = (
        f"compiled ({backend(device)}): {seconds[0]:.0f} s for {sizes.gpt_outer_steps} outer "
        f"steps, resumed and one more in {seconds[1]:.0f} s; held-out loss "
        f"{', '.join(f'{x:.4f}' for x in losses)}, {exported_loss:.4f} from the weights read back"
    )
    return judge.outcome(summary, numbers)

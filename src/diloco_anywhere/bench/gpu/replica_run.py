"""Check 1: a real run on the device. Two replica processes of the Hugging Face task share
the device (a Llama built from its config, bf16 autocast on a GPU), sync every H steps with
int8 through a local store, and must finish agreeing (the same fingerprint every round) with
a falling held-out loss. Their inner steps are timed against two plain loops of the same
model, batch and optimizer side by side on the same device (``plain_loop.py``): both over the
same intervals free of syncs, so the ratio is the inner loop's overhead; the syncs' cost is
the exposed sync time per outer step, reported beside it. Steady state (target >= 0.97) is
measured from the second sync on: after the first, each replica writes the run's first
checkpoint and its own state in the background (``checkpoints/writer.py``,
``own_state.py``), a cost of every checkpoint step that is reported on its own, as the ratio
over the intervals between the first and the second sync."""

from __future__ import annotations

import logging
import multiprocessing
import statistics
from pathlib import Path
from typing import Any

import torch

from diloco_anywhere.backends.local import threads_per_replica
from diloco_anywhere.bench.chaos import fingerprint_disagreements
from diloco_anywhere.bench.gpu.corpus import write_corpus
from diloco_anywhere.bench.gpu.outcome import Judge, Outcome
from diloco_anywhere.bench.gpu.plan import Sizes
from diloco_anywhere.bench.tools.plain_loop import (
    StepTime,
    inner_intervals,
    inner_tokens_per_second,
    plain_loop,
)
from diloco_anywhere.bench.train import results_of, run_diloco
from diloco_anywhere.config import RunConfig, validate_config
from diloco_anywhere.training.records.metrics import ReplicaMetrics

log = logging.getLogger(__name__)
REPLICAS = 2
THROUGHPUT_TARGET = 0.97


def run_config(device: torch.device, sizes: Sizes, folder: Path, **options: Any) -> RunConfig:
    """The run: ``REPLICAS`` replicas of the Hugging Face task on ``device``; its store in
    ``folder``; checkpoints after the first and the last outer step."""
    data = {
        "run": {"name": "gpu-replica", "store": "store", "replicas": REPLICAS,
                "min_replicas": REPLICAS},
        "diloco": {"sync_every": sizes.sync_every, "outer_steps": sizes.outer_steps,
                   "codec": "int8", "inner_lr": 1e-3},
        "sync": {"timeout": 300.0},
        "checkpoint": {"every": 1000},
        "task": {
            "entrypoint": "diloco_anywhere.tasks.hf_causal_lm:build", "device": device.type,
            "log_every": sizes.log_every, "eval_every": 1,
            "options": {"config": sizes.llama, "seq_len": sizes.seq_len,
                        "batch_size": sizes.batch_size, "eval_batches": 4,
                        "warmup_steps": sizes.sync_every // 2, **options},
        },
    }  # fmt: skip
    return validate_config(data, "the gpu check's replica run", folder / "run.toml")


def _plain(config: RunConfig, index: int, steps: int, barrier: Any, results: Any) -> None:
    torch.set_num_threads(threads_per_replica(REPLICAS))  # as the local backend's replicas
    results.put((index, plain_loop(config, index, steps, start_together=barrier)))


def plain_loops(config: RunConfig) -> list[list[StepTime]]:
    """Every replica's plain loop, side by side on the device, each in a fresh process."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(REPLICAS), context.Queue()
    steps = config.diloco.total_steps
    processes = [
        context.Process(target=_plain, args=(config, index, steps, barrier, results))
        for index in range(REPLICAS)
    ]
    return [lines for _, lines in sorted(results_of(processes, results))]


def step_times(metrics: ReplicaMetrics) -> list[StepTime]:
    return [StepTime(line.step, line.time, line.tokens) for line in metrics.steps]


def rates(
    runs: list[list[StepTime]], sync_every: int, first: int, last: int | None = None
) -> tuple[float, list[list[float]]]:
    """Tokens/s of inner steps summed over ``runs`` (side by side), between the ``first``-th
    and the ``last``-th sync; and each run's tokens/s per interval, to see where time went."""
    spans = [inner_intervals(lines, sync_every, first, last) for lines in runs]
    each = [
        [(b.tokens - a.tokens) / (b.time - a.time) for a, b in intervals] for intervals in spans
    ]
    return sum(inner_tokens_per_second(intervals)[0] for intervals in spans), each


def check(device: torch.device, sizes: Sizes, work: Path) -> Outcome:
    tokenizer, data = write_corpus(work / "corpus", sizes.corpus_bytes, sizes.vocab)
    config = run_config(device, sizes, work / "run", tokenizer=str(tokenizer), data=str(data))
    (work / "run").mkdir(parents=True)
    metrics = run_diloco(config, work / "run", log.info)
    log.info("the plain loops, side by side")
    plain = plain_loops(config)
    every, replicas = config.diloco.sync_every, [step_times(m) for m in metrics.values()]
    diloco_rate, diloco_each = rates(replicas, every, first=2)
    plain_rate, plain_each = rates(plain, every, first=2)
    ratio = diloco_rate / plain_rate
    writing = rates(replicas, every, 1, 2)[0] / rates(plain, every, 1, 2)[0]
    syncs = [sync for replica in metrics.values() for sync in replica.syncs]
    losses = [s.eval_loss for s in next(iter(metrics.values())).syncs if s.eval_loss is not None]
    exposed = statistics.fmean(
        m.syncs[-1].sync_exposed_seconds / len(m.syncs) for m in metrics.values()
    )
    started = next(e for e in next(iter(metrics.values())).events if e.event == "started")
    judge = Judge(device)
    judge.require(
        len(syncs) == REPLICAS * config.diloco.outer_steps
        and all(s.committed and s.contributed for s in syncs),
        f"every sync of every replica committed with its contribution: {len(syncs)} syncs",
    )
    disagreements = fingerprint_disagreements(metrics)
    judge.require(not disagreements, f"replicas agree every round: {disagreements}")
    judge.require(len(losses) >= 2 and losses[-1] < losses[0], f"held-out loss falls: {losses}")
    judge.target(
        ratio >= THROUGHPUT_TARGET,
        f"inner-step tokens/s at least {THROUGHPUT_TARGET} of the plain loop's: {ratio:.3f}",
    )
    numbers = {
        "parameters": started.parameters,
        "tokens_per_step": config.task.options["seq_len"] * config.task.options["batch_size"],
        "diloco_inner_tokens_per_second": diloco_rate,
        "plain_tokens_per_second": plain_rate,
        "inner_throughput_vs_plain": ratio,
        "inner_throughput_vs_plain_while_a_checkpoint_is_written": writing,
        "diloco_tokens_per_second_per_interval": diloco_each,
        "plain_tokens_per_second_per_interval": plain_each,
        "exposed_sync_seconds_per_outer_step": exposed,
        "eval_losses": losses,
        "bytes_up_per_replica_per_sync": statistics.fmean(
            m.syncs[-1].bytes_up / len(m.syncs) for m in metrics.values()
        ),
    }
    falls = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "not evaluated"
    summary = (
        f"{started.parameters:,} parameters, inner tokens/s {diloco_rate:,.0f} vs plain "
        f"{plain_rate:,.0f} ({ratio:.3f}x; {writing:.3f}x while a checkpoint is written), "
        f"exposed sync {exposed:.2f} s per outer step, held-out loss {falls}"
    )
    return judge.outcome(summary, numbers)

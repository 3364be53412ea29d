"""Training benchmarks: blocking against streaming syncs, the inner loop against a plain
PyTorch loop, and the runs every training benchmark is made of (``convergence.py`` compares
DiLoCo with data parallel).

Every DiLoCo run here is a real run: local replica processes, the replica entrypoint, a local
store in a temporary folder, torchft's DiLoCo; its numbers come from the run's own metrics.
"""

from __future__ import annotations

import multiprocessing
import queue
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w

from diloco_anywhere.backends.local import LocalBackend
from diloco_anywhere.bench.tools.plain_loop import plain_loop
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig, load_config, validate_config, with_changes
from diloco_anywhere.launching.start.launch import LaunchPlan, plan_launch, run_metrics
from diloco_anywhere.published_config import publish_config
from diloco_anywhere.training.records.metrics import ReplicaMetrics

Progress = Callable[[str], None]


def bench_config(**changes: Any) -> RunConfig:
    """The embedded default run with changes."""
    return with_changes(load_config(), **changes)


def local_plan(config: RunConfig, folder: Path) -> LaunchPlan:
    """``config`` as a run.toml in ``folder`` with its store there, planned on local processes."""
    data = config.model_dump()
    data["run"]["store"] = str(folder / "store")
    path = folder / f"{config.run.name}.toml"
    path.write_text(tomli_w.dumps(data))
    config = validate_config(data, str(path), path)
    plan = plan_launch(config, {"local": config.run.replicas}, root=folder)
    with Store(config.store_url()) as store:  # what every replica of a launch is told
        publish_config(store, config)
    return plan


def run_diloco(config: RunConfig, folder: Path, progress: Progress) -> dict[str, ReplicaMetrics]:
    """Run ``config`` to the end as local processes in ``folder``; return its metrics."""
    plan = local_plan(config, folder)
    config = plan.config
    backend = LocalBackend()
    handles = backend.launch(list(plan.specs), plan.run_dir)
    reader = run_metrics(config)
    polls = 0
    while any(backend.state(handle) == "running" for handle in handles):
        if polls % 10 == 0:  # every 5 s: the replicas share this machine's cores
            steps = [m.outer_step() for m in reader.read().values()]
            progress(f"{config.run.name}: outer step {min(steps, default=0)} of "
                     f"{config.diloco.outer_steps}")  # fmt: skip
        polls += 1
        time.sleep(0.5)
    failed = [h.replica_id for h in handles if backend.exit_code(h) != 0]
    if failed:
        log = backend.logs(next(h for h in handles if h.replica_id == failed[0]))
        raise RuntimeError(f"replicas {failed} failed; {failed[0]}'s log ends:\n{log[-2000:]}")
    return reader.read()


def wall_seconds(metrics: ReplicaMetrics) -> float:
    """From the replica's task being built to the end of its training."""
    started = next(e.time for e in metrics.events if e.event == "started")
    return next(e.time for e in metrics.events if e.event == "done") - started


def bench_overlap(config: RunConfig, fragments: int, delay: int, progress: Progress) -> dict:
    """Share of wall time training waited on syncs: blocking (one fragment) vs streaming."""
    runs = {
        "blocking": config,
        "streaming": with_changes(
            config, diloco__fragments=fragments, diloco__fragment_sync_delay=delay
        ),
    }
    result: dict[str, Any] = {
        "replicas": config.run.replicas,
        "sync_every": config.diloco.sync_every,
    }
    for name, run in runs.items():
        with tempfile.TemporaryDirectory(prefix="diloco-bench-") as folder:
            metrics = run_diloco(run, Path(folder), progress)
        exposed = statistics.fmean(m.syncs[-1].sync_exposed_seconds for m in metrics.values())
        wall = statistics.fmean(map(wall_seconds, metrics.values()))
        result[name] = {
            "fragments": run.diloco.fragments,
            "fragment_sync_delay": run.diloco.fragment_sync_delay,
            "exposed_seconds": exposed,
            "wall_seconds": wall,
            "exposed_fraction": exposed / wall,
        }
    return result


def results_of(processes: list[Any], results: Any) -> list[Any]:
    """Start ``processes`` and take one result of each; a process that dies without one ends
    the study with its exit code at once, rather than after the queue's timeout."""
    for process in processes:
        process.start()
    outcomes: list[Any] = []
    while len(outcomes) < len(processes):
        try:
            outcomes.append(results.get(timeout=1))
        except queue.Empty:
            if dead := [p for p in processes if p.exitcode not in (None, 0)]:
                raise RuntimeError(
                    f"a benchmark process exited {dead[0].exitcode}: its error is printed above"
                ) from None
    for process in processes:
        process.join(timeout=60)
    return outcomes


def _plain_loop(config: RunConfig, steps: int, results) -> None:
    """Tokens/s of the plain loop from its first logged step (after warm-up) to its last."""
    lines = plain_loop(config, 0, steps)
    first, last = lines[1], lines[-1]
    results.put((last.tokens - first.tokens) / (last.time - first.time))


def _plain_tokens_per_second(config: RunConfig, steps: int) -> float:
    context = multiprocessing.get_context("spawn")  # measured from a fresh start: processes.py
    results = context.Queue()
    process = context.Process(target=_plain_loop, args=(config, steps, results))
    (tokens_per_second,) = results_of([process], results)
    return tokens_per_second


def _diloco_tokens_per_second(config: RunConfig, progress: Progress) -> float:
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as folder:
        (metrics,) = run_diloco(config, Path(folder), progress).values()
    first, last = metrics.steps[0], metrics.steps[-1]  # syncs between them are included
    return (last.tokens - first.tokens) / (last.time - first.time)


def bench_throughput(config: RunConfig, repeats: int, progress: Progress) -> dict[str, Any]:
    """Tokens/s of one DiLoCo replica (syncs included) vs the same loop without DiLoCo, both
    from the first logged step (after warm-up) to the last, in fresh processes, alternating
    ``repeats`` times (medians: the machine's speed drifts between runs)."""
    config = with_changes(config, run__replicas=1, run__min_replicas=1, task__eval_every=0)
    steps = config.diloco.sync_every * config.diloco.outer_steps
    plain, diloco = [], []
    for repeat in range(repeats):
        progress(f"plain PyTorch loop: {steps} steps ({repeat + 1}/{repeats})")
        plain.append(_plain_tokens_per_second(config, steps))
        diloco.append(_diloco_tokens_per_second(config, progress))
    return {
        "inner_steps": steps,
        "sync_every": config.diloco.sync_every,
        "repeats": repeats,
        "plain_tokens_per_second": statistics.median(plain),
        "diloco_tokens_per_second": statistics.median(diloco),
        "ratio": statistics.median(diloco) / statistics.median(plain),
    }

"""``diloco report``: a run's loss curves as a PNG, what its syncs cost, and how much of each
epoch of its data it trained (``data/coverage.py``).

Communication is set against synchronous data parallel on the same replicas and steps: a ring
all-reduce of fp32 gradients after every inner step sends ``2 (N - 1) / N x 4 x parameters``
bytes per replica per step (Patarasuk and Yuan 2009; what DDP over NCCL or gloo moves). DiLoCo
sends its pseudo-gradients once per outer step (arXiv 2311.08105, section 3).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.watch.fleet import fleet_throughput
from diloco_anywhere.training.records.metrics import ReplicaMetrics

if TYPE_CHECKING:
    from diloco_anywhere.data.coverage import Coverage


@dataclass(frozen=True)
class RunSummary:
    replicas: int
    outer_steps: int
    inner_steps_per_replica: int
    tokens: int  # all replicas
    final_loss: float | None  # mean over replicas of their last logged training loss
    eval_loss: float | None  # held-out loss at the last global weights
    bytes_up_per_replica: int  # mean
    bytes_down_per_replica: int
    data_parallel_bytes_per_replica: int  # what DDP would have sent for the same steps
    sync_exposed_seconds: float  # mean per replica
    # committed tokens a second, and the sum of the replicas' own (``fleet.py``); None before
    # two syncs
    fleet_tokens_per_second: float | None = None
    own_tokens_per_second: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def bytes_saved_factor(self) -> float | None:
        if not self.bytes_up_per_replica:
            return None
        return self.data_parallel_bytes_per_replica / self.bytes_up_per_replica


def _over_incarnations(replica: ReplicaMetrics, counter: str) -> float:
    """A per-process counter (bytes, exposed seconds) summed over the replica's incarnations."""
    return sum(getattr(sync, counter) for sync in replica.last_sync_by_incarnation.values())


def summarize(metrics: dict[str, ReplicaMetrics]) -> RunSummary:
    replicas = [m for m in metrics.values() if m.steps or m.syncs]
    n = len(replicas)
    synced = [m for m in replicas if m.syncs]
    steps = max((m.trained()[0] for m in replicas), default=0)
    parameters = max((m.parameters() for m in replicas), default=0)
    eval_losses = [loss for m in replicas if (loss := m.latest_eval_loss()) is not None]
    losses = [m.steps[-1].loss for m in replicas if m.steps]  # none: the script logged none

    def mean(values: list[float]) -> float:
        return statistics.fmean(values) if values else 0.0

    throughput = fleet_throughput(metrics)

    return RunSummary(
        replicas=n,
        outer_steps=max((m.outer_step() for m in replicas), default=0),
        inner_steps_per_replica=steps,
        tokens=sum(m.trained()[1] for m in replicas),
        final_loss=mean(losses) if losses else None,
        eval_loss=eval_losses[-1] if eval_losses else None,
        bytes_up_per_replica=round(mean([_over_incarnations(m, "bytes_up") for m in synced])),
        bytes_down_per_replica=round(mean([_over_incarnations(m, "bytes_down") for m in synced])),
        data_parallel_bytes_per_replica=round(2 * (n - 1) / n * 4 * parameters * steps) if n else 0,
        sync_exposed_seconds=mean([_over_incarnations(m, "sync_exposed_seconds") for m in synced]),
        fleet_tokens_per_second=throughput.fleet_tokens_per_second if throughput else None,
        own_tokens_per_second=sum(throughput.own_tokens_per_second.values())
        if throughput
        else None,
    )


def data_coverage(config: RunConfig) -> Coverage | None:
    """Each epoch's coverage of the run's data, from its claims (None before the first)."""
    from diloco_anywhere.data.coverage import read_coverage  # SEALs: torch, loaded on use

    with Store(config.store_url()) as store:
        return read_coverage(store, RunLayout(config.run.name), config.run.min_replicas)


def plot_losses(metrics: dict[str, ReplicaMetrics], path: Path, title: str) -> Path:
    """Training loss per replica and held-out loss at each committed sync, against tokens;
    below it, one panel per number the training script logged of its own (``Training.log``)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    from matplotlib import pyplot

    names = sorted({name for m in metrics.values() for s in m.steps for name in s.values})
    figure, panels = pyplot.subplots(
        1 + len(names), 1, figsize=(8, 4.5 + 2.5 * len(names)), sharex=True, squeeze=False
    )
    axes = panels[0][0]
    for replica, m in sorted(metrics.items()):
        if m.steps:
            axes.plot([s.tokens for s in m.steps], [s.loss for s in m.steps], lw=1, label=replica)
    evals = [
        (s.tokens, s.eval_loss)
        for m in metrics.values()
        for s in m.syncs
        if s.committed and s.eval_loss is not None
    ]
    if evals:
        axes.scatter(*zip(*sorted(evals), strict=True), s=18, c="black", zorder=3,
                     label="held-out (global weights)")  # fmt: skip
    axes.set(xlabel="tokens per replica", ylabel="loss", title=title)
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:  # none when no replica recorded a step yet
        axes.legend(fontsize="small")
    for name, (panel,) in zip(names, panels[1:], strict=True):
        for replica, m in sorted(metrics.items()):
            points = [(s.tokens, s.values[name]) for s in m.steps if name in s.values]
            if points:
                panel.plot(*zip(*points, strict=True), lw=1, label=replica)
        panel.set(xlabel="tokens per replica", ylabel=name)
        limits = constant_limits([s.values[name] for m in metrics.values() for s in m.steps
                                  if name in s.values])  # fmt: skip
        if limits:
            panel.set_ylim(*limits)
        panel.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path


def constant_limits(values: list[float]) -> tuple[float, float] | None:
    """Y limits for a series that never changes (a constant learning rate): its value in the
    middle of an axis as wide as the value itself, instead of matplotlib's few percent, whose
    ticks read as variation. None for a series that changes."""
    if not values or min(values) != max(values):
        return None
    value = values[0]
    half = abs(value) or 1.0
    return value - half, value + half

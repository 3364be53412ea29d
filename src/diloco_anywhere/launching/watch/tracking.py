"""The run's metrics, from its bucket, in the trackers people already use.

Replicas write their metrics to the run's store only (``metrics.py``): no replica needs a
tracker's credentials or network, and every platform reports the same way. ``diloco report``
then copies them out, each replica as one run of a group named after the DiLoCo run:

- TensorBoard event files (``--tensorboard DIR``): ``DIR/{replica}/``, read by
  ``tensorboard --logdir DIR``;
- Weights & Biases (``--wandb PROJECT``): one W&B run per replica, ``group`` the run's name,
  ``id`` ``{run}-{replica}``; ``WANDB_API_KEY`` or ``wandb login`` as W&B reads them, and
  ``WANDB_MODE=offline`` to write them locally and ``wandb sync`` later.

The step of every point is the replica's tokens trained so far, the x-axis of ``diloco
report``'s plot: inner-step counts restart with each incarnation of a replica, tokens do not.
What each run gets: ``loss`` and the script's own numbers (``Training.log``) at every logged
step; at every sync, ``eval_loss`` (committed syncs that evaluated), ``tokens_per_second``,
``sync_exposed_seconds`` and the bytes sent and received.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from diloco_anywhere.training.records.metrics import ReplicaMetrics


class TrackerUnavailableError(RuntimeError):
    """The tracker's package is not installed; the message says which extra installs it."""


def points(metrics: ReplicaMetrics) -> Iterator[tuple[int, dict[str, float]]]:
    """(tokens, {name: value}) for every step and sync line, in the order written."""
    for step in metrics.steps:
        yield step.tokens, {"loss": step.loss, **step.values}
    for sync in metrics.syncs:
        values = {
            "tokens_per_second": sync.tokens_per_second,
            "sync_exposed_seconds": sync.sync_exposed_seconds,
            "bytes_up": float(sync.bytes_up),
            "bytes_down": float(sync.bytes_down),
        }
        if sync.committed and sync.eval_loss is not None:
            values["eval_loss"] = sync.eval_loss
        yield sync.tokens, values


def write_tensorboard(metrics: dict[str, ReplicaMetrics], folder: Path) -> list[Path]:
    """One TensorBoard run per replica under ``folder``; the folders written."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise TrackerUnavailableError(
            f"TensorBoard is not installed ({exc}): pip install 'diloco-anywhere[tensorboard]'"
        ) from None
    written = []
    for replica, replica_metrics in sorted(metrics.items()):
        with SummaryWriter(log_dir=str(folder / replica)) as writer:
            for tokens, values in sorted(points(replica_metrics), key=lambda p: p[0]):
                for name, value in values.items():
                    writer.add_scalar(name, value, global_step=tokens)
        written.append(folder / replica)
    return written


def write_wandb(metrics: dict[str, ReplicaMetrics], project: str, run: str) -> list[str]:
    """One W&B run per replica in ``project``, grouped as ``run``; their ids."""
    try:
        import wandb
    except ImportError as exc:
        raise TrackerUnavailableError(
            f"wandb is not installed ({exc}): pip install 'diloco-anywhere[wandb]'"
        ) from None
    ids = []
    try:
        for replica, replica_metrics in sorted(metrics.items()):
            tracked = wandb.init(
                project=project, group=run, name=replica, id=f"{run}-{replica}",
                job_type=replica_metrics.platform or "replica", resume="allow",
                reinit="create_new",
            )  # fmt: skip
            with tracked:
                for tokens, values in sorted(points(replica_metrics), key=lambda p: p[0]):
                    tracked.log({**values, "tokens": tokens}, step=tokens)
            ids.append(tracked.id)
    finally:
        # W&B keeps its settings (WANDB_DIR, the mode...) for the process once set up: end
        # them, so the next report in this process reads the environment again
        wandb.teardown()
    return ids

"""What a keeper pass watches besides each replica's job: the run's own health, as alerts.

- **Too few live replicas.** Fewer members leasing than ``run.min_replicas``: rounds cannot
  seal until some come back. Judged on the store's clock: a member is live while its newest
  lease is younger than the lease expiry (docs/collective.md, "Membership").
- **Stalled.** No round has sealed for ``[alerts] stalled_after`` seconds.
- **Diverged.** A replica found its global weights differ from the sealed contributors' (its
  ``diverged`` events): it healed, but something is wrong with it (docs/checkpoints.md).

Each alert's id names the newest sealed round (or the divergence's count), so one episode is
one message, however many passes observe it.
"""

from __future__ import annotations

from collections.abc import Mapping

from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.policy import LeasePolicy
from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.keep.alerts import Alert
from diloco_anywhere.training.records.metrics import ReplicaMetrics


def newest_seal(store: Store, layout: RunLayout) -> tuple[int, float] | None:
    """The newest sealed round and when the store sealed it (None before the first)."""
    sealed = [(r, key) for key in store.list_prefix(layout.rounds())
              if (r := layout.parse_seal(key)) is not None]  # fmt: skip
    if not sealed:
        return None
    round_, key = max(sealed)
    try:
        return round_, store.modified(key)
    except FileNotFoundError:  # collected meanwhile: a newer round has sealed
        return None


def health_alerts(
    store: Store,
    layout: RunLayout,
    config: RunConfig,
    active_at: Mapping[str, float | None],
    metrics: Mapping[str, ReplicaMetrics],
    now: float,
    started_at: float,
) -> list[Alert]:
    """The run's health alerts now. ``active_at``: each replica's last sign of life and
    ``now``, ``started_at`` (the launch), all in the store's time."""
    expiry = LeasePolicy(period=config.sync.lease_period).expiry
    live = sorted(r for r, at in active_at.items() if at is not None and now - at <= expiry)
    seal = newest_seal(store, layout)
    round_ = f"round-{seal[0]}" if seal else "start"
    alerts = []
    if len(live) < config.run.min_replicas and now - started_at > config.alerts.stalled_after:
        alerts.append(Alert(
            f"quorum.{round_}",
            f"{len(live)} replicas live ({', '.join(live) or 'none'}), fewer than "
            f"run.min_replicas = {config.run.min_replicas}: no round can seal",
        ))  # fmt: skip
    quiet = now - (seal[1] if seal else started_at)
    if quiet > config.alerts.stalled_after:
        since = f"since round {seal[0]}" if seal else "since the launch"
        alerts.append(Alert(f"stalled.{round_}", f"no round has sealed for {quiet / 60:.0f} "
                            f"min ({since}; [alerts] stalled_after = "
                            f"{config.alerts.stalled_after:g} s)"))  # fmt: skip
    for replica, seen in sorted(metrics.items()):
        count = seen.count("diverged")
        if count:
            alerts.append(Alert(f"diverged.{replica}.{count}", f"{replica}'s global weights "
                                f"differed from the others' ({count}x); it healed from the "
                                f"bucket: see `diloco logs {replica}`"))  # fmt: skip
    return alerts

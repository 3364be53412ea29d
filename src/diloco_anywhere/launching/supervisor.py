"""Follow a launch from the machine that started it (``diloco launch`` without ``--detach``).

The supervisor keeps the launch's current jobs for the live status table. With
``--restart-on-failure`` it runs the keeper (``keeper.py``) every few seconds, on every
platform of the launch: the one restart logic there is, whether a scheduled ``diloco keep``
or this follower observes an ended replica first (their create-only claims in the bucket let
exactly one of them act). What is restarted and what is not (stopped on purpose, a refused
run.toml, superseded, out of restarts) is the keeper's to say.
"""

from __future__ import annotations

import time

from diloco_anywhere.backends.base import ACTIVE_STATES, Backend, JobState, ReplicaHandle
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import with_changes
from diloco_anywhere.launching.keeper import Keeper, PassReport
from diloco_anywhere.launching.launch import LaunchPlan, job_state, run_launches

LOCAL_KEEP_SECONDS = 2.0  # a local process's end is seen at once
PAGE_EVERY = 60.0  # seconds between status pages while following: the live table is here
REMOTE_KEEP_SECONDS = 60.0  # platform APIs throttle (SageMaker's DescribeTrainingJob)


class Supervisor:
    """The jobs of one launch, kept current as the keeper restarts replicas."""

    def __init__(
        self,
        plan: LaunchPlan,
        started: dict[str, tuple[Backend, list[ReplicaHandle]]],
        max_restarts: int = 0,
    ) -> None:
        self.plan = plan
        self.backends = {platform: backend for platform, (backend, _) in started.items()}
        self.handles = [handle for _, handles in started.values() for handle in handles]
        self.launches = run_launches(plan.config)
        self.number = self.launches.numbers()[-1]  # the launch that started these jobs
        self.keeper = None
        if max_restarts:
            config = with_changes(plan.config, keep__max_restarts=max_restarts)
            self.keeper = Keeper(config, Store(config.store_url()), run_folder=plan.run_dir,
                                 backends=self.backends, page_every=PAGE_EVERY)  # fmt: skip
        self.every = REMOTE_KEEP_SECONDS if self.remote else LOCAL_KEEP_SECONDS
        self.kept_at = -self.every
        self.last: PassReport | None = None

    def state(self, handle: ReplicaHandle) -> JobState:
        return job_state(self.backends[handle.platform], handle)

    def active(self, handle: ReplicaHandle) -> bool:
        """Its job may not have ended: queued, running, or its platform cannot say now."""
        return self.state(handle) in ACTIVE_STATES

    @property
    def remote(self) -> bool:
        return any(backend.capabilities.remote for backend in self.backends.values())

    @property
    def restarting(self) -> bool:
        """The keeper's last pass is waiting to restart a replica, or has just restarted one."""
        decisions = self.last.decisions.values() if self.last else ()
        return any(decision.action in ("wait", "restart") for decision in decisions)

    def stopped(self) -> frozenset[str]:
        """The replicas of this launch stopped on purpose, from whichever machine."""
        return self.launches.stopped(self.number)

    def restart_failed(self) -> list[str]:
        """A keeper pass when one is due; what it did, one line each, for the user."""
        if self.keeper is None or time.monotonic() - self.kept_at < self.every:
            return []
        self.kept_at = time.monotonic()
        self.last = self.keeper.pass_()
        self.handles = self.launches.read(self.number).handles
        return self.last.notes

"""Restart crashed replicas (``diloco launch --restart-on-failure``).

Preemptible capacity and chaos runs need replicas that come back. A replica whose job failed
(crashed, was killed, or exited 1) is started again from its spec; the new process claims a new
incarnation and heals from the bucket (``healing.py``), so the run loses at most the inner
steps the dead one had not synced. Each restart is recorded in the launch's record in the
bucket (``launches.py``). Not restarted: a replica stopped on purpose (``diloco stop`` or
Ctrl-C leave a marker in the launch's record, since a torchrun replica exits 1 however it ends;
a lone process stopped by SIGTERM exits 143 or -15), one that refused its configuration (exit
2: it would only fail again), one superseded by a newer incarnation (exit 3), and none beyond
``max_restarts`` per replica. A torchrun replica torn down because one of its ranks crashed is
restarted. Replicas on remote platforms are retried by their platform (``[backends.*]`` retry
settings), not from here.
"""

from __future__ import annotations

import time
from collections import Counter

from diloco_anywhere.backends.base import ACTIVE_STATES, Backend, JobState, ReplicaHandle
from diloco_anywhere.launching.launch import LaunchPlan, job_state, run_launches, save_state
from diloco_anywhere.replica import EXIT_BAD_CONFIG, EXIT_STOPPED, EXIT_SUPERSEDED

NOT_RESTARTED = {
    EXIT_BAD_CONFIG: "bad configuration",
    EXIT_STOPPED: "stopped",
    -15: "stopped",
    EXIT_SUPERSEDED: "superseded by a newer incarnation",
}


class Supervisor:
    """The handles of one launch, kept current as replicas are restarted."""

    def __init__(
        self,
        plan: LaunchPlan,
        started: dict[str, tuple[Backend, list[ReplicaHandle]]],
        max_restarts: int = 0,
    ) -> None:
        self.plan, self.max_restarts = plan, max_restarts
        self.backends = {platform: backend for platform, (backend, _) in started.items()}
        self.handles = [handle for _, handles in started.values() for handle in handles]
        self.restarts: Counter[str] = Counter()
        self.launches = run_launches(plan.config)
        self.number = self.launches.numbers()[-1]  # the launch that started these jobs

    def state(self, handle: ReplicaHandle) -> JobState:
        return job_state(self.backends[handle.platform], handle)

    def active(self, handle: ReplicaHandle) -> bool:
        """Its job may not have ended: queued, running, or its platform cannot say now."""
        return self.state(handle) in ACTIVE_STATES

    @property
    def remote(self) -> bool:
        return any(backend.remote for backend in self.backends.values())

    def stopped(self) -> frozenset[str]:
        """The replicas of this launch stopped on purpose, from whichever machine."""
        return self.launches.stopped(self.number)

    def _record(self, handle: ReplicaHandle, attempt: int) -> None:
        """The restarted job, as attempt ``attempt`` of its replica in the launch's record."""
        self.launches.started(self.number, handle, attempt, time.time())

    def restart_failed(self) -> list[str]:
        """Restart every failed replica that may be; one line per decision, for the user."""
        notes = []
        for position, handle in enumerate(self.handles):
            backend = self.backends[handle.platform]
            if backend.remote:  # its platform retries it (Modal retries, HF attempts, k8s)
                continue
            if self.max_restarts == 0 or self.state(handle) != "failed":
                continue
            code = getattr(backend, "exit_code", lambda _: None)(handle)
            replica = handle.replica_id
            if code in NOT_RESTARTED or self.restarts[replica] >= self.max_restarts:
                continue
            if replica in self.stopped():
                continue
            spec = next(spec for spec in self.plan.specs if spec.replica_id == replica)
            self.handles[position] = backend.launch([spec], self.plan.run_dir)[0]
            self.restarts[replica] += 1
            self._record(self.handles[position], self.restarts[replica])
            notes.append(f"{replica} failed (exit {code}); restarted "
                         f"({self.restarts[replica]} of {self.max_restarts})")  # fmt: skip
        if notes:
            save_state(self.plan, self.handles)
        return notes

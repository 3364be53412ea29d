"""The disruptions of an unattended run: replicas SIGKILLed (preempted) or SIGSTOPped (hung,
then a zombie once woken) as the run reaches given rounds, on any of the three platforms.

They follow the run's progress, never the clock, on a thread of their own
(``following``): a keeper pass takes seconds on a loaded machine, in which a short run may
train past the rounds they are due at. Progress is read from the run's metrics, which lag it
by a few rounds under load: a run leaves them rounds of slack after the last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from diloco_anywhere.bench.train import Progress
from diloco_anywhere.config import RunConfig
from diloco_anywhere.launching.start.launch import run_launches
from diloco_anywhere.launching.start.launches import Launch
from diloco_anywhere.standins.hf_jobs import HfJobsStandIn
from diloco_anywhere.standins.kubernetes import K8sStandIn


@dataclass(frozen=True)
class Disruption:
    """``replica`` is SIGKILLed (``kill``: preempted) or SIGSTOPped until the keeper has started
    its next attempt, then woken (``freeze``: hung, then a zombie) once the run has committed
    ``after_round``."""

    replica: str
    after_round: int
    how: str


DISRUPTIONS = (
    Disruption("k8s-0", 5, "freeze"),  # early in its Job's time
    Disruption("local-0", 15, "kill"),
    Disruption("hf_jobs-0", 25, "kill"),
)


@dataclass
class Platforms:
    """Where each platform runs its replicas' processes: found to disrupt them."""

    hub: HfJobsStandIn
    cluster: K8sStandIn

    def pid(self, launch: Launch, replica: str) -> int | None:
        """The process group of ``replica``'s current job, None while it has no process."""
        job = launch.jobs[replica].job
        if replica.startswith("local"):
            return job["pid"]
        if replica.startswith("hf_jobs"):
            return self.hub.jobs[job["id"]].container.process.pid
        cluster_job = self.cluster.jobs.get((job["namespace"], job["name"]))
        pods = self.cluster.pods_of(cluster_job) if cluster_job else []
        running = [pod for pod in pods if pod.container is not None]
        return running[-1].container.process.pid if running else None


class Disrupter:
    """Applies the disruptions as the run reaches their rounds; wakes a frozen replica once
    the keeper has started its next attempt, and whatever is still frozen at the end."""

    def __init__(self, config: RunConfig, platforms: Platforms, plan: tuple[Disruption, ...]):
        self.config, self.platforms, self.pending = config, platforms, list(plan)
        self.done: list[Disruption] = []
        self.frozen: dict[str, tuple[int, int]] = {}  # replica -> (process group, attempt)

    def step(self, newest: int, progress: Progress) -> None:
        due = [d for d in self.pending if newest >= d.after_round]
        if not (due or self.frozen):
            return  # the launch record is read from the bucket only when there is work
        launch = run_launches(self.config).latest()
        for replica, (group, attempt) in list(self.frozen.items()):
            if launch.attempt(replica) > attempt:
                self._signal(group, signal.SIGCONT)
                del self.frozen[replica]
        for disruption in due:
            group = self.platforms.pid(launch, disruption.replica)
            how = signal.SIGSTOP if disruption.how == "freeze" else signal.SIGKILL
            if group is None or not self._signal(group, how):
                continue  # between attempts, or its process ended: try again on the next look
            if disruption.how == "freeze":
                self.frozen[disruption.replica] = (group, launch.attempt(disruption.replica))
            self.pending.remove(disruption)
            self.done.append(dataclasses.replace(disruption, after_round=newest))
            progress(f"round {newest}: {disruption.how} {disruption.replica}")

    def wake_all(self) -> None:
        for group, _ in self.frozen.values():
            self._signal(group, signal.SIGCONT)
        self.frozen.clear()

    @staticmethod
    def _signal(group: int, number: signal.Signals) -> bool:
        """Whether the signal reached a live process group: a replica whose process already
        ended was not disrupted (counted as done, a disruption that came after the run's last
        round would leave nothing for the keeper to do)."""
        try:
            os.killpg(group, number)
        except ProcessLookupError:
            return False
        return True


DISRUPT_EVERY = 0.25  # seconds between looks at the run's progress for a disruption due


@contextlib.contextmanager
def following(look: Callable[[], None]) -> Iterator[None]:
    """``look()`` every ``DISRUPT_EVERY`` seconds on a thread while the block runs; its first
    error ends the block's run (raised when the block leaves)."""
    done, failed = threading.Event(), []

    def follow() -> None:
        while not done.is_set():
            try:
                look()
            except Exception as exc:  # said when the block ends
                failed.append(exc)
                return
            done.wait(DISRUPT_EVERY)

    thread = threading.Thread(target=follow, name="disruptions", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    if failed:
        raise failed[0]

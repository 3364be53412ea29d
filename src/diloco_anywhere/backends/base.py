"""What every launcher does: start replicas from specs, and report, show logs of, and stop them.

A ``ReplicaSpec`` is platform-neutral: the replica's id and data shard, the environment that
tells the replica entrypoint who it is and where the run lives, and the arguments of the one
command every platform runs, ``python -m diloco_anywhere.replica``. A backend turns specs into
jobs and returns ``ReplicaHandle``s, small JSON-able records saved in the run folder, so that
``diloco status``, ``logs`` and ``stop`` work from another shell later. Secrets never go into a
spec or a handle: replicas take credentials from their platform's own mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

JobState = Literal["running", "exited", "failed", "stopped", "unknown"]


@dataclass(frozen=True)
class ReplicaSpec:
    replica_id: str  # "{platform}-{k}": unique in the run
    index: int  # data shard, 0 .. replicas - 1 across all platforms
    platform: str
    env: dict[str, str]  # DILOCO_* variables; no secrets
    args: tuple[str, ...]  # after ``python -m diloco_anywhere.replica``
    processes: int = 1  # > 1: one per GPU under torchrun, DDP inside the replica

    def command(self, python: str = "python") -> list[str]:
        """The replica's command: the entrypoint, under ``torchrun`` (``torch.distributed.run``,
        one node, a free port) when the replica has several processes."""
        entrypoint = ["-m", "diloco_anywhere.replica", *self.args]
        if self.processes == 1:
            return [python, *entrypoint]
        torchrun = ["-m", "torch.distributed.run", "--standalone"]
        return [python, *torchrun, f"--nproc-per-node={self.processes}", *entrypoint]


@dataclass(frozen=True)
class ReplicaHandle:
    replica_id: str
    platform: str
    job: dict[str, Any] = field(default_factory=dict)  # the platform's job reference


class Backend(Protocol):
    name: str

    def launch(self, specs: list[ReplicaSpec], run_dir: Path) -> list[ReplicaHandle]: ...

    def state(self, handle: ReplicaHandle) -> JobState: ...

    def logs(self, handle: ReplicaHandle) -> str: ...

    def stop(self, handle: ReplicaHandle) -> None: ...

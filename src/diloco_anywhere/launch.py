"""Plan a run's replicas across backends, start them, and remember them in the run folder.

The plan gives every replica an id (``{platform}-{k}``) and a data shard (0..N-1 across all
platforms), and the environment the replica entrypoint reads (``replica.py``). The handles go
to ``{run folder}/launch.json`` so that ``diloco status``, ``logs`` and ``stop`` find them
from any shell. The run folder is ``.diloco/{run name}`` under the current directory.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from diloco_anywhere import replica
from diloco_anywhere.backends import get_backend
from diloco_anywhere.backends.base import Backend, ReplicaHandle, ReplicaSpec
from diloco_anywhere.config import RunConfig
from diloco_anywhere.layout import RunLayout
from diloco_anywhere.metrics import MetricsReader
from diloco_anywhere.store import Store, redact_url

STATE_FILE = "launch.json"
STOPPED_FOLDER = "stopped"  # one empty file per replica that `diloco stop` stopped on purpose


def run_dir(config: RunConfig, root: Path | None = None) -> Path:
    return (root or Path.cwd()) / ".diloco" / config.run.name


@dataclass(frozen=True)
class LaunchPlan:
    config: RunConfig
    run_dir: Path
    specs: tuple[ReplicaSpec, ...]


def plan_launch(config: RunConfig, counts: dict[str, int], root: Path | None = None) -> LaunchPlan:
    """``counts``: replicas per backend, e.g. ``{"local": 4}``; their sum is the run's size."""
    total = sum(counts.values())
    args = ("--config", str(config.source)) if config.source else ()
    common = {
        replica.ENV_RUN: config.run.name,
        replica.ENV_STORE: config.store_url(),
        replica.ENV_REPLICAS: str(total),
    }
    specs, index = [], 0
    for platform, count in counts.items():
        processes = processes_per_replica(config, platform)
        for k in range(count):
            replica_id = f"{platform}-{k}"
            env = {
                **common,
                replica.ENV_REPLICA_ID: replica_id,
                replica.ENV_REPLICA_INDEX: str(index),
                replica.ENV_PLATFORM: platform,
            }
            specs.append(ReplicaSpec(replica_id, index, platform, env, args, processes))
            index += 1
    return LaunchPlan(config, run_dir(config, root), tuple(specs))


def processes_per_replica(config: RunConfig, platform: str) -> int:
    """``[backends.<platform>] processes_per_replica`` (default 1): a replica of several
    processes runs under torchrun, one per GPU, with DDP inside the replica."""
    value = config.backends.get(platform, {}).get("processes_per_replica", 1)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(
            f"backends.{platform}.processes_per_replica = {value!r}: give a whole number >= 1 "
            f"(processes per replica, usually its GPU count)"
        )
    return value


def run_metrics(config: RunConfig) -> MetricsReader:
    """A reader of the run's metrics in its store."""
    return MetricsReader(Store(config.store_url()), RunLayout(config.run.name))


def store_has_run(config: RunConfig) -> bool:
    return bool(Store(config.store_url()).list_prefix(RunLayout(config.run.name).run))


def delete_run_objects(config: RunConfig) -> int:
    """Delete every object of this run from its store (rounds, members, metrics)."""
    return Store(config.store_url()).delete_prefix(RunLayout(config.run.name).run)


def mark_stopped(run_folder: Path, replica_id: str) -> None:
    """Record that ``replica_id`` is being stopped on purpose, so it is not restarted."""
    (run_folder / STOPPED_FOLDER).mkdir(parents=True, exist_ok=True)
    (run_folder / STOPPED_FOLDER / replica_id).touch()


def stopped_on_purpose(run_folder: Path, replica_id: str) -> bool:
    return (run_folder / STOPPED_FOLDER / replica_id).exists()


def start(plan: LaunchPlan) -> dict[str, tuple[Backend, list[ReplicaHandle]]]:
    """Start every replica, platform by platform; save the handles as they come. Stops
    recorded for an earlier launch of the run no longer apply."""
    for marker in (plan.run_dir / STOPPED_FOLDER).glob("*"):
        marker.unlink()
    started: dict[str, tuple[Backend, list[ReplicaHandle]]] = {}
    for platform in dict.fromkeys(spec.platform for spec in plan.specs):
        backend = get_backend(platform)
        specs = [spec for spec in plan.specs if spec.platform == platform]
        started[platform] = (backend, backend.launch(specs, plan.run_dir))
        save_state(plan, [h for _, handles in started.values() for h in handles])
    return started


def save_state(plan: LaunchPlan, handles: list[ReplicaHandle]) -> None:
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "run": plan.config.run.name,
        "store": redact_url(plan.config.store_url()),
        "replicas": [asdict(handle) for handle in handles],
    }
    (plan.run_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def load_handles(config: RunConfig, root: Path | None = None) -> list[ReplicaHandle]:
    """The handles of the run's last launch ([] when it was never launched from here)."""
    path = run_dir(config, root) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    return [ReplicaHandle(**handle) for handle in state["replicas"]]

"""Plan a run's replicas across backends, start them, and remember them in the run folder.

The plan gives every replica an id (``{platform}-{k}``) and a data shard (0..N-1 across all
platforms), and the environment the replica entrypoint reads (``replica.py``). The handles go
to ``{run folder}/launch.json`` so that ``diloco status``, ``logs`` and ``stop`` find them
from any shell. The run folder is ``.diloco/{run name}`` under the current directory.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from diloco_anywhere import replica
from diloco_anywhere.backends import get_backend
from diloco_anywhere.backends.base import (
    Backend,
    JobState,
    ReplicaHandle,
    ReplicaSpec,
    one_line,
    stop_all,
)
from diloco_anywhere.bucket.layout import RunLayout
from diloco_anywhere.bucket.store import Store, redact_url
from diloco_anywhere.config import ConfigError, RunConfig
from diloco_anywhere.launching import published_config
from diloco_anywhere.training.metrics import MetricsReader
from diloco_anywhere.training.mirrors import Resumed, latest_commits, resume_from

log = logging.getLogger("diloco_anywhere.launching.launch")
STATE_FILE = "launch.json"
STOPPED_FOLDER = "stopped"  # one empty file per replica that `diloco stop` stopped on purpose


def run_dir(config: RunConfig, root: Path | None = None) -> Path:
    return (root or Path.cwd()) / ".diloco" / config.run.name


@dataclass(frozen=True)
class LaunchPlan:
    config: RunConfig
    run_dir: Path
    specs: tuple[ReplicaSpec, ...]
    backends: dict[str, Backend]  # one launcher per platform of the launch, settings checked
    config_key: str | None = None  # where remote replicas read run.toml (published at start)

    def specs_on(self, platform: str) -> list[ReplicaSpec]:
        return [spec for spec in self.specs if spec.platform == platform]


def plan_launch(config: RunConfig, counts: dict[str, int], root: Path | None = None) -> LaunchPlan:
    """``counts``: replicas per backend, e.g. ``{"local": 4}``; their sum is the run's size.
    Validates every platform's ``[backends.*]`` settings; contacts nothing."""
    backends = {platform: get_backend(platform, config) for platform in counts}
    if config.run.sharding == "fsdp":
        check_same_ranks(backends)
    remote = [platform for platform, backend in backends.items() if backend.remote]
    if remote:
        check_remote_store(config, remote)
    config_key = published_config.config_key(config) if remote else None
    local_args = ("--config", str(config.source)) if config.source else ()
    common = {
        replica.ENV_RUN: config.run.name,
        replica.ENV_STORE: config.store_url(),
        replica.ENV_REPLICAS: str(sum(counts.values())),
    }
    specs, index = [], 0
    for platform, count in counts.items():
        backend = backends[platform]
        args = () if backend.remote else local_args
        published = {published_config.ENV_CONFIG_KEY: config_key} if backend.remote else {}
        processes = backend.settings.processes_per_replica
        for k in range(count):
            replica_id = f"{platform}-{k}"
            env = {
                **common,
                **published,
                replica.ENV_REPLICA_ID: replica_id,
                replica.ENV_REPLICA_INDEX: str(index),
                replica.ENV_PLATFORM: platform,
            }
            specs.append(ReplicaSpec(replica_id, index, platform, env, args, processes))
            index += 1
    return LaunchPlan(config, run_dir(config, root), tuple(specs), backends, config_key)


def check_same_ranks(backends: dict[str, Backend]) -> None:
    """Rank r of every replica of a sharded run exchanges shard r: every replica needs the
    same number of ranks, whatever platform runs it."""
    processes = {p: b.settings.processes_per_replica for p, b in backends.items()}
    if len(set(processes.values())) > 1:
        found = ", ".join(f"{platform} {count}" for platform, count in processes.items())
        raise ConfigError(
            f"run.sharding = 'fsdp' needs the same processes_per_replica on every backend of "
            f"the launch (found {found}): rank r of every replica exchanges shard r"
        )


def check_remote_store(config: RunConfig, platforms: list[str]) -> None:
    """Replicas elsewhere need buckets they can reach (the store and every checkpoint mirror),
    and credentials from their platform, never inside a URL (it travels in job specs and
    logs)."""
    urls = {"run.store": config.store_url()}
    urls |= {f"checkpoint.mirrors.{i}": url for i, url in enumerate(config.mirror_urls())}
    for field, url in urls.items():
        parts = urlsplit(url)
        if parts.scheme in ("", "file", "local", "memory"):
            raise ConfigError(
                f"{field} = {redact_url(url)!r} is on this machine, which replicas on "
                f"{', '.join(platforms)} cannot reach: use a bucket (s3://, gs://, az://, "
                f"hf://buckets/)"
            )
        if ":" in parts.netloc.rpartition("@")[0] or parts.query:  # user:secret@, SAS tokens
            raise ConfigError(
                f"{field} = {redact_url(url)!r} carries credentials in the URL: remove them "
                f"and give each platform its own (docs/backends.md)"
            )


def run_metrics(config: RunConfig) -> MetricsReader:
    """A reader of the run's metrics in its store."""
    return MetricsReader(Store(config.store_url()), RunLayout(config.run.name))


def store_has_run(config: RunConfig) -> bool:
    return bool(Store(config.store_url()).list_prefix(RunLayout(config.run.name).run))


def delete_run_objects(config: RunConfig) -> int:
    """Delete every object of this run from its store (rounds, members, metrics)."""
    return Store(config.store_url()).delete_prefix(RunLayout(config.run.name).run)


def resume_plan(config: RunConfig, url: str, *, fresh: bool) -> dict[str, Any]:
    """What ``--resume-from url`` would do (``--dry-run``), from listings and COMMITs only:
    the mirror's committed checkpoints, the latest first (the first that reads back intact is
    taken), and what becomes of the run's objects in its store."""
    layout = RunLayout(config.run.name)
    with Store(config.resolve(url)) as mirror, Store(config.store_url()) as store:
        latest, damaged = latest_commits(mirror, layout)
        held = bool(store.list_prefix(layout.run))
        return {
            "mirror": mirror.url,
            "checkpoints": [
                {"round": c.round, "committed": datetime.fromtimestamp(c.time, UTC).isoformat()}
                for c in latest
            ],
            "damaged": damaged,
            "store": "deleted first (--fresh)" if held and fresh
            else "holds the run: refused without --fresh" if held else "empty",
        }  # fmt: skip


def resume_from_mirror(config: RunConfig, url: str, *, fresh: bool) -> Resumed:
    """Put the latest intact checkpoint of the run in the mirror at ``url`` into the run's
    store, which lost the run (``mirrors.resume_from``); the replicas launched next heal from
    it."""
    with Store(config.store_url()) as store:
        return resume_from(config.resolve(url), store, RunLayout(config.run.name), fresh=fresh)


def mark_stopped(run_folder: Path, replica_id: str) -> None:
    """Record that ``replica_id`` is being stopped on purpose, so it is not restarted."""
    (run_folder / STOPPED_FOLDER).mkdir(parents=True, exist_ok=True)
    (run_folder / STOPPED_FOLDER / replica_id).touch()


def stopped_replicas(run_folder: Path) -> set[str]:
    """The replicas of the current launch that were stopped on purpose (see ``mark_stopped``)."""
    return {marker.name for marker in (run_folder / STOPPED_FOLDER).glob("*")}


class LaunchError(RuntimeError):
    """A platform failed to start its replicas; the message says what became of the others."""


def describe(plan: LaunchPlan) -> dict[str, list[dict[str, Any]]]:
    """What each platform would be sent (``--dry-run``), secret values masked."""
    return {
        platform: backend.describe(plan.specs_on(platform))
        for platform, backend in plan.backends.items()
    }


def dry_run_on_servers(plan: LaunchPlan) -> dict[str, Any]:
    """Each platform's own verdict on what ``start`` would submit, where it offers one;
    credentials are checked first, nothing is started."""
    results: dict[str, Any] = {}
    for platform, backend in plan.backends.items():
        backend.check()
        server_dry_run = getattr(backend, "server_dry_run", None)
        results[platform] = (
            server_dry_run(plan.specs_on(platform)) if server_dry_run
            else f"{platform} has no server-side dry run; --dry-run shows its requests"
        )  # fmt: skip
    return results


def backends_for(handles: list[ReplicaHandle], config: RunConfig) -> dict[str, Backend]:
    """A launcher for each platform the handles are on (to ask about or stop their jobs)."""
    return {platform: get_backend(platform, config) for platform in {h.platform for h in handles}}


def job_state(backend: Backend, handle: ReplicaHandle) -> JobState:
    """The replica's job state; ``unknown`` when its platform cannot be asked right now (an
    outage, a throttled API, expired credentials): a status must not fail on one platform."""
    try:
        return backend.state(handle)
    except Exception as exc:
        log.warning("state of %s on %s: %s", handle.replica_id, handle.platform, one_line(exc))
        return "unknown"


def refuse_if_running(plan: LaunchPlan) -> None:
    """A relaunch replaces launch.json: jobs of the last launch that still run would lose
    their handles (and replicas with the same ids would join twice)."""
    handles = handles_in(plan.run_dir)
    backends = backends_for(handles, plan.config)
    running = [h.replica_id for h in handles
               if job_state(backends[h.platform], h) in ("pending", "running")]  # fmt: skip
    if running:
        raise LaunchError(
            f"{len(running)} replicas of the last launch of run {plan.config.run.name} are "
            f"still running ({', '.join(running)}): `diloco stop` them first"
        )


def start(plan: LaunchPlan) -> dict[str, tuple[Backend, list[ReplicaHandle]]]:
    """Check every platform can start (SDK, credentials), publish run.toml for remote
    replicas, then start platform by platform, saving the handles as they come. If one
    platform fails, or the user presses Ctrl-C, the replicas already started are stopped: no
    paid job is left orphaned. Stops recorded for an earlier launch no longer apply."""
    for backend in plan.backends.values():
        backend.check()
    refuse_if_running(plan)
    if plan.config_key:
        with Store(plan.config.store_url()) as store:
            published_config.publish_config(store, plan.config)
    for marker in (plan.run_dir / STOPPED_FOLDER).glob("*"):
        marker.unlink()
    started: dict[str, tuple[Backend, list[ReplicaHandle]]] = {}
    for platform, backend in plan.backends.items():
        try:
            started[platform] = (backend, backend.launch(plan.specs_on(platform), plan.run_dir))
            save_state(plan, [h for _, handles in started.values() for h in handles])
        except Exception as exc:
            own = getattr(exc, "started", [])  # this platform's jobs, already told to stop
            others = roll_back(plan, started, own)
            raise LaunchError(f"{platform} failed to start its replicas: {one_line(exc)}; "
                              f"other platforms: {others}") from exc  # fmt: skip
        except BaseException:  # Ctrl-C: nothing started may be left running
            roll_back(plan, started, [])
            raise
    return started


def roll_back(
    plan: LaunchPlan,
    started: dict[str, tuple[Backend, list[ReplicaHandle]]],
    stopped_already: list[ReplicaHandle],
) -> str:
    """Stop what a failed launch had started (not to be restarted), and keep every handle in
    launch.json so that `diloco stop` can try again on any whose stop failed."""
    handles = [handle for _, platform_handles in started.values() for handle in platform_handles]
    for handle in handles + stopped_already:
        mark_stopped(plan.run_dir, handle.replica_id)
    report = stop_all(handles, lambda handle: plan.backends[handle.platform].stop(handle))
    save_state(plan, handles + stopped_already)
    return str(report)


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
    return handles_in(run_dir(config, root))


def handles_in(run_folder: Path) -> list[ReplicaHandle]:
    path = run_folder / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    return [ReplicaHandle(**handle) for handle in state["replicas"]]

"""Plan a run's replicas across backends, start them, and remember them in the run's bucket.

The plan gives every replica an id (``{platform}-{k}``) and a data shard (0..N-1 across all
platforms), and the environment the replica entrypoint reads (``replica.py``). What a launch
started goes to the bucket (``launches.py``), so that ``diloco status``, ``logs``, ``stop``
and the next ``launch`` find it from any machine; ``{run folder}/launch.json`` keeps a copy.
The run folder is ``.diloco/{run name}`` under the current directory (logs of local replicas,
the report).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from diloco_anywhere import contract, published_config
from diloco_anywhere.backends import get_backend
from diloco_anywhere.backends.base import (
    ACTIVE_STATES,
    Backend,
    JobState,
    ReplicaHandle,
    ReplicaSpec,
    one_line,
    stop_all,
)
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.redaction import redact_url
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.collective.members.membership import watch_live
from diloco_anywhere.collective.policy import LeasePolicy
from diloco_anywhere.config import ConfigError, RunConfig
from diloco_anywhere.launching.start.launches import EndRecord, Launches
from diloco_anywhere.launching.watch.status import replica_skews
from diloco_anywhere.training.records.metrics import MetricsReader

if TYPE_CHECKING:
    from diloco_anywhere.training.recovery.mirrors import Resumed

log = logging.getLogger("diloco_anywhere.launching.start.launch")
STATE_FILE = "launch.json"  # a copy of the newest launch's handles; the bucket holds the record


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
    remote = [platform for platform, backend in backends.items() if backend.capabilities.remote]
    if remote:
        check_remote_store(config, remote)
    # every replica is told the run's run.toml: remote ones read it, local ones read their
    # file and are refused if it trains otherwise (edited since, ``contract.configuration``)
    config_key = published_config.config_key(config)
    local_args = ("--config", str(config.source)) if config.source else ()
    common = {
        contract.ENV_RUN: config.run.name,
        contract.ENV_STORE: config.store_url(),
        contract.ENV_REPLICAS: str(sum(counts.values())),
    }
    specs, index = [], 0
    for platform, count in counts.items():
        backend = backends[platform]
        elsewhere = backend.capabilities.remote  # reads run.toml from the store
        args = () if elsewhere else local_args
        published = {published_config.ENV_CONFIG_KEY: config_key}
        processes = backend.settings.processes_per_replica
        for k in range(count):
            replica_id = replica_id_of(platform, k)
            env = {
                **common,
                **published,
                contract.ENV_REPLICA_ID: replica_id,
                contract.ENV_REPLICA_INDEX: str(index),
                contract.ENV_PLATFORM: platform,
            }
            specs.append(ReplicaSpec(replica_id, index, platform, env, args, processes))
            index += 1
    return LaunchPlan(config, run_dir(config, root), tuple(specs), backends, config_key)


def replica_id_of(platform: str, k: int) -> str:
    """The id of a platform's k-th replica: stable across launches, whatever other platforms
    are added (a replica's id names its objects in the bucket)."""
    return f"{platform}-{k}"


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


def run_skews(config: RunConfig) -> dict[str, float | None]:
    """Each replica's clock against the store's, from its lease (``status.replica_skews``)."""
    return replica_skews(Store(config.store_url()), RunLayout(config.run.name))


def run_launches(config: RunConfig) -> Launches:
    """The run's launch records in its store."""
    return Launches(Store(config.store_url()), RunLayout(config.run.name))


def in_last_launch_order(config: RunConfig, counts: dict[str, int]) -> dict[str, int]:
    """``counts`` with its platforms in the order of the run's last launch, platforms new to
    this one after them: replica ``{platform}-{k}``'s data shard index follows the launch's
    order of platforms (``plan_launch``), so a launch whose ``--backend`` options are only
    ordered otherwise gives every replica id the index it had."""
    latest = run_launches(config).latest()
    if latest is None:
        return counts
    before = list(dict.fromkeys(replica.platform for replica in latest.record.replicas))
    position = {platform: k for k, platform in enumerate(before)}
    return dict(sorted(counts.items(), key=lambda item: position.get(item[0], len(before))))


def store_has_run(config: RunConfig) -> bool:
    return bool(Store(config.store_url()).list_prefix(RunLayout(config.run.name).run))


def delete_run_objects(config: RunConfig) -> int:
    """Delete every object of this run from its store (rounds, members, metrics)."""
    return Store(config.store_url()).delete_prefix(RunLayout(config.run.name).run)


def resume_plan(config: RunConfig, url: str, *, fresh: bool) -> dict[str, Any]:
    """What ``--resume-from url`` would do (``--dry-run``), from listings and COMMITs only:
    the mirror's committed checkpoints, the latest first (the first that reads back intact is
    taken), and what becomes of the run's objects in its store."""
    from diloco_anywhere.training.recovery.mirrors import (
        latest_commits,  # torch: this command's only
    )

    layout = RunLayout(config.run.name)
    with Store(config.resolve(url)) as mirror, Store(config.store_url()) as store:
        latest, damaged = latest_commits(mirror, layout)
        held = bool(store.list_prefix(layout.run))
        return {
            "mirror": mirror.url,
            "checkpoints": [
                {"round": c.round,
                 "committed": datetime.fromtimestamp(c.time, timezone.utc).isoformat()}
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
    from diloco_anywhere.training.recovery.mirrors import resume_from  # torch: this command's only

    with Store(config.store_url()) as store:
        return resume_from(config.resolve(url), store, RunLayout(config.run.name), fresh=fresh)


@dataclass(frozen=True)
class RecordedLaunch:
    """The run's newest launch: its replicas' current jobs, those stopped on purpose, and how
    a keeper ended it (None while it goes on)."""

    handles: list[ReplicaHandle]
    stopped: frozenset[str]
    end: EndRecord | None = None


def recorded_launch(config: RunConfig, run_folder: Path | None = None) -> RecordedLaunch:
    """From the bucket, whichever machine launched; else from this machine's run folder."""
    latest = run_launches(config).latest()
    if latest is not None:
        return RecordedLaunch(latest.handles, latest.stopped, latest.end)
    return RecordedLaunch(handles_in(run_folder or run_dir(config)), frozenset())


def load_handles(config: RunConfig, root: Path | None = None) -> list[ReplicaHandle]:
    """The handles of the run's newest launch ([] when it was never launched)."""
    return recorded_launch(config, run_dir(config, root)).handles


def mark_stopped(config: RunConfig, replica_ids: list[str]) -> None:
    """Record in the bucket that the current attempts of ``replica_ids`` of the newest launch
    are being stopped on purpose, so that nothing restarts them."""
    launches = run_launches(config)
    latest = launches.latest()
    for replica_id in replica_ids if latest else ():
        launches.mark_stopped(latest.number, replica_id, latest.attempt(replica_id))


class LaunchError(RuntimeError):
    """A platform failed to start its replicas; the message says what became of the others."""


def describe(plan: LaunchPlan) -> dict[str, list[dict[str, Any]]]:
    """What each platform would be sent (``--dry-run``), secret values masked."""
    return {
        platform: backend.describe(plan.specs_on(platform))
        for platform, backend in plan.backends.items()
    }


def dry_run_on_servers(plan: LaunchPlan) -> dict[str, Any]:
    """Each platform's own verdict on what ``start`` would submit, where it offers one
    (``capabilities.server_dry_run``); credentials are checked first, nothing is started."""
    results: dict[str, Any] = {}
    for platform, backend in plan.backends.items():
        backend.check()
        results[platform] = (
            backend.server_dry_run(plan.specs_on(platform))
            if backend.capabilities.server_dry_run
            else f"{platform} has no server-side dry run; --dry-run shows its requests"
        )
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


def refuse_if_live(plan: LaunchPlan, *, fresh: bool, say: Callable[[str], None]) -> None:
    """A launch onto a run that is still going would start every replica a second time under
    the same ids (the old ones keep billing, and are superseded). Refused when the newest
    launch in the bucket has a job that may still run (``pending``, ``running``, or
    ``unknown``: its platform cannot say), or a member's lease still advances (a replica
    started some other way); with ``fresh``, the newest launch's jobs are stopped first
    instead (its replicas lose their claims when the run's objects go, and end themselves)."""
    config = plan.config
    launch = recorded_launch(config, plan.run_dir)
    backends = backends_for(launch.handles, config)
    active = {h.replica_id: (h, state) for h in launch.handles
              if (state := job_state(backends[h.platform], h)) in ACTIVE_STATES}  # fmt: skip
    if fresh:
        if active:
            say(f"--fresh: stopping the {len(active)} replicas of the last launch first")
            stop_the_last_launch(config, [h for h, _ in active.values()], backends)
        return
    lease = LeasePolicy(period=config.sync.lease_period)
    layout = RunLayout(config.run.name)
    with Store(config.store_url()) as store:
        if store.list_prefix(layout.members()):
            say(f"checking that no replica of run {config.run.name} is alive (their leases, "
                f"up to {lease.expiry:g} s)")  # fmt: skip
            live = {m.replica for m in watch_live(store, layout, lease)}
        else:
            live = set()
    running = [f"{r} ({h.platform} job {state}{', its platform cannot say' * (state == 'unknown')})"
               for r, (h, state) in sorted(active.items())]  # fmt: skip
    running += [f"{r} (its lease advances)" for r in sorted(live - active.keys())]
    if running:
        raise LaunchError(
            f"run {config.run.name} is still going: {', '.join(running)}. Stop it first with "
            f"`diloco stop` (from any machine that reaches its bucket and platforms), or "
            f"start over with `diloco launch --fresh`, which stops the last launch's replicas"
        )


def stop_the_last_launch(
    config: RunConfig, handles: list[ReplicaHandle], backends: dict[str, Backend]
) -> None:
    """Stop ``handles`` on purpose (marked first, so nothing restarts them); ``LaunchError``
    naming any whose stop failed."""
    mark_stopped(config, [handle.replica_id for handle in handles])
    report = stop_all(handles, lambda handle: backends[handle.platform].stop(handle))
    if report.left:
        raise LaunchError(f"--fresh could not stop the last launch: {report}")


def prepare_store(
    plan: LaunchPlan, *, fresh: bool, resume_from: str | None, say: Callable[[str], None]
) -> int:
    """Refuse a run that is still going (``refuse_if_live``), then put the store in the state
    the launch starts from: a mirror's checkpoint copied in (``resume_from``), emptied
    (``fresh``), or as it is (a run with objects resumes from its checkpoints). Returns the
    launch number that follows the launches checked, for ``start`` to take."""
    checked = run_launches(plan.config).numbers()
    refuse_if_live(plan, fresh=fresh, say=say)
    config = plan.config
    if resume_from is not None:
        say(resume_from_mirror(config, resume_from, fresh=fresh).describe())
    elif store_has_run(config):
        if fresh:
            delete_run_objects(config)
        else:
            say(f"run {config.run.name} has objects in {redact_url(config.run.store)}: "
                f"resuming it (--fresh starts over)")  # fmt: skip
    return 0 if fresh else max(checked, default=-1) + 1


def start(
    plan: LaunchPlan, number: int | None = None
) -> dict[str, tuple[Backend, list[ReplicaHandle]]]:
    """Check every platform can start (SDK, credentials), publish run.toml for remote
    replicas, take launch ``number`` in the bucket (``prepare_store``'s; by default the next
    one), then start platform by platform,
    recording each job as it comes. If one platform fails, or the user presses Ctrl-C, the
    replicas already started are stopped: no paid job is left orphaned."""
    for backend in plan.backends.values():
        backend.check()
    config = plan.config
    with Store(config.store_url()) as store:
        if plan.config_key:
            published_config.publish_config(store, config)
        launches = Launches(store, RunLayout(config.run.name))
        images = {platform: backend.image() for platform, backend in plan.backends.items()
                  if backend.capabilities.remote}  # fmt: skip
        record = launches.begin(plan.specs, plan.config_key, images, time.time(), number)
        number = record.number
        started: dict[str, tuple[Backend, list[ReplicaHandle]]] = {}
        for platform, backend in plan.backends.items():
            try:
                handles = backend.launch(plan.specs_on(platform), plan.run_dir)
                started[platform] = (backend, handles)
                for handle in handles:
                    launches.started(number, handle, 0, time.time())
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
    the record so that `diloco stop` can try again on any whose stop failed."""
    handles = [handle for _, platform_handles in started.values() for handle in platform_handles]
    mark_stopped(plan.config, [handle.replica_id for handle in handles + stopped_already])
    report = stop_all(handles, lambda handle: plan.backends[handle.platform].stop(handle))
    save_state(plan, handles + stopped_already)
    return str(report)


def save_state(plan: LaunchPlan, handles: list[ReplicaHandle]) -> None:
    """This machine's copy of the newest launch's handles (the bucket holds the record)."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "run": plan.config.run.name,
        "store": redact_url(plan.config.store_url()),
        "replicas": [asdict(handle) for handle in handles],
    }
    (plan.run_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def handles_in(run_folder: Path) -> list[ReplicaHandle]:
    path = run_folder / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    return [ReplicaHandle(**handle) for handle in state["replicas"]]

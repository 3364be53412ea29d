"""``diloco launch``: a run's replicas planned, priced, started on their platforms and followed
until the run ends (the tables it prints are in ``tables.py``)."""

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live
from rich.markup import escape

from diloco_anywhere.backends import BACKENDS
from diloco_anywhere.backends.base import (
    ACTIVE_STATES,
    ReplicaHandle,
    ReplicaSpec,
    stop_all,
)
from diloco_anywhere.bucket.format.layout import parse_count
from diloco_anywhere.bucket.redaction import redact_url
from diloco_anywhere.cli.common import (
    ConfigPath,
    interrupted_by_sigterm,
    print_json,
    stderr,
    stdout,
    user_errors,
)
from diloco_anywhere.cli.tables import (
    coverage_table,
    status_table,
    summary_table,
)
from diloco_anywhere.config import RunConfig, load_config, validate_config
from diloco_anywhere.contract import ENV_STORE
from diloco_anywhere.launching.cost.forecast import forecast
from diloco_anywhere.launching.keep.supervisor import Outcome, Supervisor, outcome
from diloco_anywhere.launching.start.launch import (
    LaunchPlan,
    describe,
    dry_run_on_servers,
    in_last_launch_order,
    mark_stopped,
    plan_launch,
    prepare_store,
    resume_plan,
    run_metrics,
    run_skews,
    start,
)
from diloco_anywhere.launching.watch.report import RunSummary, data_coverage, plot_losses, summarize
from diloco_anywhere.launching.watch.status import (
    ReplicaStatus,
    replica_statuses,
)

LOCAL_POLL_SECONDS = 1.0
REMOTE_POLL_SECONDS = 10.0
SKEW_POLL_SECONDS = 30.0  # replicas measure their clocks every 30 leases


def _shown(spec: ReplicaSpec) -> dict:
    """A spec as --dry-run prints it: the store URL without credentials or query."""
    env = {**spec.env, ENV_STORE: redact_url(spec.env[ENV_STORE])}
    return {**asdict(spec), "env": env, "args": list(spec.args)}


def parse_backends(values: list[str], config: RunConfig, replicas: int | None) -> dict[str, int]:
    """Replicas per platform. ``["modal=2", "local=1"]`` -> those counts; ``["modal"]`` ->
    ``--replicas``, else ``[backends.modal] replicas``, else ``run.replicas``. No ``--backend``:
    every ``[backends.*]`` section that sets ``replicas`` (the run's usual mix), else local."""
    configured = configured_replicas(config)
    if not values:
        values = [f"{name}={count}" for name, count in configured.items()] or ["local"]
    counts = {}
    for value in values:
        name, _, count = value.partition("=")
        if name not in BACKENDS:
            raise ValueError(f"--backend {value!r}: choose from {', '.join(BACKENDS)}")
        if not count and len(values) > 1:
            raise ValueError(f"--backend {value!r}: with several backends give each a count")
        number = parse_count(count) if count else None
        if count and not number:
            raise ValueError(f"--backend {value!r}: the count must be a whole number >= 1")
        counts[name] = number or replicas or configured.get(name, config.run.replicas)
    return counts


def configured_replicas(config: RunConfig) -> dict[str, int]:
    """``[backends.<platform>] replicas`` of every platform that sets it; a section of no
    known platform (a typo would otherwise fall back to local replicas) is an error."""
    unknown = sorted(set(config.backends) - set(BACKENDS))
    if unknown:
        raise ValueError(f"[backends.{unknown[0]}] in run.toml: no such platform; choose from "
                         f"{', '.join(BACKENDS)}")  # fmt: skip
    counts = {name: section["replicas"] for name, section in config.backends.items()
              if "replicas" in section}  # fmt: skip
    for name, count in counts.items():
        if not (type(count) is int and count >= 1):
            raise ValueError(f"backends.{name}.replicas = {count!r}: give a whole number >= 1")
    return counts


def _sized(config: RunConfig, replicas: int) -> RunConfig:
    """The config as the launched replicas will see it (``DILOCO_REPLICAS``), checked now."""
    data = config.model_dump()
    data["run"]["replicas"] = replicas
    where = f"{config.source or 'the embedded run'} with {replicas} replicas"
    return validate_config(data, where, config.source)


def _follow(plan: LaunchPlan, supervisor: Supervisor) -> int:
    """Show live status until every replica's job has ended, or the run cannot go on
    (restarting failed ones when the supervisor may); 0 if all of them are done, else 1 with
    a line per replica that did not finish. Interrupted (Ctrl-C, SIGTERM), it stops the
    replicas on this machine and says how to stop the others. Remote jobs are asked less
    often: their APIs throttle (SageMaker's DescribeTrainingJob), and a replica reports
    progress to the bucket."""
    reader = run_metrics(plan.config)
    target = plan.config.diloco.outer_steps
    title = f"run {plan.config.run.name}: {len(plan.specs)} replicas, {target} outer steps"
    interval = REMOTE_POLL_SECONDS if supervisor.remote else LOCAL_POLL_SECONDS
    skews, skews_read = {}, -SKEW_POLL_SECONDS
    try:
        with interrupted_by_sigterm(), Live(console=stderr, refresh_per_second=2,
                                            transient=True) as live:  # fmt: skip
            while True:  # transient: the live frame goes when it ends; the table stays, below
                for note in supervisor.restart_failed():
                    live.console.print(note)
                if time.monotonic() - skews_read >= SKEW_POLL_SECONDS:  # they change slowly
                    skews, skews_read = run_skews(plan.config), time.monotonic()
                where = _where_it_stands(plan, supervisor, reader.read(), skews)
                live.update(status_table(where.rows, title))
                if where.outcome.over:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        _stop_here(plan.config, supervisor, "interrupted")
        return 130
    stdout.print(status_table(where.rows, title))
    if where.outcome.hopeless:
        stderr.print(f"[red]error:[/red] {escape(where.outcome.hopeless)}")
        supervisor.tell_the_others(where.outcome.unfinished)
        _stop_here(plan.config, supervisor, "the run cannot go on")
    for ended in supervisor.in_their_words(where.outcome.unfinished):
        stderr.print(escape(f"  {ended.line()}"), highlight=False, soft_wrap=True)
    if where.outcome.unfinished or where.outcome.hopeless:
        stderr.print("[red]error:[/red] the run did not finish; see `diloco logs REPLICA`")
        return 1
    return 0


@dataclass(frozen=True)
class _Standing:
    rows: list[ReplicaStatus]
    outcome: Outcome


def _where_it_stands(
    plan: LaunchPlan, supervisor: Supervisor, metrics: dict, skews: dict
) -> _Standing:
    jobs = {h.replica_id: supervisor.state(h) for h in supervisor.handles}
    records = supervisor.records()
    rows = replica_statuses(metrics, supervisor.handles, lambda h: jobs[h.replica_id],
                            records.stopped, skews=skews,
                            pace=plan.config.diloco.pace)  # fmt: skip
    codes = {h.replica_id: supervisor.exit_code(h) for h in supervisor.handles
             if jobs[h.replica_id] not in ACTIVE_STATES}  # fmt: skip
    ended = outcome(rows, jobs, metrics, codes, plan.config.run.min_replicas,
                    supervisor.may_restart, launch_ended=records.end is not None)  # fmt: skip
    return _Standing(rows, ended)


def _stop_here(config: RunConfig, supervisor: Supervisor, why: str) -> None:
    """Stop this launch's replicas on this machine; say that the others go on, and how to
    stop them or leave them to the keeper."""
    local = supervisor.local()
    elsewhere = sorted({h.replica_id for h in supervisor.handles} - {h.replica_id for h in local})
    stderr.print(f"{why}: stopping the replicas on this machine")
    if local:
        stop_every(config, local, supervisor.backends)
    if elsewhere:
        stderr.print(
            escape(f"{', '.join(elsewhere)} go on on their platforms: stop them with `diloco "
                   f"stop`, or leave them to the keeper (`diloco keep`)"),
            highlight=False, soft_wrap=True,
        )  # fmt: skip


def launch(
    config_path: ConfigPath = None,
    backend: Annotated[
        list[str] | None,
        typer.Option(
            help="Where replicas run: a backend name, or name=count; repeat the option for "
            f"a run across platforms. Backends: {', '.join(BACKENDS)}. Default: every "
            "[backends.*] of run.toml that sets replicas, else local. Replicas take data "
            "shard indexes in the order of the platforms; a run launched before keeps its "
            "last launch's order, whatever the order of the options (not --dry-run's plan).",
        ),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Replicas (one backend). Default: [backends.<name>] replicas, else run.replicas.",
        ),
    ] = None,
    detach: Annotated[
        bool, typer.Option(help="Return once started; follow with `diloco status`.")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            help="Print every replica and exactly what each platform would be sent (secret "
            "values masked); contact nothing, start nothing."
        ),
    ] = False,
    server_dry_run: Annotated[
        bool,
        typer.Option(
            help="Check credentials, then have each platform that can validate the request "
            "itself do so without starting anything (Kubernetes: dryRun=All); print the result.",
        ),
    ] = False,
    fresh: Annotated[
        bool,
        typer.Option(
            help="Delete this run's objects in its store first and start over (mirrors keep "
            "their checkpoints until the new run reaches their rounds). Without it, a run that "
            "has objects resumes from its last checkpoint."
        ),
    ] = False,
    resume_from: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="The run's store lost the run (a deleted bucket, an outage): copy the newest "
            "checkpoint that reads back intact from this mirror ([checkpoint] mirrors) into "
            "the store and resume from it. Rounds after that checkpoint are trained again. "
            "The store must hold nothing of the run (--fresh deletes what is left). A "
            "relative path is read from run.toml's folder, as in [checkpoint] mirrors.",
        ),
    ] = None,
    restart_on_failure: Annotated[
        bool,
        typer.Option(
            help="While following the run, keep it going as `diloco keep` does: restart any "
            "replica, on any platform, that ends before the run is done (not one stopped on "
            "purpose); it heals from the bucket and rejoins. With --detach nothing here "
            "follows the run: schedule `diloco keep` instead (docs/backends.md, "
            '"Unattended runs").'
        ),
    ] = False,
    max_restarts: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="With --restart-on-failure: restarts per replica (default: [keep] max_restarts).",
        ),
    ] = None,
) -> None:
    """Start a run's replicas and follow them until they finish.

    A run whose objects are already in its store resumes: every replica heals from the newest
    committed checkpoint (in the store or a mirror) and the rounds after it, and training goes
    on from there. A run whose store was lost resumes from a mirror with --resume-from.
    Exits 0 when every replica completed its outer steps, non-zero with the reason otherwise.
    Ctrl-C stops the replicas of this launch. Then prints the run summary and the loss plot.
    """
    with user_errors():
        if detach and restart_on_failure:
            raise ValueError(
                "--restart-on-failure restarts replicas while this command follows the run, "
                "and --detach returns at once: nothing would restart them. Keep a detached "
                "run going with `diloco keep --every 10m`, or the keeper workflow, from any "
                'machine (docs/backends.md, "Unattended runs")'
            )
        config = load_config(config_path)
        counts = parse_backends(backend or [], config, replicas)
        config = _sized(config, sum(counts.values()))
        if not (dry_run or server_dry_run):  # reads the store; a dry run plans from the options
            counts = in_last_launch_order(config, counts)
        plan = plan_launch(config, counts)
        ahead = forecast(plan)
        for line in ahead.lines():
            _say(line)
        if dry_run:
            shown = {"replicas": [_shown(spec) for spec in plan.specs], "submit": describe(plan),
                     "forecast": ahead.as_dict()}  # fmt: skip
            if resume_from is not None:
                shown["resume_from"] = resume_plan(config, resume_from, fresh=fresh)
            print_json(shown)
            return
        if server_dry_run:
            print_json(dry_run_on_servers(plan))
            return
        number = prepare_store(plan, fresh=fresh, resume_from=resume_from, say=_say)
        started = start(plan, number)
    count = len(plan.specs)
    if detach:
        stdout.print(f"started {count} replicas of run {config.run.name}; "
                     f"follow with `diloco status`, stop with `diloco stop`")  # fmt: skip
        return
    restarts = (max_restarts or config.keep.max_restarts) if restart_on_failure else 0
    code = _follow(plan, Supervisor(plan, started, restarts))
    if code == 0:
        print_report(config, plan.run_dir / "report.png")
    raise typer.Exit(code)


def _say(text: str) -> None:
    stderr.print(escape(text), highlight=False, soft_wrap=True)


def stop_every(config: RunConfig, handles: list[ReplicaHandle], backends: dict) -> bool:
    """Stop every replica (marked first: not to be restarted), carrying on past a platform
    that fails; say what happened. True if every stop was sent."""
    mark_stopped(config, [handle.replica_id for handle in handles])
    report = stop_all(handles, lambda handle: backends[handle.platform].stop(handle))
    platforms = ", ".join(sorted({handle.platform for handle in handles})) or "no platform"
    (stderr if report.left else stdout).print(
        escape(f"{report} on {platforms}"), highlight=False, soft_wrap=True
    )
    return not report.left


def print_report(config: RunConfig, output: Path) -> RunSummary:
    """The run's summary table (and its data coverage) printed, its loss plot at ``output``."""
    metrics = run_metrics(config).read()
    if not metrics:
        raise ValueError(f"run {config.run.name!r} has no metrics in its store yet")
    summary = summarize(metrics)
    plot_losses(metrics, output, f"run {config.run.name}")
    stdout.print(summary_table(summary))
    if (coverage := data_coverage(config)) is not None:
        stdout.print(coverage_table(coverage))
    stdout.print(f"loss plot: {output}")
    return summary

"""``diloco status | logs | stop | report | export``: a launched run, watched, stopped, reported and
exported (``diloco launch`` is ``launch.py``).

The tables these commands print are in ``tables.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from diloco_anywhere.backends.base import (
    one_line,
)
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.cli.common import (
    ConfigPath,
    JsonFlag,
    print_json,
    stderr,
    stdout,
    user_errors,
)
from diloco_anywhere.cli.launch import print_report, stop_every
from diloco_anywhere.cli.tables import (
    markdown_table,
    status_table,
)
from diloco_anywhere.config import RunConfig, load_config
from diloco_anywhere.launching.start.launch import (
    backends_for,
    job_state,
    load_handles,
    recorded_launch,
    run_dir,
    run_metrics,
    run_skews,
)
from diloco_anywhere.launching.watch.report import data_coverage, plot_losses, summarize
from diloco_anywhere.launching.watch.status import (
    advice_lines,
    failure_lines,
    replica_statuses,
)
from diloco_anywhere.launching.watch.status_page import page_url


def status(
    config_path: ConfigPath = None,
    json_output: JsonFlag = False,
    markdown: Annotated[
        bool, typer.Option(help="Print a Markdown table (a CI job summary, an issue).")
    ] = False,
    url: Annotated[
        bool,
        typer.Option(
            help="Print a link to the status page the keeper writes into the run's bucket "
            "(signed with your credentials for the bucket, valid 24 h: anyone holding it can "
            "read the page), and contact no platform."
        ),
    ] = False,
) -> None:
    """Show one row per replica: platform, state, outer step, loss, tokens/s, last seen, and
    its clock's skew when it is off; then how the launch ended, if a keeper ended it. Works
    from any machine that reaches the run's bucket (the launch is recorded there) and, for
    job states, its platforms."""
    with user_errors():
        config = load_config(config_path)
        if url:
            with Store(config.store_url()) as store:
                stdout.print(page_url(store, RunLayout(config.run.name)), soft_wrap=True)
            return
        reader = run_metrics(config)
        launch = recorded_launch(config)
        backends = backends_for(launch.handles, config)
        rows = replica_statuses(
            reader.read(),
            launch.handles,
            lambda handle: job_state(backends[handle.platform], handle),
            stopped=launch.stopped,
            skews=run_skews(config),
            pace=config.diloco.pace,
        )
    if json_output:
        print_json([row.as_dict() for row in rows])
        return
    if markdown:
        print(markdown_table(rows, f"run {config.run.name}"))
    elif not rows:
        stdout.print(f"run {config.run.name}: no replicas launched or reporting yet")
    else:
        stdout.print(status_table(rows, f"run {config.run.name}"))
    for line in [*failure_lines(rows), *advice_lines(rows)]:
        print(f"\n{line}")
    if not markdown and (coverage := data_coverage(config)) is not None:
        print(coverage.summary())
    if launch.end is not None:
        print(f"\nlaunch ended ({launch.end.reason}): {launch.end.detail}")


def logs(
    replica: Annotated[str | None, typer.Argument(help="One replica id (default: all).")] = None,
    config_path: ConfigPath = None,
    tail: Annotated[int, typer.Option(min=1, help="Last lines per replica.")] = 40,
) -> None:
    """Print the replicas' own output (stdout and stderr), as their platform keeps it."""
    with user_errors():
        config = load_config(config_path)
        handles = load_handles(config)
        chosen = [h for h in handles if replica in (None, h.replica_id)]
        if not chosen:
            known = ", ".join(h.replica_id for h in handles) or "none launched from here"
            raise ValueError(f"no replica {replica!r} in this run's launch; replicas: {known}")
        backends = backends_for(chosen, config)
    unreadable = 0
    for handle in chosen:  # one platform failing does not hide the others' logs
        stdout.rule(f"{handle.replica_id} ({handle.platform})")
        try:
            print("\n".join(backends[handle.platform].logs(handle).splitlines()[-tail:]))
        except Exception as exc:
            stderr.print(f"[red]error:[/red] {escape(one_line(exc))}", highlight=False)
            unreadable += 1
    if unreadable:
        raise typer.Exit(1)


def stop(config_path: ConfigPath = None) -> None:
    """Stop every replica of the run's last launch, on every platform, from any machine that
    reaches the run's bucket (the launch is recorded there) and its platforms."""
    with user_errors():
        config = load_config(config_path)
        handles = load_handles(config)
        backends = backends_for(handles, config)
    if not stop_every(config, handles, backends):
        raise typer.Exit(1)


def export(
    destination: Annotated[
        str, typer.Argument(help="A local folder, or a store URL (s3://, gs://, az://, hf://...).")
    ],
    config_path: ConfigPath = None,
    round_: Annotated[
        int | None,
        typer.Option("--round", min=0, help="The checkpoint's round. Default: the newest."),
    ] = None,
) -> None:
    """Write the run's trained model: the global weights of a committed checkpoint (checked as
    healing checks it) as model.safetensors, a model card (README.md), run.toml, and the task's
    own save format when it has one."""
    from diloco_anywhere.launching.watch.export import export as export_run

    with user_errors():
        config = load_config(config_path)
        checkpoint = export_run(config, destination, round_)
    stdout.print(f"exported round {checkpoint.commit.round} (outer step "
                 f"{checkpoint.commit.step}) of run {config.run.name} to {destination}",
                 highlight=False, soft_wrap=True)  # fmt: skip


def _track(config: RunConfig, tensorboard: Path | None, project: str | None) -> None:
    from diloco_anywhere.launching.watch import tracking

    metrics = run_metrics(config).read()
    if tensorboard is not None:
        written = tracking.write_tensorboard(metrics, tensorboard)
        stderr.print(f"TensorBoard: {len(written)} runs in {tensorboard}", highlight=False)
    if project is not None:
        ids = tracking.write_wandb(metrics, project, config.run.name)
        stderr.print(f"W&B: runs {', '.join(ids)} in project {project}", highlight=False)


def report(
    config_path: ConfigPath = None,
    output: Annotated[
        Path | None, typer.Option(help="PNG path. Default: .diloco/<run>/report.png.")
    ] = None,
    json_output: JsonFlag = False,
    tensorboard: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Also write TensorBoard event files, one run per replica under DIR "
            "(tensorboard --logdir DIR).",
        ),
    ] = None,
    wandb: Annotated[
        str | None,
        typer.Option(
            metavar="PROJECT",
            help="Also log to Weights & Biases: one W&B run per replica in PROJECT, grouped by "
            "the run's name (WANDB_API_KEY or wandb login; WANDB_MODE=offline writes locally).",
        ),
    ] = None,
) -> None:
    """Plot loss against tokens per replica (PNG) and summarize what the syncs cost; with
    --tensorboard or --wandb, copy the metrics into those trackers too."""
    with user_errors():
        config = load_config(config_path)
        path = output or run_dir(config) / "report.png"
        if json_output:
            metrics = run_metrics(config).read()
            plot_losses(metrics, path, f"run {config.run.name}")
            coverage = data_coverage(config)
            data = None if coverage is None else coverage.as_dict()
            print_json({**summarize(metrics).as_dict(), "plot": str(path), "data": data})
        else:
            print_report(config, path)
        if tensorboard is not None or wandb is not None:
            _track(config, tensorboard, wandb)

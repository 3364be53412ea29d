"""``diloco keep | replace``: keep an unattended run going, from anywhere (``keeper.py``)."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from diloco_anywhere.bucket.store import Store
from diloco_anywhere.cli.common import (
    ConfigPath,
    JsonFlag,
    parse_duration,
    print_json,
    stderr,
    stdout,
    user_errors,
)
from diloco_anywhere.config import load_config, with_changes
from diloco_anywhere.launching.keep.keeper import Keeper, PassReport

MIN_EVERY = 60.0  # seconds: faster passes only add API calls (platforms throttle)


def _decisions_table(report: PassReport, title: str) -> Table:
    table = Table(title=title)
    for column in ("replica", "decision", "why"):
        table.add_column(column, overflow="fold")
    for replica, decision in report.decisions.items():
        shown = {"leave": "-", "give_up": "[red]not restarted[/red]",
                 "wait": "[yellow]wait[/yellow]", "restart": "[green]restart[/green]"}  # fmt: skip
        table.add_row(replica, shown[decision.action],
                      escape(decision.detail or decision.reason))  # fmt: skip
    return table


def _show(report: PassReport, run: str, json_output: bool) -> None:
    if json_output:
        print_json({
            "launch": report.launch,
            "ended": report.ended,
            "decisions": {r: d.__dict__ for r, d in report.decisions.items()},
            "notes": report.notes,
        })  # fmt: skip
        return
    if report.decisions:
        stdout.print(_decisions_table(report, f"run {run}, launch {report.launch}"))
    if report.ended:
        stdout.print(escape(f"launch {report.launch} has ended ({report.ended})"))
    for note in report.notes:
        stdout.print(escape(note), highlight=False, soft_wrap=True)


def keep(
    config_path: ConfigPath = None,
    every: Annotated[
        str | None,
        typer.Option(
            metavar="DURATION",
            help="Pass again after this long (e.g. 10m, 1h), until the launch ends; without "
            "it, one pass. For a schedule without a process, run one pass from cron or the "
            "keeper workflow instead.",
        ),
    ] = None,
    max_restarts: Annotated[
        int | None,
        typer.Option(min=0, help="Restarts per replica, over [keep] max_restarts."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option(help="Say what a pass would do; start, stop and record nothing.")
    ] = False,
    json_output: JsonFlag = False,
) -> None:
    """Keep the run's newest launch going: restart every replica that has ended before the run
    is done (failed, timed out, preempted, deleted, hung) on its own platform, with the same
    id and data shard, as a new incarnation that heals from the bucket; stop every replica
    once the last outer step is committed or the [budget] is spent.

    Safe from any machine that reaches the run's bucket and platforms, any number of times,
    several at once: each action is claimed in the bucket first, so one keeper acts. Waits
    before restarting a replica that ended quickly (doubling, [keep] backoff), and gives up
    on one after [keep] max_restarts unplanned restarts. Alerts go to the webhook in
    $DILOCO_ALERT_WEBHOOK ([alerts]).
    """
    with user_errors():
        config = load_config(config_path)
        if max_restarts is not None:
            config = with_changes(config, keep__max_restarts=max_restarts)
        seconds = parse_duration(every, "--every", minimum=MIN_EVERY) if every else None
        with Store(config.store_url()) as store:
            keeper = Keeper(config, store, say=lambda text: stderr.print(escape(text)))
            while True:
                report = keeper.pass_(dry_run=dry_run)
                _show(report, config.run.name, json_output)
                if seconds is None or report.ended or report.launch is None:
                    return
                time.sleep(seconds)


def replace(
    replicas: Annotated[list[str], typer.Argument(help="Replica ids, e.g. modal-1 k8s-0.")],
    config_path: ConfigPath = None,
    force: Annotated[
        bool,
        typer.Option(
            help="Replace a replica that still runs: its job is stopped first (where its "
            "platform stops one replica alone: not Kubernetes), and the new incarnation's "
            "claim fences the old process off in any case."
        ),
    ] = False,
) -> None:
    """Start exactly these replicas of the newest launch again, with the same id and data
    shard (a new incarnation, which heals from the bucket), whatever the others do. A
    replica still running is refused without --force."""
    with user_errors():
        config = load_config(config_path)
        with Store(config.store_url()) as store:
            restarted = Keeper(config, store).replace(replicas, force=force)
    for replica in restarted:
        (stdout if replica.ok else stderr).print(escape(replica.note), highlight=False,
                                                 soft_wrap=True)  # fmt: skip
    if not all(replica.ok for replica in restarted):
        raise typer.Exit(1)

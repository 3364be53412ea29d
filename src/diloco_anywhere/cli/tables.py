"""The tables the run commands print: one row per replica (``diloco status``, ``diloco launch``
following a run), in the terminal or as Markdown, and the run summary (``diloco report``).

Kept apart from the commands (``run.py``) so that each command only gathers and prints: how a
row fits an 80-column terminal, and which notes fold into a replica's state, live here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.table import Table

from diloco_anywhere.launching.watch.report import RunSummary
from diloco_anywhere.launching.watch.status import ReplicaStatus, notes

if TYPE_CHECKING:
    from diloco_anywhere.data.coverage import Coverage


def status_table(rows: list[ReplicaStatus], title: str) -> Table:
    """One row per replica. Fits an 80-column terminal with every header and number whole: no
    vertical rules, one space between columns, and no platform column when every replica id
    already starts with its platform (``k8s-0``: ids the launcher gives); only the state, which
    may carry notes, folds onto a second line. ``H`` is the inner steps of a replica's latest
    round: its own with ``[diloco] pace = "time"``."""
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    platforms = any(not row.replica.startswith(f"{row.platform}-") for row in rows)
    columns = ("replica", *(("platform",) if platforms else ()), "state", "step", "H", "loss",
               "eval", "tokens/s", "restarts/heals", "seen")  # fmt: skip
    cells = [_status_cells(row, platforms) for row in rows]
    for number, column in enumerate(columns):
        widest = max([len(column), *(len(row[number]) for row in cells)])
        if column == "state":
            table.add_column(column, min_width=len("timed_out"), overflow="fold")
        else:
            table.add_column(column, justify="left" if number == 0 or column == "platform"
                             else "right", min_width=widest, no_wrap=True)  # fmt: skip
    for row in cells:
        table.add_row(*row)
    return table


STYLES = {"bad": "bold red", "warn": "yellow", "quiet": ""}


def _status_cells(row: ReplicaStatus, platform: bool) -> list[str]:
    state = row.state
    for kind, text in notes(row):
        style = STYLES[kind]
        state = f"{state}, [{style}]{text}[/{style}]" if style else f"{state}, {text}"
    return [
        row.replica, *((row.platform,) if platform else ()), state, str(row.outer_step),
        str(row.round_steps or "-"),
        "-" if row.loss is None else f"{row.loss:.3f}",
        "-" if row.eval_loss is None else f"{row.eval_loss:.3f}",
        "-" if row.tokens_per_second is None else f"{row.tokens_per_second:,.0f}",
        f"{row.restarts}/{row.heals}",
        "-" if row.last_seen_seconds is None else f"{row.last_seen_seconds:.0f}s",  # ago
    ]  # fmt: skip


def markdown_table(rows: list[ReplicaStatus], title: str) -> str:
    """The status table in GitHub-flavoured Markdown: a job summary, an issue comment."""
    lines = [f"### {title}", "", "| replica | platform | state | step | H | loss | eval | seen |",
             "|---|---|---|--:|--:|--:|--:|--:|"]  # fmt: skip
    for row in rows:
        seen = row.last_seen_seconds
        cells = (row.replica, row.platform, row.state, str(row.outer_step),
                 str(row.round_steps or "-"), "-" if row.loss is None else f"{row.loss:.3f}",
                 "-" if row.eval_loss is None else f"{row.eval_loss:.3f}",
                 "-" if seen is None else f"{seen:.0f}s ago")  # fmt: skip
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def summary_table(summary: RunSummary) -> Table:
    table = Table(title="Run summary", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    saved = summary.bytes_saved_factor
    for name, value in (
        ("replicas", str(summary.replicas)),
        ("outer steps", str(summary.outer_steps)),
        ("inner steps per replica", str(summary.inner_steps_per_replica)),
        ("tokens (all replicas)", f"{summary.tokens:,}"),
        ("final training loss (mean)", _maybe(summary.final_loss)),
        ("held-out loss", _maybe(summary.eval_loss)),
        ("sent per replica", f"{summary.bytes_up_per_replica / 1e6:,.2f} MB"),
        ("received per replica", f"{summary.bytes_down_per_replica / 1e6:,.2f} MB"),
        ("data parallel would send", f"{summary.data_parallel_bytes_per_replica / 1e6:,.2f} MB"
         + (f" ({saved:,.0f}x more)" if saved else "")),
        ("sync time exposed per replica", f"{summary.sync_exposed_seconds:.2f} s"),
        ("fleet throughput", _throughput(summary)),
    ):  # fmt: skip
        table.add_row(name, value)
    return table


def _throughput(summary: RunSummary) -> str:
    """Committed tokens a second, and what share of its replicas' own pace that is."""
    fleet, own = summary.fleet_tokens_per_second, summary.own_tokens_per_second
    if fleet is None or not own:
        return "-"
    return f"{fleet:,.0f} tokens/s ({fleet / own:.0%} of its replicas' own)"


def coverage_table(coverage: Coverage) -> Table:
    """Per epoch of the run's data: its sequences trained once, more than once (never, unless
    something is wrong), in flight and not (yet) trained, and the tokens trained in vain."""
    table = Table(title=f"Data (sequences of {coverage.seq_len} tokens)")
    for name in ("epoch", "sequences", "trained once", "more than once", "in flight",
                 "not trained", "tokens lost"):  # fmt: skip
        table.add_column(name, justify="right")
    for epoch in coverage.epochs:
        table.add_row(*(f"{value:,}" for value in (
            epoch.epoch, epoch.sequences, epoch.trained_once, epoch.trained_more,
            epoch.in_flight, epoch.not_trained, epoch.lost_tokens,
        )))  # fmt: skip
    return table


def _maybe(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"

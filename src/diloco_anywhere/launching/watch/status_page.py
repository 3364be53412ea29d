"""A run's status as a page in its own bucket: one self-contained HTML file and status.json.

``diloco status`` needs credentials for every platform a run spans. A keeper (``diloco keep``)
has them, so each of its passes writes what it saw into ``{run}/status/`` (``RunLayout``'s
``status_page`` and ``status_json``), and anyone who can read the bucket sees the run from a
browser: opened from the bucket's console, or from a signed link (``page_url``, behind
``diloco status --url``).

The page loads nothing from anywhere else (a bucket object opened from a signed link has no
neighbours it could load): the loss plot is a PNG in a ``data:`` URI, the CSS is inline, and
there is no script. Every string that comes from the bucket or a person (replica ids,
platforms, notes, labels, the host) is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import json
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.launching.watch.status import (
    ReplicaStatus,
    advice_lines,
    finite_or_null,
    notes,
)
from diloco_anywhere.training.records.metrics import ReplicaMetrics

HTML_TYPE = "text/html; charset=utf-8"  # with the charset, or a browser may guess another
JSON_TYPE = "application/json"
DOCUMENT_FORMAT = 1  # status.json's "format": raised when a field changes meaning
# The page reloads itself this often: a keeper rewrites it every 10 minutes.
REFRESH_SECONDS = 300
DEFAULT_LINK_SECONDS = 24 * 3600
NARROW = "(max-width: 700px)"  # a phone held upright: replicas as cards, the plot's text larger
# The plot's text on a phone, times matplotlib's default: more, and a legend of 8 replicas
# covers the curves.
PHONE_TEXT = 1.4
COLUMNS = ("replica", "platform", "state", "outer step", "loss", "eval loss", "tokens/s",
           "steps/round", "waiting", "restarts/heals", "last seen")  # fmt: skip
# State -> colour class; other states read neutral.
STATE_CLASSES = {
    "running": "ok", "starting": "info", "done": "quiet", "stopped": "quiet",
    "timed_out": "warn", "exited": "warn", "failed": "bad",
}  # fmt: skip
# Why a store could not sign a link, per scheme.
_GCS_SIGNS = (
    "GCS signs links only with a service account's key "
    "(GOOGLE_APPLICATION_CREDENTIALS naming a key file)"
)
_AZURE_SIGNS = (
    "Azure signs links with the storage account's key "
    "(AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_CONNECTION_STRING)"
)
SIGNING_HELP = {"gs": _GCS_SIGNS, "gcs": _GCS_SIGNS, "az": _AZURE_SIGNS, "abfs": _AZURE_SIGNS}


@dataclass(frozen=True)
class Headline:
    """What a glance at the run should tell: the facts behind the page's first line."""

    replicas: int
    states: dict[str, int]  # replicas per state
    outer_step: int  # the furthest replica's
    outer_steps: int | None  # the run's target, when known
    restarts: int  # incarnations after the first, all replicas
    spend: dict[str, str] = field(default_factory=dict)  # label -> value, as given

    @classmethod
    def of(
        cls,
        rows: Sequence[ReplicaStatus],
        outer_steps: int | None = None,
        spend: Mapping[str, str] | None = None,
    ) -> Headline:
        return cls(
            replicas=len(rows),
            states=dict(sorted(Counter(row.state for row in rows).items())),
            outer_step=max((row.outer_step for row in rows), default=0),
            outer_steps=outer_steps,
            restarts=sum(row.restarts for row in rows),
            spend=dict(spend or {}),
        )

    def text(self) -> str:
        """E.g. "7 of 8 replicas running (1 failed), outer step 312 of 1000, 2 restarts,
        est. spent $84.10, budget $200"."""
        running = self.states.get("running", 0)
        others = ", ".join(f"{n} {state}" for state, n in self.states.items() if state != "running")
        noun = "replica" if self.replicas == 1 else "replicas"
        first = f"{running} of {self.replicas} {noun} running"
        parts = [f"{first} ({others})" if others else first]
        target = f" of {self.outer_steps}" if self.outer_steps else ""
        parts.append(f"outer step {self.outer_step}{target}")
        parts.append(f"{self.restarts} restart" + ("" if self.restarts == 1 else "s"))
        parts += [f"{label} {value}" for label, value in self.spend.items()]
        return ", ".join(parts)


# -- status.json --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PageFacts:
    """What the page and status.json say besides the rows: the run's name, when and on which
    host they were written (an aware time: a naive one would be read in the writer's zone,
    which a reader elsewhere cannot know), the run's outer steps, the keeper's notes (actions,
    alerts) and the spend (label -> value, as given)."""

    title: str
    written_at: datetime
    host: str
    outer_steps: int | None = None
    notes: Sequence[str] = ()
    spend: Mapping[str, str] = field(default_factory=dict)

    def headline(self, rows: Sequence[ReplicaStatus]) -> Headline:
        return Headline.of(rows, self.outer_steps, self.spend)


def status_document(rows: Sequence[ReplicaStatus], facts: PageFacts) -> dict:
    """What the page shows, for scripts: the rows as ``diloco status --json`` gives them (NaN
    and infinity as null, which JSON has no words for), the headline's facts and text, the
    notes, and when and where it was written (ISO 8601, UTC)."""
    headline = facts.headline(rows)
    return finite_or_null(
        {
            "format": DOCUMENT_FORMAT,
            "run": facts.title,
            "written_at": _utc(facts.written_at).isoformat(),
            "written_by": facts.host,
            "headline": asdict(headline) | {"text": headline.text()},
            "replicas": [row.as_dict() for row in rows],
            "notes": list(facts.notes),
        }
    )


def _utc(moment: datetime) -> datetime:
    """``moment`` in UTC; a naive one is refused (``PageFacts``)."""
    if moment.tzinfo is None:
        raise ValueError(f"written_at {moment} has no time zone; give an aware datetime (UTC)")
    return moment.astimezone(timezone.utc)


# -- the page ---------------------------------------------------------------------------------


def render_page(
    rows: Sequence[ReplicaStatus],
    metrics: Mapping[str, ReplicaMetrics],
    facts: PageFacts,
    refresh_seconds: int = REFRESH_SECONDS,
) -> str:
    """The page: the run's name, when and where it was written, the headline, one row per
    replica (``diloco status``'s columns), the keeper's notes (actions, alerts), spend
    against budget, the loss plot (``report.plot_losses`` of ``metrics``) and how to act.
    ``refresh_seconds``: how often an open page reloads itself (0: never)."""
    headline, title = facts.headline(rows), facts.title
    written = _utc(facts.written_at).strftime("%Y-%m-%d %H:%M UTC")
    refresh = (
        f'<meta http-equiv="refresh" content="{int(refresh_seconds)}">' if refresh_seconds else ""
    )
    body = "\n".join([
        f"<header><h1>run {_e(title)}</h1>",
        f'<p class="written">written {written} by the keeper on {_e(facts.host)}</p>',
        f'<p class="headline">{_e(headline.text())}</p></header>',
        _replica_table(rows),
        _advice_section(advice_lines(rows)),
        _notes_section(facts.notes),
        _spend_section(headline.spend),
        _plot_section(metrics, title),
        _footer(refresh_seconds),
    ])  # fmt: skip
    return PAGE.format(
        title=_e(f"run {title}: {headline.text()}"), refresh=refresh, style=STYLE, body=body
    )


def _e(text: object) -> str:
    """Escaped for HTML text and attribute values alike."""
    return html.escape(str(text), quote=True)


def _state_cell(row: ReplicaStatus) -> str:
    """The state, coloured, then its flags (as ``diloco status`` adds them)."""
    colour = STATE_CLASSES.get(row.state, "quiet")
    flags = notes(row)
    badges = "".join(f' <span class="flag {kind}">{_e(text)}</span>' for kind, text in flags)
    return f'<span class="state {colour}">{_e(row.state)}</span>{badges}'


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ago(seconds: float | None) -> str:
    """Seconds for a replica seen just now, hours for one silent since yesterday."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h ago"
    return f"{seconds / 86400:.1f} days ago"


def _replica_table(rows: Sequence[ReplicaStatus]) -> str:
    if not rows:
        return "<section><h2>Replicas</h2><p>No replica launched or reporting yet.</p></section>"
    head = "".join(f"<th>{_e(name)}</th>" for name in COLUMNS)
    lines = []
    for row in rows:
        cells = (
            _e(row.replica), _e(row.platform), _state_cell(row), str(row.outer_step),
            _number(row.loss, ".3f"), _number(row.eval_loss, ".3f"),
            _number(row.tokens_per_second, ",.0f"), str(row.round_steps or "-"),
            _number(row.waiting, ".0%"), f"{row.restarts}/{row.heals}",
            _ago(row.last_seen_seconds),
        )  # fmt: skip
        tds = "".join(
            f'<td data-label="{_e(name)}"><span>{cell}</span></td>'
            for name, cell in zip(COLUMNS, cells, strict=True)
        )
        lines.append(f"<tr>{tds}</tr>")
    return (
        '<section><h2>Replicas</h2><table class="replicas">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table></section>"
    )


def _advice_section(lines: Sequence[str]) -> str:
    """What to change (``status.advice_lines``), right under the table it is about."""
    items = "".join(f"<li>{_e(line)}</li>" for line in lines)
    return f'<section><h2>To change</h2><ul class="notes">{items}</ul></section>' if lines else ""


def _notes_section(notes: Sequence[str]) -> str:
    if not notes:
        return "<section><h2>Keeper actions and alerts</h2><p>None in this pass.</p></section>"
    items = "".join(f"<li>{_e(note)}</li>" for note in notes)
    return f'<section><h2>Keeper actions and alerts</h2><ul class="notes">{items}</ul></section>'


def _spend_section(spend: Mapping[str, str]) -> str:
    if not spend:
        return ""
    items = "".join(f"<dt>{_e(label)}</dt><dd>{_e(value)}</dd>" for label, value in spend.items())
    return f'<section><h2>Spend</h2><dl class="spend">{items}</dl></section>'


def _plot_section(metrics: Mapping[str, ReplicaMetrics], title: str) -> str:
    """The plot twice: as ``diloco report`` draws it, and with larger text for a phone, where
    the same 960-pixel image shrinks to 400 and its labels become unreadable."""
    if not any(m.steps for m in metrics.values()):
        return "<section><h2>Loss</h2><p>No loss recorded yet.</p></section>"
    wide, narrow = (_data_uri(loss_plot_png(metrics, title, scale)) for scale in (1.0, PHONE_TEXT))
    return (
        f'<section><h2>Loss</h2><picture><source media="{NARROW}" srcset="{narrow}">'
        '<img class="plot" alt="training loss per replica and held-out loss against tokens" '
        f'src="{wide}"></picture></section>'
    )


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def loss_plot_png(
    metrics: Mapping[str, ReplicaMetrics], title: str, text_scale: float = 1.0
) -> bytes:
    """``diloco report``'s plot as PNG bytes, its text ``text_scale`` times matplotlib's
    default size."""
    import matplotlib  # imported on use: the CLI starts without it

    from diloco_anywhere.launching.watch.report import plot_losses

    size = matplotlib.rcParamsDefault["font.size"] * text_scale
    # larger text needs shorter tick labels (150000 as 1.5 and x1e5 once), or they overlap
    style = {"font.size": size, "axes.formatter.limits": (-4, 4)} if text_scale != 1 else {}
    with (
        tempfile.TemporaryDirectory(prefix="diloco-status-") as folder,
        matplotlib.rc_context(style),
    ):
        return plot_losses(dict(metrics), Path(folder) / "loss.png", f"run {title}").read_bytes()


def _footer(refresh_seconds: int) -> str:
    every = f"{refresh_seconds // 60} min" if refresh_seconds % 60 == 0 else f"{refresh_seconds} s"
    reload = f"It reloads itself every {every}. " if refresh_seconds else ""
    return f"""<footer><h2>What to do</h2><ul>
<li><code>diloco status</code>: this table, live, from a terminal with the run's credentials.</li>
<li><code>diloco keep</code>: one keeper pass now (what the scheduled workflow runs).</li>
<li><code>diloco stop</code>: stop every replica of the run.</li>
<li>Run them in the project's folder, where run.toml is. More in docs/backends.md, "Status
page".</li>
</ul>
<p>Each keeper pass rewrites this page. {reload}A link from <code>diloco status --url</code>
lets anyone who holds it read this page until it expires; after that the store answers with an
error: ask for a new link.</p></footer>"""


# Plain CSS (no format braces: the template renders this file, and an f-string's would read
# as Jinja); NARROW is put in below.
STYLE = """
:root { color-scheme: light; --ok: #1a7f37; --info: #0969da; --warn: #9a6700; --bad: #cf222e;
  --quiet: #59636e; --line: #d1d9e0; }
body { font: 16px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0 auto;
  max-width: 72rem; padding: 1rem; color: #1f2328; background: #fff; }
h1 { font-size: 1.5rem; margin: 0 0 .2rem; overflow-wrap: anywhere; }
h2 { font-size: 1.1rem; margin: 1.6rem 0 .5rem; }
.written { color: var(--quiet); margin: 0; overflow-wrap: anywhere; }
.headline { font-size: 1.15rem; font-weight: 600; margin: .6rem 0 0; }
table.replicas { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
.replicas th, .replicas td { padding: .35rem .6rem; border-bottom: 1px solid var(--line);
  text-align: right; white-space: nowrap; }
.replicas th { background: #f6f8fa; font-weight: 600; }
.replicas td:nth-child(-n+3), .replicas th:nth-child(-n+3) { text-align: left; }
.replicas td:nth-child(3) { white-space: normal; }
.state { font-weight: 600; }
.flag { display: inline-block; font-size: .85em; padding: 0 .4em; border-radius: .6em;
  border: 1px solid currentColor; margin: .1em 0; }
.ok { color: var(--ok); } .info { color: var(--info); } .warn { color: var(--warn); }
.bad { color: var(--bad); } .quiet { color: var(--quiet); }
.notes li { overflow-wrap: anywhere; }
.spend { display: grid; grid-template-columns: max-content auto; gap: .2rem 1rem; }
.spend dt { color: var(--quiet); } .spend dd { margin: 0; font-weight: 600; }
img.plot { max-width: 100%; height: auto; border: 1px solid var(--line); }
code { background: #f6f8fa; padding: 0 .25em; border-radius: 4px; }
footer { margin-top: 2rem; border-top: 1px solid var(--line); color: #393f46; }
@media NARROW {
  body { padding: .75rem; }
  .replicas thead { display: none; }
  .replicas, .replicas tbody { display: block; }
  .replicas tr { display: grid; grid-template-columns: 1fr 1fr; grid-auto-flow: dense;
    column-gap: 1rem; border: 1px solid var(--line); border-radius: 6px; margin: 0 0 .75rem;
    padding: .2rem .6rem; }
  .replicas td { display: flex; justify-content: space-between; gap: .5rem;
    border-bottom: 0; padding: .2rem 0; white-space: normal; font-size: .95rem; }
  .replicas td::before { content: attr(data-label); color: var(--quiet); white-space: nowrap; }
  .replicas td:nth-child(-n+3) { text-align: right; grid-column: 1 / -1; }
  .replicas td:first-child { font-weight: 600; font-size: 1.05rem;
    border-bottom: 1px solid var(--line); }
  .replicas td:first-child::before { content: none; }
  .replicas td:nth-child(2) { grid-column: auto; }
}
""".replace("NARROW", NARROW)

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer"><meta name="robots" content="noindex">
{refresh}<title>{title}</title>
<style>
{style}</style></head>
<body>
{body}
</body></html>
"""


# -- the bucket -------------------------------------------------------------------------------


def publish(store: Store, layout: RunLayout, page: str, document: dict) -> None:
    """Write status.json, then the page, over the last pass's, each with the Content-Type a
    browser needs to show it instead of downloading it (where the store keeps one)."""
    data = json.dumps(document, indent=1, allow_nan=False, ensure_ascii=False).encode("utf-8")
    store.overwrite(layout.status_json(), data, content_type=JSON_TYPE)
    store.overwrite(layout.status_page(), page.encode("utf-8"), content_type=HTML_TYPE)


def page_url(store: Store, layout: RunLayout, expires_seconds: int = DEFAULT_LINK_SECONDS) -> str:
    """A URL that opens the status page: ``file://`` on a local store; elsewhere a link signed
    with this machine's credentials for the store, readable by anyone who holds it until it
    expires (a bearer credential: show it to its user, never log it). ``StoreError`` where the
    store cannot sign, saying where the page is in the bucket's console instead."""
    key = layout.status_page()
    try:
        return store.sign(key, expires_seconds)
    except StoreError as exc:
        scheme = urlsplit(store.url).scheme
        why = SIGNING_HELP.get(scheme, "this store's filesystem cannot sign links")
        raise StoreError(
            f"no link to the status page: {why} ({exc}). Open it from the bucket's console "
            f"instead: {console_location(store.url, key)}"
        ) from None


def console_location(store_url: str, key: str) -> str:
    """Where a bucket's web console shows ``key`` of the store at ``store_url``: the bucket
    (an Azure container, an HF ``namespace/bucket``) and the object's name in it."""
    parts = urlsplit(store_url)
    path = parts.path.strip("/")
    if parts.scheme == "hf":  # hf://buckets/<namespace>/<bucket>/<prefix>
        namespace, bucket, prefix = [*path.split("/", 2), ""][:3]
        bucket = f"{namespace}/{bucket}"
    else:
        bucket, prefix = parts.netloc, path
    name = f"{prefix}/{key}" if prefix else key
    return f"bucket {bucket!r}, object {name!r} ({store_url.rstrip('/')}/{key})"

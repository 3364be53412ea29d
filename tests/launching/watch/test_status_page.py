"""The status page a keeper writes into the run's bucket: what it shows, that nothing from the
bucket runs in a browser, status.json, and the links that open it (moto S3, Azurite, local)."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import shutil
import struct
import subprocess
import urllib.request
from datetime import datetime, timezone
from html.parser import HTMLParser

import fsspec
import pytest

from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.launching.watch.status import ReplicaStatus, replica_statuses
from diloco_anywhere.launching.watch.status_page import (
    HTML_TYPE,
    JSON_TYPE,
    REFRESH_SECONDS,
    PageFacts,
    console_location,
    page_url,
    publish,
    render_page,
    status_document,
)
from diloco_anywhere.training.records.metrics import (
    EventLine,
    MetricsReader,
    MetricsWriter,
    StepLine,
    SyncLine,
)

RUN = "status-run"
T0 = 1_790_000_000.0  # the fixture run's start, POSIX seconds
WRITTEN = datetime(2026, 11, 2, 9, 30, tzinfo=timezone.utc)
HOSTILE = "<script>alert('pwned')</script>"
NOTES = (
    "restarted local-2 (attempt 2): its job failed with exit 1",
    f"local-1 said: {HOSTILE} & <b>bold</b>",
)
SPEND = {"est. spent": "$84.10", "budget": "$200"}
PNG_URI = "data:image/png;base64,"


@pytest.fixture
def metrics(tmp_path):
    """Three replicas' metrics, written and read back through a local store as replicas write
    them: two syncs each, eval losses, a script's own number; local-1 restarted once."""
    store, layout = Store(str(tmp_path / "store")), RunLayout(RUN)
    for index in range(3):
        replica = f"local-{index}"
        for incarnation in range(2 if index == 1 else 1):
            writer = MetricsWriter(store, layout, replica, incarnation, "local")
            start = T0 + 100 * incarnation
            writer.add(EventLine(event="started", parameters=1000, time=start))
            for step in range(1, 9):
                loss = 4.0 - 0.2 * step + 0.05 * index
                tokens = 1000 * step
                values = {"lr": 0.001}
                writer.add(StepLine(step=step, loss=loss, tokens=tokens, time=start + step,
                                    values=values))  # fmt: skip
                if step % 4 == 0:
                    writer.add(SyncLine(outer_step=step // 4, round=step // 4, committed=True,
                                        participants=3, eval_loss=3.0 - 0.1 * step, tokens=tokens,
                                        tokens_per_second=12345.6, sync_exposed_seconds=0.5,
                                        bytes_up=100, bytes_down=200,
                                        time=start + step))  # fmt: skip
            writer.flush()
    return MetricsReader(store, layout).read()


@pytest.fixture
def rows(metrics) -> list[ReplicaStatus]:
    """``diloco status``'s rows for the fixture run, seen 42 s after its last line; each flag
    once, and one replica whose id and platform are hostile (rows are plain data: a future
    source may be looser than today's key rules)."""
    found = replica_statuses(metrics, [], lambda _: "unknown", now=T0 + 108 + 42)
    found[0] = dataclasses.replace(found[0], state="running", loss=math.nan)
    found[1] = dataclasses.replace(found[1], state="failed", divergences=1, mirror_failures=2,
                                   superseded=1, clock_skew=7.4)  # fmt: skip
    found[2] = dataclasses.replace(found[2], state="timed_out")
    hostile = dataclasses.replace(found[0], replica=f"k8s-{HOSTILE}", platform=HOSTILE,
                                  state="done")  # fmt: skip
    return [*found, hostile]


FACTS = PageFacts(title=RUN, written_at=WRITTEN, host="runner-7", outer_steps=10, notes=NOTES,
                  spend=SPEND)  # fmt: skip


def _page(rows, metrics, refresh_seconds: int = REFRESH_SECONDS, **overrides) -> str:
    return render_page(rows, metrics, dataclasses.replace(FACTS, **overrides), refresh_seconds)


def _document(rows, **overrides) -> dict:
    return status_document(rows, dataclasses.replace(FACTS, **overrides))


class _Page(HTMLParser):
    """Tags left open or closed out of order, table rows' cell texts, and every URL the page
    names (src, srcset, href)."""

    VOID = frozenset({"meta", "img", "source", "br", "link", "input"})

    def __init__(self, text: str) -> None:
        super().__init__()
        self.open: list[str] = []
        self.misnested: list[str] = []
        self.rows: list[list[str]] = []
        self.urls: list[str] = []
        self.tags: set[str] = set()
        self._cell: list[str] | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.urls += [value for name, value in attrs if name in ("src", "srcset", "href")]
        if tag == "tr":
            self.rows.append([])
        if tag == "td":
            self._cell = []
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_endtag(self, tag):
        if not self.open or self.open.pop() != tag:
            self.misnested.append(tag)
        if tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def test_the_page_shows_every_replica_in_diloco_status_columns_and_the_headline(rows, metrics):
    page = _Page(text := _page(rows, metrics))
    assert (page.open, page.misnested) == ([], [])
    assert text.startswith("<!DOCTYPE html>")
    header, *body = page.rows
    assert header == []  # the header row has th cells
    by_replica = {cells[0]: cells for cells in body}
    assert list(by_replica) == [row.replica for row in rows]
    assert by_replica["local-0"] == [
        "local-0", "local", "running", "2", "nan", "2.200", "12,346", "-", "0%", "0/0", "2 min ago"
    ]  # fmt: skip
    assert by_replica["local-1"][2:4] == [
        "failed diverged 1x mirror failed 2x superseded 1x clock +7s", "2"
    ]  # fmt: skip
    assert by_replica["local-1"][9:] == ["1/0", "42 s ago"]  # restarted once, never healed
    assert "run status-run" in text
    assert "written 2026-11-02 09:30 UTC by the keeper on runner-7" in text
    assert (
        "1 of 4 replicas running (1 done, 1 failed, 1 timed_out), outer step 2 of 10, "
        "1 restart, est. spent $84.10, budget $200" in text
    )
    for state, colour in [("running", "ok"), ("failed", "bad"), ("timed_out", "warn")]:
        assert f'class="state {colour}">{state}<' in text
    assert 'class="state quiet">done<' in text
    assert "restarted local-2 (attempt 2): its job failed with exit 1" in text
    for command in ("diloco keep", "diloco stop", "diloco status --url", "docs/backends.md"):
        assert command in text


def test_nothing_from_the_bucket_or_a_person_is_markup(rows, metrics):
    text = _page(rows, metrics, title=f"r{HOSTILE}", host=HOSTILE, spend={HOSTILE: HOSTILE})
    page = _Page(text)
    assert "<script" not in text.lower()
    assert "script" not in page.tags
    assert "<b>" not in text
    assert "&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt; &amp; &lt;b&gt;bold" in text
    hostile_row = next(cells for cells in page.rows if cells and cells[0].startswith("k8s-"))
    assert hostile_row[:2] == [f"k8s-{HOSTILE}", HOSTILE]  # shown as text, whole


def test_the_page_loads_nothing_and_its_plots_are_inline_pngs(rows, metrics):
    """Two plots: as ``diloco report`` draws it, and with larger text for a phone."""
    page = _Page(_page(rows, metrics))
    assert not page.tags & {"script", "link", "iframe", "object"}
    assert len(page.urls) == 2
    for url in page.urls:
        assert url.startswith(PNG_URI)
        png = base64.b64decode(url.removeprefix(PNG_URI), validate=True)
        assert png[:16] == b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
        # 8 inches at 120 dpi, and taller than one panel: "lr" has its own below
        assert struct.unpack(">II", png[16:24]) >= (960, 500)


def test_a_run_with_nothing_yet_says_so_and_refresh_can_be_turned_off(metrics):
    text = _page([], {}, refresh_seconds=0)
    assert "No replica launched or reporting yet." in text
    assert "No loss recorded yet." in text
    assert "0 of 0 replicas running, outer step 0 of 10, 0 restarts" in text
    assert 'http-equiv="refresh"' not in text
    assert '<meta http-equiv="refresh" content="300">' in _page([], {})


def test_a_time_without_a_zone_is_refused(rows):
    with pytest.raises(ValueError, match="no time zone"):
        _document(rows, written_at=datetime(2026, 11, 2, 9, 30))


def test_status_json_round_trips_with_the_headline_and_nan_as_null(rows):
    document = _document(rows)
    assert json.loads(json.dumps(document, allow_nan=False)) == document
    assert document["written_at"] == "2026-11-02T09:30:00+00:00"
    assert (document["written_by"], document["notes"]) == ("runner-7", list(NOTES))
    headline = document["headline"]
    assert headline["states"] == {"done": 1, "failed": 1, "running": 1, "timed_out": 1}
    assert (headline["replicas"], headline["outer_step"], headline["outer_steps"]) == (4, 2, 10)
    assert (headline["restarts"], headline["spend"]) == (1, SPEND)
    assert headline["text"].startswith("1 of 4 replicas running")
    assert [row["replica"] for row in document["replicas"]] == [row.replica for row in rows]
    assert document["replicas"][0]["loss"] is None  # NaN: JSON has no word for it
    assert document["replicas"][1]["divergences"] == 1


@pytest.mark.parametrize("name", ["path", "s3", "azure"])
def test_publish_overwrites_both_keys_each_pass_with_their_content_types(
    name, make_backend, rows, metrics
):
    backend, layout = make_backend(name), RunLayout(RUN)
    store = backend.store()
    publish(store, layout, "<p>first pass</p>", _document(rows[:1]))
    page, document = _page(rows, metrics), _document(rows)
    publish(store, layout, page, document)
    assert store.get(layout.status_page()).decode("utf-8") == page
    assert json.loads(store.get(layout.status_json())) == document
    if name == "path":
        return  # a file's type comes from its name (.html, .json)
    fs, root = fsspec.url_to_fs(backend.url, **backend.storage_options)
    types = {key: _content_type(fs.info(f"{root}/{key}"))
             for key in (layout.status_page(), layout.status_json())}  # fmt: skip
    assert types == {layout.status_page(): HTML_TYPE, layout.status_json(): JSON_TYPE}


def _content_type(info: dict) -> str:
    """s3fs and adlfs name it differently."""
    return info.get("ContentType") or info["content_settings"]["content_type"]


@pytest.mark.parametrize("name", ["s3", "azure"])
def test_page_url_is_a_signed_link_a_browser_gets_the_page_from(name, make_backend, rows, metrics):
    store, layout = make_backend(name).store(), RunLayout(RUN)
    page = _page(rows, metrics)
    publish(store, layout, page, _document(rows))
    url = page_url(store, layout, 600)
    assert re.search(r"[?&](X-Amz-Signature|sig)=", url)
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.headers["Content-Type"] == HTML_TYPE
        assert response.read().decode("utf-8") == page


def test_page_url_of_a_local_store_is_its_file(tmp_path, rows, metrics):
    store, layout = Store(str(tmp_path / "store")), RunLayout(RUN)
    page = _page(rows, metrics)
    publish(store, layout, page, _document(rows))
    url = page_url(store, layout)
    assert url == (tmp_path / "store" / RUN / "status" / "index.html").as_uri()
    with urllib.request.urlopen(url) as response:
        assert response.read().decode("utf-8") == page


def test_a_store_that_cannot_sign_says_where_the_page_is_in_its_console(make_backend):
    """GCS signs only with a service account's key; the emulator has none."""
    store, layout = make_backend("gcs").store(), RunLayout(RUN)
    with pytest.raises(StoreError) as error:
        page_url(store, layout)
    message = str(error.value)
    assert "GCS signs links only with a service account's key" in message
    prefix = store.url.removeprefix("gs://diloco/")
    assert message.endswith(
        f"Open it from the bucket's console instead: bucket 'diloco', object "
        f"'{prefix}/{RUN}/status/index.html' ({store.url}/{RUN}/status/index.html)"
    )


def test_console_location_names_the_bucket_and_the_object():
    key = "run/status/index.html"
    assert console_location("s3://b/pre/fix", key) == (
        "bucket 'b', object 'pre/fix/run/status/index.html' (s3://b/pre/fix/run/status/index.html)"
    )
    assert console_location("az://container", key).startswith(
        "bucket 'container', object 'run/status/index.html'"
    )
    assert console_location("hf://buckets/ns/bkt/p", key).startswith(
        "bucket 'ns/bkt', object 'p/run/status/index.html'"
    )


@pytest.mark.integration
def test_chromium_renders_the_page_as_text_at_laptop_and_phone_widths(tmp_path, rows, metrics):
    """A real browser: the hostile strings are text in the DOM, no script element exists,
    and the page renders at both widths. Skipped where Chromium is not installed."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        reason = "chromium is not installed here (apt-get install chromium): browser check skipped"
        print(reason)
        pytest.skip(reason)
    (path := tmp_path / "index.html").write_text(_page(rows, metrics), encoding="utf-8")

    def browse(*arguments: str) -> str:
        command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                   "--no-first-run", "--disable-background-networking",
                   "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                   f"--user-data-dir={tmp_path / 'profile'}", *arguments,
                   path.as_uri()]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=True)
        return done.stdout

    dom = browse("--dump-dom")
    assert "<script" not in dom.lower()
    assert "k8s-&lt;script&gt;alert('pwned')&lt;/script&gt;" in dom
    for size in ("1280,900", "412,900"):
        shot = tmp_path / f"shot-{size.replace(',', 'x')}.png"
        browse(f"--screenshot={shot}", f"--window-size={size}")
        width, _ = struct.unpack(">II", shot.read_bytes()[16:24])
        assert width == int(size.split(",")[0])

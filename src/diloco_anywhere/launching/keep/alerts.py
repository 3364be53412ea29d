"""Tell someone when an unattended run needs them: one webhook message per event, sent once.

Whoever observes an event first sends it (a keeper pass on a CI runner, another on a laptop,
``diloco launch`` following the run): each event has an id, and sending starts by creating
``launches/{n}/alerts/{id}`` in the run's bucket, create-only, so of several observers exactly
one sends. The record keeps the text, which the status page lists (``status_page.py``). A
send that fails gives the record back, so a later pass tries again (a failure after the
webhook took the message can repeat it once).

The webhook's URL is a secret (anyone holding it can post): it comes from the environment
variable ``[alerts] webhook_env`` names, never from run.toml, and is never printed. The body
is what Slack's incoming webhooks (``{"text": ...}``), Google Chat and Mattermost read, or
Discord's (``{"content": ...}``, https://discord.com/developers/docs/resources/webhook) for a
Discord URL. Without the variable, alerts are still recorded in the bucket, and not sent.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import urllib.request
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import Field

from diloco_anywhere.backends.base import one_line
from diloco_anywhere.bucket.format.framing import Name, WireFormatError
from diloco_anywhere.bucket.format.layout import RunLayout
from diloco_anywhere.bucket.format.record import (
    RECORD_READ_LIMIT,
    Record,
    decode_record,
    encode_record,
)
from diloco_anywhere.bucket.store import Store
from diloco_anywhere.config import AlertsSection

log = logging.getLogger(__name__)
SEND_TIMEOUT = 10.0  # seconds; a keeper pass must not hang on a chat service
DISCORD_HOSTS = ("discord.com", "discordapp.com")
MAX_TEXT = 1900  # Discord refuses more than 2,000 characters of content


@dataclass(frozen=True)
class Alert:
    event: str  # unique per occurrence: e.g. "restarted.modal-1.3" (a key name)
    text: str  # one line for people


class AlertRecord(Record):
    event: Name
    text: str = Field(max_length=MAX_TEXT)
    host: str  # the observer's machine
    at: float  # the observer's wall clock, for people
    nonce: str  # makes two observers' bytes differ, so exactly one sends


def webhook_body(url: str, text: str) -> bytes:
    """The JSON the webhook at ``url`` reads: Discord's ``content``, everyone else's ``text``."""
    field = "content" if urlsplit(url).hostname in DISCORD_HOSTS else "text"
    return json.dumps({field: text[:MAX_TEXT]}).encode()


def post(url: str, text: str) -> None:
    """Send ``text`` to the webhook; raises on anything but a 2xx answer."""
    request = urllib.request.Request(
        url, data=webhook_body(url, text), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=SEND_TIMEOUT) as response:
        response.read()


class Alerts:
    """The alerts of one launch: sent once each, recorded in the bucket."""

    def __init__(
        self, store: Store, layout: RunLayout, number: int, settings: AlertsSection
    ) -> None:
        self.store, self.layout, self.number = store, layout, number
        self.url = os.environ.get(settings.webhook_env) or None
        self.variable = settings.webhook_env

    def send(self, alert: Alert) -> bool:
        """Record ``alert`` and send it unless some observer did; True if this call did."""
        key = self.layout.launch_alert(self.number, alert.event)
        record = AlertRecord(
            event=alert.event, text=alert.text[:MAX_TEXT], host=socket.gethostname(),
            at=time.time(), nonce=uuid.uuid4().hex,
        )  # fmt: skip
        try:
            self.store.put(key, encode_record(record))
        except FileExistsError:
            return False
        if self.url is None:
            return True
        try:
            post(self.url, f"[{self.layout.run}] {alert.text}")
        except Exception as exc:  # a chat outage must not stop the keeper; retried next pass
            log.warning("alert %s not sent (webhook $%s): %s", alert.event, self.variable,
                        one_line(exc).replace(self.url, "<webhook>"))  # fmt: skip
            self.store.delete(key)
            return False
        return True

    def recorded(self) -> list[AlertRecord]:
        """Every alert of this launch, oldest first (by their observers' clocks)."""
        keys = self.store.list_prefix(f"{self.layout.launch_folder(self.number)}/alerts")
        records = []
        for key, data in self.store.get_many(keys, limit=RECORD_READ_LIMIT).items():
            if data is None:
                continue  # given back between the listing and the read
            try:
                records.append(decode_record(data, AlertRecord, key=key))
            except WireFormatError as exc:
                log.warning("unreadable alert record: %s", exc)
        return sorted(records, key=lambda record: record.at)

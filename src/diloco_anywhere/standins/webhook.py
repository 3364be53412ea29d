"""A chat webhook stand-in: a loopback HTTP server that keeps every message posted to it, as
Slack's or Discord's incoming webhooks would show them, and can refuse the next few."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class WebhookServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.messages: list[dict] = []
        self.refuse = 0  # answer the next this many posts with 503
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hooks/T000/B000/secret"

    def texts(self) -> list[str]:
        with self.lock:
            return [message.get("text") or message.get("content") for message in self.messages]


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            refused = self.server.refuse > 0
            self.server.refuse -= refused
            if not refused:
                self.server.messages.append(json.loads(body))
        self.send_response(503 if refused else 200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        """Quiet: the tests read the messages."""

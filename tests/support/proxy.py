"""A recording, fault-injecting HTTP reverse proxy that tests put in front of a stand-in server.

Each request is logged (method, path, query). A ``Fault`` rule answers matching requests with an
error status, after or instead of forwarding them, or resets the connection, a given number of
times; everything else is forwarded unchanged. ``hold()`` keeps every request waiting until
``release()``: a store that does not answer yet.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


@dataclass
class Fault:
    method: str
    status: int = 503
    code: str = "SlowDown"
    message: str = "injected by the test proxy"
    times: int = 1
    path_contains: str = ""
    # "respond": answer without forwarding; "after": forward, then answer with the fault
    # (the store applied the request, the client thinks it failed); "reset": drop the connection.
    mode: str = "respond"

    def matches(self, method: str, path: str) -> bool:
        return self.times > 0 and method == self.method and self.path_contains in path

    def body(self) -> bytes:
        return (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{self.code}</Code>'
            f"<Message>{self.message}</Message></Error>"
        ).encode()


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: str
    status: int


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self.upstream = (target.hostname, target.port)
        self.faults: list[Fault] = []
        self.log: list[Request] = []
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def inject(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)

    def requests(self, method: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.log if method is None or r.method == method]

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(method, path):
                    fault.times -= 1
                    return fault
        return None

    def _record(self, method: str, path: str, status: int) -> None:
        path_only, _, query = path.partition("?")
        with self._lock:
            self.log.append(Request(method, path_only, query, status))

    def _forward(self, method: str, path: str, headers, body: bytes):
        connection = http.client.HTTPConnection(*self.upstream, timeout=60)
        forwarded = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
        connection.request(method, path, body=body or None, headers=forwarded)
        response = connection.getresponse()
        payload = response.read()
        connection.close()
        return response.status, response.getheaders(), payload

    def _handler_class(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, status: int, headers, body: bytes) -> None:
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _reset(self) -> None:
                linger = struct.pack("ii", 1, 0)  # RST instead of FIN on close
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                self.close_connection = True

            def _handle(self) -> None:
                proxy._open.wait()
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._take_fault(self.command, self.path)
                if fault is not None and fault.mode == "reset":
                    proxy._record(self.command, self.path, 0)
                    self._reset()
                    return
                if fault is None or fault.mode == "after":
                    status, headers, payload = proxy._forward(
                        self.command, self.path, self.headers, body
                    )
                if fault is not None:
                    status, headers = fault.status, [("Content-Type", "application/xml")]
                    payload = fault.body()
                proxy._record(self.command, self.path, status)
                self._reply(status, headers, payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle  # noqa: N815 (http.server names)

        return Handler

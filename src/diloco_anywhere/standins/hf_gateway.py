"""A stand-in for the Hugging Face Storage Buckets S3 gateway: moto's S3 server behind a front
that behaves as the gateway documents (hub-docs ``storage-buckets-s3.md``), for tests and
``diloco bench store --standin hf``.

What the front enforces, as the gateway does:

- the namespace is the endpoint's first path segment (``/<namespace>/<bucket>/<key>``); a
  request for another namespace is refused, and the segment is dropped before moto sees it;
- path-style addressing only: a Host naming a bucket (virtual-hosted style) is refused;
- no trailing ``aws-chunked`` checksums (``x-amz-trailer``, ``STREAMING-*`` payloads);
- ListObjects V1 is refused (V2 only);
- forbidden key forms are refused (``hf_buckets.check_gateway_key``);
- GetObject answers a client that is not botocore, aws-cli or aws-sdk-rust with a 302
  redirect to the object (the real gateway sends it to a CDN edge); those clients are proxied;
- PutObject's ``If-None-Match: *`` is moto's, which honours it.

What it cannot show of the real gateway: its rate limits and latency, the Xet storage behind
it, the CDN, how it authorizes a fine-grained token's HFAK keys (moto checks no signature).
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from diloco_anywhere.bucket.hf_buckets import HfBucketError, check_gateway_key

PROXIED_CLIENTS = ("botocore", "aws-cli", "aws-sdk-rust")
STREAMING_PAYLOADS = (
    "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
    "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER",
)
LOCAL_HOSTS = ("127.0.0.1", "localhost")
# Query parameters that make a GET on a bucket something other than a listing.
BUCKET_SUBRESOURCES = ("location", "uploads", "versioning", "policy", "lifecycle", "acl", "cors")


def _error(code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>{message}</Message></Error>"
    ).encode()


class _Front(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    namespace: str
    backend: tuple[str, int]

    def log_message(self, *args: object) -> None:
        """Quiet: a stand-in serving thousands of requests per test."""

    def _refuse(self, status: int, code: str, message: str) -> None:
        self._drain()
        body = _error(code, message)
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _drain(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _problem(self, path: str, query: dict[str, list[str]]) -> tuple[int, str, str] | None:
        """Why the gateway would refuse this request, or None."""
        host = (self.headers.get("Host") or "").split(":")[0]
        if host not in LOCAL_HOSTS:  # <bucket>.<host>: virtual-hosted style
            return 400, "InvalidRequest", "virtual-hosted-style requests are not supported"
        streaming = self.headers.get("x-amz-content-sha256") in STREAMING_PAYLOADS
        if self.headers.get("x-amz-trailer") or streaming:
            return 400, "InvalidRequest", "trailing checksums (aws-chunked) are not supported"
        segments = path.lstrip("/").split("/", 2)
        if segments[0] != self.namespace:
            return 403, "AccessDenied", f"namespace {segments[0]!r} is not this endpoint's"
        listing = len(segments) == 2 and self.command == "GET" and "list-type" not in query
        if listing and not any(name in query for name in BUCKET_SUBRESOURCES):
            return 400, "NotImplemented", "ListObjects (V1) is not supported; use ListObjectsV2"
        if len(segments) == 3:
            try:
                check_gateway_key(unquote(segments[2]), "request")
            except HfBucketError as exc:
                return 400, "InvalidArgument", str(exc)
        return None

    def _forward(self) -> None:
        parts = urlsplit(self.path)
        query = parse_qs(parts.query, keep_blank_values=True)
        problem = self._problem(parts.path, query)
        if problem is not None:
            self._refuse(*problem)
            return
        rest = parts.path.lstrip("/").partition("/")[2]  # without the namespace: moto's path
        target = f"/{rest}" + (f"?{parts.query}" if parts.query else "")
        is_object_get = self.command == "GET" and "/" in rest and not query
        client = (self.headers.get("User-Agent") or "").lower()
        if is_object_get and not any(name in client for name in PROXIED_CLIENTS):
            self._drain()
            self.send_response(302)
            self.send_header("Location", f"http://{self.backend[0]}:{self.backend[1]}{target}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = self._drain()
        headers = {name: value for name, value in self.headers.items() if name.lower() != "host"}
        connection = http.client.HTTPConnection(*self.backend, timeout=120)
        try:
            connection.request(self.command, target, body=body or None, headers=headers)
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        self.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    # http.server dispatches on these names
    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward  # noqa: N815


@contextmanager
def gateway_front(namespace: str, backend: str) -> Iterator[str]:
    """The front on a free local port, forwarding to the S3 server at ``backend``
    (``http://host:port``); yields the endpoint URL with the namespace, as a client sets it."""
    host, _, port = urlsplit(backend).netloc.partition(":")
    handler = type("Front", (_Front,), {"namespace": namespace, "backend": (host, int(port))})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="hf-gateway", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/{namespace}"
    finally:
        server.shutdown()
        server.server_close()

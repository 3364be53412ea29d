"""Transient and permanent store errors, on real traffic: a fault-injecting proxy before moto."""

from __future__ import annotations

import pytest

from diloco_anywhere.bucket import retry
from diloco_anywhere.bucket.errors import StoreError
from diloco_anywhere.bucket.retry import RetryPolicy
from diloco_anywhere.bucket.store import Store
from support.proxy import Fault, FaultProxy

# Quick tries, and a deadline no loaded machine reaches: each fault here ends after a count, so
# the deadline is never the point, and one of 10 s was reached once, before any retry, by a
# first attempt that a loaded machine took that long to send (test_deadline_bounds_the_retries
# tests the deadline itself, on a clock of its own).
FAST_RETRY = RetryPolicy(deadline=600.0, base_delay=0.01, max_delay=0.05)


@pytest.fixture
def s3_proxy(standins):
    server = standins("s3")
    with FaultProxy(server.storage_options["endpoint_url"]) as proxy:
        yield proxy, server


def proxied_store(s3_proxy, prefix: str, retry: RetryPolicy = FAST_RETRY) -> Store:
    proxy, server = s3_proxy
    options = server.storage_options | {"endpoint_url": proxy.url}
    return Store(f"{server.url}/{prefix}", storage_options=options, retry=retry)


@pytest.mark.parametrize(
    ("method", "status", "code"),
    [
        ("PUT", 503, "SlowDown"),
        ("PUT", 409, "ConditionalRequestConflict"),
        ("PUT", 500, "InternalError"),
        ("GET", 503, "SlowDown"),
        ("GET", 500, "InternalError"),
    ],
)
def test_transient_errors_are_retried(s3_proxy, method, status, code):
    proxy, _ = s3_proxy
    store = proxied_store(s3_proxy, f"transient-{method}-{status}")
    proxy.inject(Fault(method, status=status, code=code, times=2, path_contains="/obj"))
    store.put("obj", b"payload")
    assert store.get("obj") == b"payload"
    assert [r.status for r in proxy.requests(method)] == [status, status, 200]
    assert store.stats().retries == 2


def test_connection_reset_is_retried(s3_proxy):
    proxy, _ = s3_proxy
    store = proxied_store(s3_proxy, "reset")
    store.put("obj", b"payload")
    proxy.inject(Fault("GET", mode="reset", times=1, path_contains="/obj"))
    assert store.get("obj") == b"payload"
    assert [r.status for r in proxy.requests("GET")] == [0, 200]


def test_write_applied_but_reported_failed_is_recognised_as_ours(s3_proxy):
    """The store applied the PUT but the client saw a 500: the retry meets 412, reads the
    object back, finds its own bytes, and succeeds instead of reporting a lost race."""
    proxy, _ = s3_proxy
    store = proxied_store(s3_proxy, "ambiguous")
    proxy.inject(Fault("PUT", status=500, code="InternalError", mode="after", path_contains="/obj"))
    store.put("obj", b"mine")
    assert [r.status for r in proxy.requests("PUT")] == [500, 412]
    assert store.get("obj") == b"mine"


def test_lost_race_after_an_ambiguous_failure_is_still_reported(s3_proxy):
    proxy, server = s3_proxy
    rival = Store(f"{server.url}/ambiguous-lost", storage_options=server.storage_options)
    store = proxied_store(s3_proxy, "ambiguous-lost")
    proxy.inject(Fault("PUT", status=503, code="SlowDown", path_contains="/obj"))
    rival.put("obj", b"theirs")
    with pytest.raises(FileExistsError, match="already exists"):
        store.put("obj", b"mine")


def test_permanent_error_surfaces_at_once_naming_key_and_store(s3_proxy):
    proxy, _ = s3_proxy
    store = proxied_store(s3_proxy, "denied")
    proxy.inject(Fault("PUT", status=403, code="AccessDenied", path_contains="/obj"))
    with pytest.raises(StoreError, match=r"put 'obj' in store s3://diloco/denied: access denied"):
        store.put("obj", b"payload")
    assert len(proxy.requests("PUT")) == 1
    assert store.stats().retries == 0


class RetryClock:
    """The retry layer's clock, moved by its own sleeps alone: what the deadline bounds (no
    attempt starts past it) is then measured exactly, however long a loaded machine takes to
    answer each request (a wall-clock bound of "the deadline plus one request" was not)."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_deadline_bounds_the_retries(s3_proxy, monkeypatch):
    proxy, _ = s3_proxy
    clock = RetryClock()
    monkeypatch.setattr(retry, "time", clock)
    store = proxied_store(s3_proxy, "deadline", RetryPolicy(deadline=2.0, base_delay=0.05))
    proxy.inject(Fault("GET", status=503, code="SlowDown", times=10_000))
    with pytest.raises(StoreError, match=r"get 'obj' in store .*still failing after 2s"):
        store.get("obj")
    assert sum(clock.slept) <= 2.0  # no attempt started past the deadline
    assert len(proxy.requests("GET")) == len(clock.slept) + 1 >= 2  # one per start, no more


def test_user_sdk_options_keep_retries_ours(s3_proxy):
    """A user's botocore config is merged into ours, not swapped for it: botocore still tries
    once, so our layer sees (and counts) the fault."""
    proxy, server = s3_proxy
    options = server.storage_options | {
        "endpoint_url": proxy.url,
        "config_kwargs": {"connect_timeout": 5},
    }
    store = Store(f"{server.url}/merged", storage_options=options, retry=FAST_RETRY)
    proxy.inject(Fault("GET", status=500, code="InternalError", path_contains="/obj"))
    with pytest.raises(FileNotFoundError):
        store.get("obj")
    assert [r.status for r in proxy.requests("GET")] == [500, 404]
    assert store.stats().retries == 1


def test_reads_send_no_head_before_get(s3_proxy):
    proxy, _ = s3_proxy
    store = proxied_store(s3_proxy, "nohead")
    store.put("a", b"x" * 100_000)
    store.get("a")
    store.get("a", 10, 20)
    store.get_many(["a", "missing"], limit=100)
    assert proxy.requests("HEAD") == []
    assert len(proxy.requests("GET")) == 4


def test_gcs_writes_carry_if_generation_match_zero(standins):
    """The GCS emulator ignores the precondition, so check that our request carries it."""
    server = standins("gcs")
    with FaultProxy(server.storage_options["endpoint_url"]) as proxy:
        options = server.storage_options | {"endpoint_url": proxy.url}
        Store(f"{server.url}/precondition", storage_options=options).put("obj", b"x")
    uploads = [r for r in proxy.requests("POST") if "/upload/" in r.path]
    assert len(uploads) == 1
    assert "ifGenerationMatch=0" in uploads[0].query


def test_errors_never_echo_credentials(s3_proxy):
    proxy, _ = s3_proxy
    store = proxied_store(s3_proxy, "secrets")
    echoed = "denied for https://a.blob.core.windows.net/c/k?sv=1&amp;sig=SECRETSIG"
    proxy.inject(Fault("GET", status=400, code="InvalidArgument", message=echoed))
    with pytest.raises(StoreError) as info:
        store.get("obj")
    assert "SECRETSIG" not in str(info.value)
    assert "sig=***" in str(info.value)
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__

"""Transient-error classification on the exception types each SDK really raises."""

from __future__ import annotations

import errno
import itertools
import random

import pytest
from aiohttp import ClientConnectionError, ServerDisconnectedError
from azure.core.exceptions import HttpResponseError, ServiceResponseError
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError
from gcsfs.retry import HttpError

from diloco_anywhere.bucket.retry import (
    RetryDeadlineError,
    RetryPolicy,
    call_with_retry,
    is_transient,
)
from diloco_anywhere.collective.policy import RoundPolicy


def s3_error(status: int, code: str) -> OSError:
    """What s3fs raises: an OSError whose cause is botocore's ClientError."""
    response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    translated = OSError(errno.EIO, code)
    translated.__cause__ = ClientError(response, "PutObject")
    return translated


def azure_error(status: int) -> HttpResponseError:
    error = HttpResponseError(message="injected")
    error.status_code = status
    return error


@pytest.mark.parametrize(
    "exc",
    [
        s3_error(503, "SlowDown"),
        s3_error(409, "ConditionalRequestConflict"),
        s3_error(500, "InternalError"),
        EndpointConnectionError(endpoint_url="http://x"),
        ReadTimeoutError(endpoint_url="http://x"),
        ServerDisconnectedError(),
        ClientConnectionError(),
        ServiceResponseError("connection dropped"),
        azure_error(503),
        azure_error(429),
        HttpError({"code": 503, "message": "backend error"}),
        ConnectionResetError(),
        TimeoutError(),
    ],
    ids=repr,
)
def test_transient(exc):
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        s3_error(403, "AccessDenied"),
        s3_error(409, "BucketNotEmpty"),
        s3_error(400, "InvalidArgument"),
        azure_error(404),
        HttpError({"code": 403, "message": "forbidden"}),
        FileNotFoundError("k"),
        FileExistsError("k"),
        PermissionError("k"),
        ValueError("bad"),
    ],
    ids=repr,
)
def test_permanent(exc):
    assert not is_transient(exc)


def test_transient_errors_retry_until_success():
    failures = iter([ConnectionResetError(), TimeoutError()])
    seen: list[BaseException] = []

    def flaky() -> str:
        error = next(failures, None)
        if error:
            raise error
        return "ok"

    policy = RetryPolicy(deadline=600, base_delay=0.001)  # never the point: no clock decides
    assert call_with_retry(flaky, policy, on_retry=seen.append) == "ok"
    assert [type(e) for e in seen] == [ConnectionResetError, TimeoutError]


def test_permanent_error_is_raised_without_retry():
    calls = []

    def denied():
        calls.append(1)
        raise PermissionError("no")

    with pytest.raises(PermissionError):
        call_with_retry(denied, RetryPolicy(deadline=600))
    assert calls == [1]


def test_deadline_error_keeps_the_last_cause():
    def always_down():
        raise ConnectionRefusedError("down")

    with pytest.raises(RetryDeadlineError, match=r"still failing after 0\.05s") as info:
        call_with_retry(always_down, RetryPolicy(deadline=0.05, base_delay=0.01))
    assert isinstance(info.value.__cause__, ConnectionRefusedError)


def test_backoff_is_jittered_exponential_and_capped():
    delays = RetryPolicy(base_delay=0.1, max_delay=1.0).delays()
    drawn = [next(delays) for _ in range(2000)]
    assert all(0 <= d <= min(1.0, 0.1 * 2 ** min(i, 64)) for i, d in enumerate(drawn))
    assert len(set(drawn[:12])) == 12
    assert max(drawn[:3]) < max(drawn[10:20])  # the window grows (0.1, 0.2, 0.4 ... 1.0)


def test_jitter_leaves_pythons_global_generator_alone() -> None:
    """Polls and retries, however many the store's timing asks for, draw nothing from
    Python's global generator: a training script's own draws from it stay reproducible (and
    a replica restored to its saved generator states goes on as it did)."""
    random.seed(3)
    expected = random.random()
    random.seed(3)
    list(itertools.islice(RetryPolicy().delays(), 5))
    list(itertools.islice(RoundPolicy().poll_delays(), 5))
    assert random.random() == expected

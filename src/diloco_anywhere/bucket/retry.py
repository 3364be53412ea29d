"""Retry transient object-store errors with jittered exponential backoff inside a deadline.

Object stores fail transiently all the time: S3 answers 503 SlowDown past 3,500 PUT/s per prefix
and 409 ConditionalRequestConflict while two conditional writes to one key race; connections reset;
GCS and Azure answer 429 and 5xx. Those are retried. Everything else (missing key, key exists,
access denied, bad request) is permanent and surfaces at once.

The classifier reads the exception chain by duck typing, so it needs none of the optional SDKs:
botocore errors carry ``response["ResponseMetadata"]["HTTPStatusCode"]``, azure-core errors
``status_code``, gcsfs errors ``code``, aiohttp errors ``status``.

Backoff is "full jitter" (AWS Architecture Blog, "Exponential Backoff and Jitter", 2015): a uniform
draw in ``[0, min(max_delay, base_delay * 2**attempt)]``, so racing replicas spread out.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
# Jitter draws from a generator of its own, never from Python's global one: how often a
# replica polls and retries follows the store's timing, and a training script's own draws
# from ``random`` (data order, augmentation) must not shift with it, or a replica restored
# to its saved generator states (training/recovery/own_state.py) would not go on as it did.
JITTER = random.Random()

# HTTP statuses worth another try: request timeout, throttling, server errors.
TRANSIENT_HTTP_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Service error codes worth another try whatever their status (S3 names).
TRANSIENT_ERROR_CODES = frozenset(
    {
        "SlowDown",
        "ConditionalRequestConflict",  # S3 409: a concurrent conditional write to the key
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "OperationAborted",
    }
)
# Exception class names (anywhere in the MRO) that mean the connection, not the request, failed.
TRANSIENT_CLASS_NAMES = frozenset(
    {
        "ConnectionError",  # builtin (resets, refused, aborted) and requests'
        "TimeoutError",  # builtin, asyncio's on 3.11+
        "IncompleteReadError",
        "HTTPClientError",  # botocore: EndpointConnectionError, ReadTimeoutError, ...
        "ClientConnectionError",  # aiohttp: ServerDisconnectedError, ClientOSError, ...
        "ClientPayloadError",  # aiohttp: body cut short
        "ServerTimeoutError",  # aiohttp
        "ServiceRequestError",  # azure-core: request never reached the service
        "ServiceResponseError",  # azure-core: connection dropped before the response
        "Timeout",  # requests (gcsfs uses it for some calls)
    }
)
# Permanent by nature, even when a transient-looking error is buried in their cause.
PERMANENT_TYPES = (FileNotFoundError, FileExistsError, PermissionError, ValueError, TypeError)


@dataclass(frozen=True)
class RetryPolicy:
    """How long one store operation may keep retrying, and how it spaces the tries."""

    deadline: float = 120.0
    base_delay: float = 0.05
    max_delay: float = 5.0

    def delays(self) -> Iterator[float]:
        """Full-jitter delays, forever; the caller stops at the deadline."""
        attempt = 0
        while True:
            yield JITTER.uniform(0.0, min(self.max_delay, self.base_delay * 2**attempt))
            attempt = min(attempt + 1, 64)  # past the cap anyway; 2**1024 would overflow a float


class RetryDeadlineError(TimeoutError):
    """A transient error kept coming back until the operation's deadline passed."""


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _http_status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status, response.get("Error", {}).get("Code")
    for attribute in ("status_code", "status", "code"):
        value = getattr(exc, attribute, None)
        if isinstance(value, int) and 100 <= value <= 599:
            return value, getattr(exc, "error_code", None)
    return None, None


def http_status(exc: BaseException) -> int | None:
    """The first HTTP status in ``exc``'s chain (an SDK error under fsspec's ``OSError``)."""
    for cause in _causes(exc):
        status, _ = _http_status_and_code(cause)
        if status is not None:
            return status
    return None


def is_transient(exc: BaseException) -> bool:
    """True when retrying the same request may succeed."""
    for cause in _causes(exc):
        status, code = _http_status_and_code(cause)
        if code in TRANSIENT_ERROR_CODES:
            return True
        if status is not None:
            return status in TRANSIENT_HTTP_STATUS
        if any(cls.__name__ in TRANSIENT_CLASS_NAMES for cls in type(cause).__mro__):
            return True
        if isinstance(cause, PERMANENT_TYPES):
            return False
    return False


def call_with_retry(
    operation: Callable[[], T],
    policy: RetryPolicy,
    *,
    on_retry: Callable[[BaseException], None] = lambda exc: None,
) -> T:
    """Run ``operation`` until it succeeds, fails permanently, or the deadline passes."""
    deadline = time.monotonic() + policy.deadline
    delays = policy.delays()
    while True:
        try:
            return operation()
        except Exception as exc:
            if not is_transient(exc):
                raise
            delay = next(delays)
            if time.monotonic() + delay > deadline:
                raise RetryDeadlineError(
                    f"still failing after {policy.deadline:g}s of retries: {exc!r}"
                ) from exc
            on_retry(exc)
            time.sleep(delay)

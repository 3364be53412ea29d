"""What each cloud SDK is told besides the user's storage options.

``Store`` promises one retry layer (``retry.py``), fresh listings and no extra request before a
GET; the SDKs' own defaults break each of these, and each SDK takes its settings in its own
shape (a constructor option, a class attribute, a keyword per write). These tables hold them per
fsspec protocol, with the merge that lays a user's options over them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from diloco_anywhere.bucket.schemes import CONDITIONAL_PUT_PROTOCOLS

# Defaults per remote protocol; a user's storage options override them.
REMOTE_DEFAULTS: dict[str, dict[str, Any]] = {
    "s3": {
        # With max_concurrency > 1, s3fs sends a HEAD before every whole-object GET.
        "max_concurrency": 1,
        # One retry layer owns the deadline and the counters: ours. botocore tries once;
        # s3fs's own loop is set to one attempt below (SDK_ATTRIBUTES).
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
    },
}
# Settings some SDKs take only as attributes (s3fs: ``retries``, a class attribute).
SDK_ATTRIBUTES: dict[str, dict[str, Any]] = {"s3": {"retries": 1}}
# Listings must be fresh: peers create keys all the time.
COMMON_REMOTE_DEFAULTS = {"use_listings_cache": False, "skip_instance_cache": True}

# How each SDK takes an object's Content-Type: what a browser opening the object's URL is told.
CONTENT_TYPE_ARGUMENTS: dict[str, Callable[[str], dict[str, Any]]] = {
    "s3": lambda content_type: {"ContentType": content_type},
    "gcs": lambda content_type: {"content_type": content_type},
    "abfs": lambda content_type: {"content_settings": {"content_type": content_type}},
}

# How each SDK uploads a local file (``Store.put_file``): in parts of 16 MiB, a few at a time,
# so a checkpoint's part of any size holds tens of MiB in memory (s3fs reads a file under twice
# its chunk size whole, and uploads ten parts at a time by default; gcsfs one chunk; Azure's
# SDK below 64 MiB whole, then 4 MiB blocks).
UPLOAD_BYTES = 16 << 20
UPLOAD_OPTIONS: dict[str, dict[str, Any]] = {
    "s3": {"chunksize": UPLOAD_BYTES, "max_concurrency": 4},
    "gcs": {"chunksize": UPLOAD_BYTES},
    "abfs": {"max_concurrency": 4},
}

# What a filesystem that signs URLs needs besides the store's options. S3: SigV4, which botocore
# does not use for presigning unless asked (its SigV2 is deprecated by AWS and refused by
# S3-compatible stores), signed in the bucket's own region (looked up once with a HEAD; s3fs
# skips it where the options name a region or an endpoint).
SIGNING_OPTIONS: dict[str, dict[str, Any]] = {
    "s3": {"config_kwargs": {"signature_version": "s3v4"}, "cache_regions": True},
}


def with_defaults(protocols: frozenset[str], user: dict[str, Any]) -> dict[str, Any]:
    """The ``user``'s storage options laid over the defaults of the filesystem's ``protocols``
    (a local or memory store takes the user's as they are)."""
    if not protocols & CONDITIONAL_PUT_PROTOCOLS:
        return dict(user)
    options: dict[str, Any] = dict(COMMON_REMOTE_DEFAULTS)
    for protocol in sorted(protocols):
        options = merged(options, REMOTE_DEFAULTS.get(protocol, {}))
    return merged(options, user)


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``, nested dicts merged (a user's ``config_kwargs`` keeps
    our ``retries`` setting unless it sets ``retries`` itself)."""
    result = dict(base)
    for name, value in override.items():
        if isinstance(value, dict) and isinstance(result.get(name), dict):
            value = merged(result[name], value)
        result[name] = value
    return result

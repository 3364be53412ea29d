"""Hugging Face Storage Buckets as a store, through the Hub's S3-compatible gateway.

A bucket is mutable, non-versioned object storage on the Hub, addressed
``hf://buckets/<namespace>/<bucket>``. The Hub's own fsspec filesystem (``HfFileSystem``) writes
by commits and has no create-only write, so the store talks to the bucket through the gateway
(hub-docs ``storage-buckets-s3.md``), which honours ``If-None-Match: *`` on PutObject: the same
create-only write as S3, through s3fs, with every guarantee of ``Store``. What the gateway asks
of a client is set here:

- endpoint ``https://s3.hf.co/<namespace>`` (the namespace is a path segment of the endpoint,
  the bucket the first segment of the path), region ``us-east-1``, path-style addressing only;
- ``request_checksum_calculation`` and ``response_checksum_validation`` = ``when_required``:
  recent botocore sends trailing ``aws-chunked`` CRC checksums, which the gateway does not parse;
- credentials: an access key id ``HFAK...`` and its secret, generated from a user access token
  (token settings, "Generate S3 credentials"), read from ``HF_BUCKETS_ACCESS_KEY_ID`` and
  ``HF_BUCKETS_SECRET_ACCESS_KEY`` (names of our own: ``AWS_*`` stay free for an S3 store or
  mirror in the same run), never printed;
- object keys must not start or end with ``/``, contain ``//``, ``../`` or ``\\``, start with
  ``./`` or end with ``..``: ``check_key`` rules out all but the last, checked here up front.

Model, dataset and Space repositories (``hf://datasets/...``) are refused: a commit is the only
write there, and commits cannot make a create-only key.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

ENV_ACCESS_KEY = "HF_BUCKETS_ACCESS_KEY_ID"
ENV_SECRET_KEY = "HF_BUCKETS_SECRET_ACCESS_KEY"
ENV_ENDPOINT = "HF_BUCKETS_ENDPOINT"  # the gateway; a stand-in's in tests
GATEWAY = "https://s3.hf.co"
REGION = "us-east-1"
# The Hub's names: a user or organization, and a bucket name as the Hub allows repository names.
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}"
_BUCKET_URL = re.compile(
    rf"hf://buckets/(?P<namespace>{_NAME})/(?P<bucket>{_NAME})(?P<prefix>/.*)?"
)
CREDENTIALS_HELP = (
    f"set {ENV_ACCESS_KEY} and {ENV_SECRET_KEY}: in your Hugging Face token settings, open a "
    f"write token's menu and choose Generate S3 credentials (the key id starts with HFAK)"
)


class HfBucketError(ValueError):
    """An ``hf://`` URL no store can open, or no credentials for one; the message says why."""


@dataclass(frozen=True)
class BucketUrl:
    namespace: str
    bucket: str
    prefix: str  # no leading or trailing '/'; '' for the bucket's root

    @property
    def s3_url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def parse_bucket_url(url: str) -> BucketUrl:
    """The namespace, bucket and prefix of ``hf://buckets/<namespace>/<bucket>[/prefix]``;
    ``HfBucketError`` saying why for any other ``hf://`` URL."""
    match = _BUCKET_URL.fullmatch(url.rstrip("/"))
    if match is None:
        if not url.startswith("hf://buckets/"):
            raise HfBucketError(
                f"store {url}: only Hugging Face Storage Buckets can be a store "
                f"(hf://buckets/<namespace>/<bucket>[/prefix]); a model, dataset or Space "
                f"repository is written by commits, which have no create-only write"
            )
        raise HfBucketError(
            f"store {url}: expected hf://buckets/<namespace>/<bucket>[/prefix], with a namespace "
            f"and a bucket name of letters, digits, '_', '.', '-'"
        )
    prefix = (match["prefix"] or "").strip("/")
    check_gateway_key(prefix, url)
    return BucketUrl(match["namespace"], match["bucket"], prefix)


def check_gateway_key(key: str, where: str) -> str:
    """``key`` unless the gateway refuses its form (see the module docstring)."""
    if key and (
        key.startswith(("/", "./"))
        or key.endswith(("/", ".."))
        or any(bad in key for bad in ("//", "../", "\\", "\0"))
    ):
        raise HfBucketError(
            f"{where}: key {key!r} is refused by the Hugging Face gateway: no leading or "
            f"trailing '/', no '//', '../' or '\\', not starting with './' or ending with '..'"
        )
    return key


def gateway_options(url: BucketUrl, user: dict[str, Any]) -> dict[str, Any]:
    """s3fs options for the bucket's gateway, under the ``user`` options that the store
    merges over them (a stand-in gives its ``endpoint_url``, with the namespace segment, and
    its ``key`` and ``secret``); ``HfBucketError`` when neither has credentials."""
    key, secret = os.environ.get(ENV_ACCESS_KEY), os.environ.get(ENV_SECRET_KEY)
    if not (user.get("key") or key) or not (user.get("secret") or secret):
        where = f"hf://buckets/{url.namespace}/{url.bucket}"
        raise HfBucketError(f"store {where}: no credentials; {CREDENTIALS_HELP}")
    endpoint = os.environ.get(ENV_ENDPOINT, GATEWAY).rstrip("/")
    return {
        "endpoint_url": f"{endpoint}/{url.namespace}",
        "key": key,
        "secret": secret,
        "client_kwargs": {"region_name": REGION},
        "config_kwargs": {
            "s3": {"addressing_style": "path"},
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        },
    }

"""Which URLs a ``Store`` can open, told from the URL alone.

A store is only as safe as its create-only write, and only some schemes have one (``store.py``
says how each does it). ``config/sections.py`` checks the store URLs of run.toml on load, where no
credentials or network may be at hand, so the check lives here, apart from ``Store``: it builds
no filesystem and needs nothing but fsspec's scheme names.
"""

from __future__ import annotations

import fsspec
from fsspec.utils import get_protocol

from diloco_anywhere.bucket import hf_buckets

# Store schemes and how each does a create-only write.
LOCAL_PROTOCOLS = frozenset({"file", "local"})
MEMORY_PROTOCOLS = frozenset({"memory"})
CONDITIONAL_PUT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
SUPPORTED_SCHEMES = (
    "a local path, file://, memory://, s3://, gs://, az://, hf://buckets/<namespace>/<bucket>"
)
HF_SCHEME = "hf"


def check_store_url(url: str) -> str:
    """``url`` if its scheme is one a ``Store`` can open (no filesystem is built: run.toml
    is checked on load, where no credentials or network may be at hand); ``ValueError`` naming
    the schemes otherwise."""
    scheme = url_scheme(url)
    if scheme == HF_SCHEME:
        hf_buckets.parse_bucket_url(url)
        return url
    if scheme not in LOCAL_PROTOCOLS | MEMORY_PROTOCOLS | CONDITIONAL_PUT_PROTOCOLS:
        raise ValueError(f"scheme {scheme!r} has no create-only write; use {SUPPORTED_SCHEMES}")
    return url


def url_scheme(url: str) -> str:
    return get_protocol(url) if "://" in url else "file"


def url_protocols(url: str) -> frozenset[str]:
    cls = fsspec.get_filesystem_class(get_protocol(url))
    protocol = cls.protocol
    return frozenset([protocol] if isinstance(protocol, str) else protocol)

"""Store URLs and SDK error texts with their credentials taken out, safe for logs.

A store URL may carry user-info or a SAS token in its query, and an SDK's error text may echo a
presigned URL or a connection string. Whatever the store, the config or a replica logs or raises
passes through here first.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit


def redact_url(url: str) -> str:
    """The URL without credentials or query (SAS tokens live there), safe for logs."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    if "@" in parts.netloc:
        netloc = "***@" + netloc
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# Credential-bearing parameters that SDK error texts may echo (SAS tokens, presigned URLs,
# connection strings).
_SECRET_PARAMETER = re.compile(
    r"(?i)\b(sig|AccountKey|SharedAccessSignature|SharedAccessKey|X-Amz-Signature|"
    r"X-Amz-Credential|X-Amz-Security-Token|access_token|token|secret|password)=([^&;\s'\"]+)"
)


def scrub_secrets(text: str) -> str:
    """``text`` with the values of credential parameters replaced by ``***``."""
    return _SECRET_PARAMETER.sub(lambda m: f"{m.group(1)}=***", text)

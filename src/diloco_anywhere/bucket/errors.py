"""The one error a store raises for a failure that is neither a missing nor an existing key.

Its own module so that ``Store`` and the local-disk writes (``local_files.py``) raise the same
class, and callers that only catch it (the CLI, a replica) need not load the store.
"""

from __future__ import annotations


class StoreError(OSError):
    """A store operation failed for good (not a missing or an existing key).

    Raised without the SDK's exception chained (its text may echo credentials); the message
    carries the cause's type and its text with credential parameters scrubbed.
    """

"""Launchers: one module per platform behind one protocol (``base.Backend``)."""

from __future__ import annotations

from diloco_anywhere.backends.base import Backend
from diloco_anywhere.backends.local import LocalBackend

BACKENDS: dict[str, type[Backend]] = {"local": LocalBackend}


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not available; choose from {', '.join(BACKENDS)}")
    return BACKENDS[name]()

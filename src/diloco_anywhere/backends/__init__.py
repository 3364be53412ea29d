"""Launchers: one module per platform, each one subclass of ``base.Backend``.

A platform's module imports its SDK only when used, so a missing SDK costs nothing until a
launch asks for that platform, and then ``check()`` says how to install it. Its class
registers itself under its name (``Backend.registry``) when its module is imported, which
``backend_class`` does on first use: the names alone (``BACKENDS``) import no platform.
Adding a platform: docs/backends.md, "Adding a platform".
"""

from __future__ import annotations

from importlib import import_module

from diloco_anywhere.backends.base import Backend
from diloco_anywhere.config import RunConfig

# The platforms, each the module of that name in this package, in the order help and errors
# list them (local first: the default).
BACKENDS: tuple[str, ...] = ("local", "modal", "hf_jobs", "sagemaker", "k8s")


def backend_class(name: str) -> type[Backend]:
    """The class of platform ``name`` (its module imported, which registers it)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not available; choose from {', '.join(BACKENDS)}")
    import_module(f"{__name__}.{name}")
    return Backend.registry[name]


def get_backend(name: str, config: RunConfig | None = None) -> Backend:
    """The launcher of platform ``name`` with its ``[backends.<name>]`` settings validated."""
    return backend_class(name)(config or RunConfig())

"""Launchers: one module per platform behind one protocol (``base.Backend``).

A platform's module imports its SDK only when used, so a missing SDK costs nothing until a
launch asks for that platform, and then ``check()`` says how to install it.
"""

from __future__ import annotations

from importlib import import_module

from diloco_anywhere.backends.base import Backend
from diloco_anywhere.config import RunConfig

# name -> "module:class"; the module under diloco_anywhere.backends
BACKENDS: dict[str, str] = {
    "local": "local:LocalBackend",
    "modal": "modal:ModalBackend",
    "hf_jobs": "hf_jobs:HfJobsBackend",
    "sagemaker": "sagemaker:SageMakerBackend",
    "k8s": "k8s:KubernetesBackend",
}


def get_backend(name: str, config: RunConfig | None = None) -> Backend:
    """The launcher of platform ``name`` with its ``[backends.<name>]`` settings validated."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not available; choose from {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    backend_class = getattr(import_module(f"diloco_anywhere.backends.{module}"), cls)
    return backend_class(config or RunConfig())

"""What the checks run on: the device, Python, torch and CUDA, and every package the runtime
needs with its version there, against this project's floors (pyproject and
requirements-runtime.txt, read from the installed project's metadata): on a lent GPU the
packages are the image's own and the carried wheels (``make gpu-wheels``), so this is where a
floor the image does not meet shows up."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Any

import torch

PROJECT = "diloco-anywhere"
EXTRAS = ("hf-task",)  # what the checks use beyond the runtime: the Hugging Face task


def _requirements() -> list[Any]:
    from packaging.requirements import Requirement

    environment = {"extra": ""}
    wanted = []
    for text in metadata.requires(PROJECT) or []:
        requirement = Requirement(text)
        marker = requirement.marker
        if (
            marker is None
            or marker.evaluate(environment)
            or any(marker.evaluate({"extra": extra}) for extra in EXTRAS)
        ):
            wanted.append(requirement)
    return wanted


def packages() -> list[dict[str, Any]]:
    """Each requirement, the version installed (None: missing) and whether it satisfies it."""
    rows = []
    for requirement in _requirements():
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            version = None
        satisfied = version is not None and requirement.specifier.contains(
            version, prereleases=True
        )
        rows.append({"requirement": str(requirement), "version": version, "satisfied": satisfied})
    return rows


def describe(device: torch.device) -> dict[str, Any]:
    gpu = None
    if device.type == "cuda" and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(device)
        gpu = {"name": properties.name, "memory_gib": properties.total_memory / 2**30,
               "capability": f"{properties.major}.{properties.minor}",
               "cuda": torch.version.cuda, "nccl": _nccl()}  # fmt: skip
    return {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": torch.__version__, "device": device.type, "gpu": gpu,
        "cpus": torch.get_num_threads(), "packages": packages(),
    }  # fmt: skip


def _nccl() -> str | None:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        return None


def line(environment: dict[str, Any]) -> str:
    """One line of it: what ran where, and any floor not met."""
    gpu = environment["gpu"]
    where = f"{gpu['name']} ({gpu['memory_gib']:.0f} GiB, CUDA {gpu['cuda']})" if gpu else "CPU"
    unmet = [
        f"{row['requirement']} (found {row['version']})"
        for row in environment["packages"]
        if not row["satisfied"]
    ]
    floors = f"; not met: {', '.join(unmet)}" if unmet else "; every requirement met"
    return f"{where}, Python {environment['python']}, torch {environment['torch']}{floors}"

"""Imports point down the data path: the launcher's side does not load the replica's training
stack, and the replica does not load the launcher's code (``contract.py`` holds what both
share). Each check imports in a fresh interpreter and reads ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _loaded(module: str) -> set[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    return set(json.loads(done.stdout))


@pytest.mark.parametrize(
    "module",
    ["diloco_anywhere.launching.launch", "diloco_anywhere.launching.keeper",
     "diloco_anywhere.backends.k8s", "diloco_anywhere.backends.modal"],
)  # fmt: skip
def test_the_launchers_side_loads_neither_the_entrypoint_nor_torchft(module):
    loaded = _loaded(module)
    assert "diloco_anywhere.replica" not in loaded
    assert "torchft" not in loaded


def test_the_replica_entrypoint_loads_no_launching_code():
    loaded = _loaded("diloco_anywhere.replica")
    assert not {m for m in loaded if m.startswith("diloco_anywhere.launching")}
    assert "diloco_anywhere.contract" in loaded

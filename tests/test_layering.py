"""Imports point down the data path (import-linter checks the static graph in ``make lint``);
these check what loading really pulls in: the CLI and the launcher's side start without torch
or torchft (``diloco --help`` in a blink), and the replica does not load the launcher's code
(``contract.py`` holds what both share). Each check runs in a fresh interpreter and reads
``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = {"torch", "torchft"}


def _loaded(code: str) -> set[str]:
    """The modules loaded once ``code`` has run (their names on stderr: stdout is the code's)."""
    code += "\nimport json, sys; print(json.dumps(sorted(sys.modules)), file=sys.stderr)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"], ["launch", "--help"],
                                  ["keep", "--help"], ["bench", "--help"]])  # fmt: skip
def test_the_cli_answers_help_without_torch(argv):
    code = f"""
from diloco_anywhere.cli import app
try:
    app({argv!r}, prog_name="diloco")
except SystemExit as exit:
    assert exit.code == 0, exit.code
"""
    assert not _loaded(code) & HEAVY


@pytest.mark.parametrize(
    "module",
    ["diloco_anywhere.launching.launch", "diloco_anywhere.launching.keeper",
     "diloco_anywhere.launching.status", "diloco_anywhere.backends.k8s",
     "diloco_anywhere.backends.modal", "diloco_anywhere.config"],
)  # fmt: skip
def test_the_launchers_side_loads_neither_the_entrypoint_nor_torch(module):
    loaded = _loaded(f"import {module}")
    assert "diloco_anywhere.replica" not in loaded
    assert not loaded & HEAVY


def test_the_replica_entrypoint_loads_no_launching_code():
    loaded = _loaded("import diloco_anywhere.replica")
    assert not {m for m in loaded if m.startswith("diloco_anywhere.launching")}
    assert "diloco_anywhere.contract" in loaded

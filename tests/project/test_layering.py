"""Imports point down the data path (import-linter checks the static graph in ``make lint``);
these check what loading really pulls in: the CLI and the launcher's side start without torch
or torchft (``diloco --help`` in a blink), and the replica does not load the launcher's code
(``contract.py`` holds what both share). Each check runs in a fresh interpreter and reads
``sys.modules``."""

from __future__ import annotations

import pytest

from support.imports import HEAVY, loaded_modules

pytestmark = pytest.mark.integration  # every test here starts processes


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
    assert not loaded_modules(code) & HEAVY


@pytest.mark.parametrize(
    "module",
    ["diloco_anywhere.launching.start.launch", "diloco_anywhere.launching.keep.keeper",
     "diloco_anywhere.launching.watch.status", "diloco_anywhere.backends.k8s",
     "diloco_anywhere.backends.modal", "diloco_anywhere.config"],
)  # fmt: skip
def test_the_launchers_side_loads_neither_the_entrypoint_nor_torch(module):
    loaded = loaded_modules(f"import {module}")
    assert "diloco_anywhere.replica" not in loaded
    assert not loaded & HEAVY


def test_the_replica_entrypoint_loads_no_launching_code():
    loaded = loaded_modules("import diloco_anywhere.replica")
    assert not {m for m in loaded if m.startswith("diloco_anywhere.launching")}
    assert "diloco_anywhere.contract" in loaded

"""docs/architecture.md is the map of the package: every folder on it, every path it names still
there; and the house stays one a newcomer can find their way in: no folder past 15 modules side
by side, no module past 500 lines."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from support import ROOT

PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "src" / "diloco_anywhere"
MOST_MODULES = 15


def _package_folders() -> set[str]:
    return {
        "diloco_anywhere/" if init.parent == PACKAGE else f"{init.parent.relative_to(PACKAGE)}/"
        for init in PACKAGE.rglob("__init__.py")
    }


def _section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _first_cells(section: str) -> list[str]:
    """The first cell of every table row below the header, its backticks removed."""
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [row.split("|")[1].strip().strip("`") for row in rows]


def test_every_package_folder_has_its_line_and_every_line_a_folder():
    listed = _first_cells(_section("Folders"))
    assert len(listed) == len(set(listed)), "a folder is listed twice"
    assert set(listed) == _package_folders(), (
        f"missing from the page: {sorted(_package_folders() - set(listed))}; "
        f"on the page but gone: {sorted(set(listed) - _package_folders())}"
    )


def test_where_to_change_names_one_existing_file_for_each_of_ten_things():
    section = _section("Where to change X")
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) >= 10, rows
    for row in rows:
        named = re.findall(r"`([^`]+)`", row)
        assert len(named) == 1, row
        assert (PACKAGE / named[0]).is_file(), f"{named[0]} (in {row!r}) is not in the package"


def test_every_path_the_page_names_exists():
    """A path with a folder in it (``collective/round.py``, ``launching/keep/``) is the
    package's; a test path is the repository's."""
    named = set(re.findall(r"`((?:tests/)?[a-z_]+/[a-z_/]*(?:\.py|\.toml|/))`", PAGE.read_text()))
    assert len(named) > 40, named
    missing = [
        path for path in sorted(named)
        if not (ROOT / path).exists() and not (PACKAGE / path).exists()
        and path != "diloco_anywhere/"
    ]  # fmt: skip
    assert not missing, missing


def test_no_folder_holds_more_than_fifteen_modules_side_by_side():
    crowded = {}
    for init in PACKAGE.rglob("__init__.py"):
        modules = [p for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MOST_MODULES:
            crowded[str(init.parent.relative_to(PACKAGE))] = len(modules)
    assert not crowded, f"more than {MOST_MODULES} modules: {crowded}; give a job its own folder"


def test_no_module_is_longer_than_a_newcomer_reads_at_once():
    """500 lines, 600 for a platform's module in backends/ (its SDK's calls, its limits and
    its stand-in's quirks together)."""
    long = {}
    for module in PACKAGE.rglob("*.py"):
        most = 600 if module.parent.name == "backends" else 500
        if (lines := len(module.read_text().splitlines())) > most:
            long[str(module.relative_to(PACKAGE))] = lines
    assert not long, f"split these where their own seams are: {long}"


@pytest.mark.integration  # asks git
def test_every_link_in_the_repository_points_inside_it():
    """A worktree's links to the main checkout's .venv and .tools (absolute paths) were once
    committed: a fresh clone then had a .venv pointing at a folder it does not have, and git
    replaced the real ones with the links when the branch was merged. Every link git tracks
    is relative and resolves inside the repository (the template's links to the real code)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing tracked to check")
    listed = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    links = [line.split("\t", 1)[1] for line in listed if line.startswith("120000 ")]
    assert links, "the template links to the real code: none found"
    outside = [
        link for link in links
        if Path(os.readlink(ROOT / link)).is_absolute()
        or not (ROOT / link).resolve().is_relative_to(ROOT.resolve())
    ]  # fmt: skip
    assert outside == [], f"links that leave the repository (git rm --cached them): {outside}"

"""The corpus every machine has: the running interpreter's standard library, as text.

The built-in GPT's default (``corpus = "stdlib"``): a demo needs no download and no
credentials. Its ``.py`` sources (no site-packages, no tests) in path order, each cut into
documents of about ``DOCUMENT_CHARS`` characters at line ends, so that even a few hundred KB of
it hold enough documents for a held-out split chosen by document (``heldout.py``). The run's
first replica prepares it into the run's store (``prepare_once.py``), so replicas on other
Python versions train on the same text.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STDLIB = "stdlib"
DOCUMENT_CHARS = 2048


def stdlib_files() -> list[Path]:
    """The standard library's .py files in sorted order, without site-packages and tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [
            name for name in subdirectories if name not in ("site-packages", "test", "tests")
        ]
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(files)


def documents(file: Any) -> Iterator[str]:
    """A source file's text in documents that end at a line, about ``DOCUMENT_CHARS`` each."""
    document: list[str] = []
    size = 0
    for line in file:
        document.append(line)
        size += len(line)
        if size >= DOCUMENT_CHARS:
            yield "".join(document)
            document, size = [], 0
    if document:
        yield "".join(document)

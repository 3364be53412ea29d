"""docs/api.md's examples, as its tests read them: the page is what users copy."""

from __future__ import annotations

import re

from support import ROOT

DOCS = ROOT / "docs" / "api.md"


def example(first_line: str, language: str = "python") -> str:
    """The docs' block whose first line starts with ``first_line``."""
    blocks = re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    [block] = [block for block in blocks if block.startswith(first_line)]
    return block

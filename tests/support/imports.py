"""What importing or running some code loads, read in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = {"torch", "torchft"}


def loaded_modules(code: str) -> set[str]:
    """The modules loaded once ``code`` has run (their names on stderr: stdout is the code's)."""
    code += "\nimport json, sys; print(json.dumps(sorted(sys.modules)), file=sys.stderr)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    return set(json.loads(done.stderr.strip().splitlines()[-1]))

"""Checks for ``diloco bench gpu``'s runner to run (``bench/gpu/runner.py``): real processes
that leave a detached child behind, or never end."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from diloco_anywhere.bench.gpu.outcome import Outcome


def leaves_a_detached_child(device, sizes, work: Path) -> Outcome:
    """Starts a sleeper in a session of its own (as the local backend starts replicas), says
    its pid, and returns."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    (work / "child.pid").write_text(str(child.pid))
    return Outcome("PASS", summary="started a child")


def never_ends(device, sizes, work: Path) -> Outcome:
    while True:
        time.sleep(1)

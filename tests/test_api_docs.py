"""docs/api.md's examples, run exactly as printed: the page is what users copy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def example(first_line: str) -> str:
    """The docs' Python block whose first line starts with ``first_line``."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    [block] = [block for block in blocks if block.startswith(first_line)]
    return block


def test_the_allreduce_example_averages_across_two_processes(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(example("# allreduce.py"))
    store = tmp_path / "store"
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), f"worker-{k}", str(store)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for k in range(2)
    ]  # fmt: skip
    outputs = [worker.communicate(timeout=300) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], outputs
    assert sorted(out for out, _ in outputs) == [
        "worker-0 [0.5, 0.5, 0.5, 0.5]\n",
        "worker-1 [0.5, 0.5, 0.5, 0.5]\n",
    ]

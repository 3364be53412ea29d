"""What several test modules share (on the path through pytest's ``pythonpath``): runs of local
replicas driven through the CLI, checkpoints written and tampered with, the rendered template,
a fault-injecting proxy, checks of what an import loads, and docs/api.md's examples. Fixtures
are in conftest.py."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository

"""``python -m diloco_anywhere.cli``: the ``diloco`` command where its script is not on the
PATH (a project installed into a folder with ``pip --target``, as ``make gpu-check`` does)."""

from diloco_anywhere.cli import app

app()
